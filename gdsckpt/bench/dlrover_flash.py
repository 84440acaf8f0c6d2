"""DLRover's flash checkpoint (dlrover.trainer.torch.flash_checkpoint, `pip install
'gdsckpt[bench-dlrover]'`), driven for gdsckpt-bench --train's "dlrover flash checkpoint" method:
the published in-memory checkpoint (its 0.2 s anchor), measured in the same run as gdsckpt's
memory tier.

Each checkpoint is DLRover's engine's `save_to_memory` (the state copied into a shared-memory
segment, synchronously, in the training process), every `every_local`-th its `save_to_storage`
(the same copy, and then DLRover's saver process writes the segment to the directory). Run
without `dlrover-run`, as here under plain torchrun or one process, the engine starts that saver
itself (a process forked from local rank 0) and meets it over local sockets and shared memory.
One process: its FullCheckpointEngine (DdpCheckpointer's). Under torchrun: its
FsdpCheckpointEngine (DCP into shared memory) with the FSDP2 state's DTensors, which is what
FsdpShardCheckpointer does after FSDP1's state_dict_type, which FSDP2 has no use for.

What cannot run here is said in one line (`why_unavailable`, or the exception's type and
message where the engine fails to start), and the bench records it in the method's row.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path

PERSIST_TIMEOUT_S = 600  # a step written to the directory by DLRover's saver: waited for at most
LOG_LEVEL_ENV = "DLROVER_LOG_LEVEL"  # DLRover's BasicClass.LOG_LEVEL_ENV
TRACKER = "dlrover_latest.txt"  # DLRover's CheckpointConstant.TRACER_FILE_NAME: the newest step persisted


def why_unavailable() -> str | None:
    """None where DLRover's flash checkpoint imports, else why not (one line)."""
    try:
        _import_quietly()
    except Exception as e:  # noqa: BLE001 - any failure to import is the reason it cannot run
        return (f"DLRover's flash checkpoint cannot be imported ({type(e).__name__}: {e}); "
                "pip install 'gdsckpt[bench-dlrover]'")
    return None


def _import_quietly() -> None:
    """Import DLRover's engines with its loggers at WARNING (its saver process, forked later,
    inherits the setting), and undo the logging.basicConfig(level=INFO) its log module runs on
    import, which would print every library's INFO lines on the bench's stderr."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    os.environ.setdefault(LOG_LEVEL_ENV, "WARNING")
    try:
        import dlrover.trainer.torch.flash_checkpoint.full_ckpt_engine  # noqa: F401
        import dlrover.trainer.torch.flash_checkpoint.fsdp_engine  # noqa: F401
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def open_engine(directory: Path, sharded: bool):
    """DLRover's checkpoint engine for `directory` (its saver process started, or found)."""
    _import_quietly()
    from dlrover.python.common.storage import get_checkpoint_storage
    storage = get_checkpoint_storage(None)
    if sharded:
        from dlrover.trainer.torch.flash_checkpoint.fsdp_engine import FsdpCheckpointEngine
        return FsdpCheckpointEngine(str(directory), storage)
    from dlrover.trainer.torch.flash_checkpoint.full_ckpt_engine import FullCheckpointEngine
    return FullCheckpointEngine(checkpoint_dir=str(directory), storage=storage)


def save(engine, step: int, state: dict, path: Path, to_disk: bool, sharded: bool) -> None:
    """One checkpoint: into shared memory, and where `to_disk` also handed to the saver for
    `path` (a file; sharded: a DCP folder). The full engine takes the state under DLRover's
    model-states key, the FSDP engine as it is (FsdpShardCheckpointer's {"model", "optim"})."""
    from dlrover.python.common.constants import CheckpointConstant
    key = CheckpointConstant.MODEL_STATES_NAME
    what = state if sharded else {key: state}
    (engine.save_to_storage if to_disk else engine.save_to_memory)(step, what, {key: str(path)})


def when_persisted(directory: Path, step: int, timeout: float = PERSIST_TIMEOUT_S) -> Future:
    """A Future of `step`'s write by DLRover's saver: done once the directory's tracker names it
    (DLRover's own wait_latest_checkpoint reads the tracker before the saver has made it); a
    TimeoutError after `timeout`."""
    fut: Future = Future()

    def watch():
        end = time.monotonic() + timeout
        tracker = directory / TRACKER
        while time.monotonic() < end:
            try:
                if int(tracker.read_text().strip() or -1) >= step:
                    fut.set_result(step)
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.005)
        fut.set_exception(TimeoutError(f"DLRover's saver did not persist step {step} to {directory} "
                                       f"in {timeout:.0f} s"))
    threading.Thread(target=watch, name="gdsckpt-bench-dlrover-persisted", daemon=True).start()
    return fut


def stored_bytes(directory: Path) -> int:
    """The bytes DLRover wrote under `directory` (its steps' files)."""
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file() and f.name != TRACKER)


def close(engine) -> None:
    """Unmap and unlink the engine's shared memory (its segment, the state's size, would stay in
    /dev/shm: DLRover's close only unmaps it), and end the saver process the engine started
    (local rank 0's; a daemon, it would otherwise run until the bench exits)."""
    handler = getattr(engine, "_shm_handler", None)  # DLRover's engine keeps its segment's handler here
    engine.close()
    if handler is not None:
        handler.unlink()
    proc = getattr(engine, "saver_proc", None)
    if proc is not None:
        proc.terminate()
        proc.join(10)
    os.sync()
