"""Lightning checkpoints as gdsckpt files: `Trainer(plugins=[GdsckptCheckpointIO()])`.

Lightning builds one dict per checkpoint (the module's state_dict, the optimizers' and LR
schedulers' state dicts, the loops' progress, the callbacks' state, the hyper-parameters) and
hands it to the strategy's CheckpointIO: every save Lightning makes goes through it
(ModelCheckpoint, `trainer.save_checkpoint`, ModelCheckpoint's removal of old files through
`remove_checkpoint`), and so does every restore (`trainer.fit(model, ckpt_path=...)`, "last",
validate/test/predict with `ckpt_path`). `LightningModule.load_from_checkpoint` does not: it
calls torch.load itself; build the module and `load_state_dict(io.load_checkpoint(path)["state_dict"])`.

The dict is saved as gdsckpt saves any state: tensors in chunks, everything else (ints, floats,
strings, None, bytes, NumPy values, in dicts, lists and tuples) in the file's JSON skeleton.
Loading never unpickles, so `weights_only` is accepted and changes nothing: every load is
weights-only. A value gdsckpt cannot store (a class in the hyper-parameters, an omegaconf
container, a custom object a callback put in its state) is an UnsupportedStateError naming its
key, raised before anything is written.

Works with `lightning.pytorch` and, where it is installed, `pytorch_lightning` (the class is
registered as a CheckpointIO of both), with Lightning's `AsyncCheckpointIO` around it, and with
Fabric (`Fabric(plugins=[GdsckptCheckpointIO()])`, `fabric.save` / `fabric.load`).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

import gdsckpt
from gdsckpt.errors import UnsupportedStateError
from gdsckpt.options import Snapshot, check_save_options

log = logging.getLogger("gdsckpt.integrations.lightning")

try:
    from lightning.fabric.plugins import CheckpointIO
except ImportError:  # pytorch_lightning without the unified `lightning` package
    from lightning_fabric.plugins import CheckpointIO

__all__ = ["GdsckptCheckpointIO"]


class GdsckptCheckpointIO(CheckpointIO):
    """A Lightning CheckpointIO that writes gdsckpt files (atomic and durable on return, as
    `gdsckpt.save`; the folder is created).

    async_save=True: each save goes through `gdsckpt.save_async` and returns once the checkpoint's
    tensors are compressed into host memory (on the GPU: the compressed snapshot, see the README's
    save_async), the write and fsync continuing in the background. A load or removal of a path
    with a save in flight waits for it (whichever instance in the process saves it); `teardown` (end of fit) waits for every save, and a
    failed background save is raised there or by the next call. Lightning's `AsyncCheckpointIO`
    instead runs a whole synchronous save on a thread after cloning every tensor.

    save_options (codec=, chunk_bytes=, ...; with async_save=True also snapshot= "host" or "device"
    and pool_bytes=), checked here, reach gdsckpt.save / save_async; a save's
    `storage_options` (`trainer.save_checkpoint(path, storage_options={...})`) is a dict of the
    same options, for that save only."""

    def __init__(self, *, async_save: bool = False, **save_options: Any):
        super().__init__()
        # checked now, not at the first checkpoint an epoch into the run; save_async's snapshot
        # "overlap" needs an optimizer= that Lightning does not hand a CheckpointIO
        check_save_options(save_options, ("snapshot", "pool_bytes") if async_save else (),
                           (Snapshot.HOST, Snapshot.DEVICE))
        self.async_save = async_save
        self.save_options = save_options
        self._in_flight: list[Any] = []  # its SaveFutures not known finished, oldest first
        self._lock = threading.Lock()  # AsyncCheckpointIO saves from its own thread
        self._removals: list[threading.Event] = []  # remove_checkpoint's, each set once its file is handled

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any = None) -> None:
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"{type(self).__name__}: storage_options must be a dict of gdsckpt.save options "
                            f"(codec=, chunk_bytes=, ...), not {type(storage_options).__name__}")
        options = {**self.save_options, **(storage_options or {})}
        path = _local_path(path)
        self._reap()
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            if self.async_save:
                fut = gdsckpt.save_async(checkpoint, path, **options)
                with self._lock:
                    self._in_flight.append(fut)
            else:
                gdsckpt.save(checkpoint, path, **options)
        except UnsupportedStateError as e:
            e.add_note("gdsckpt.integrations.lightning: a Lightning checkpoint is saved as it is built (state_dict, "
                       "optimizer_states, lr_schedulers, loops, callbacks, hyper_parameters, and what "
                       "on_save_checkpoint adds); its non-tensor values must be plain values, bytes or NumPy in "
                       "dicts, lists and tuples. Convert the value named above there (e.g. in on_save_checkpoint, "
                       "or save_hyperparameters(ignore=[...]))")
            raise

    def load_checkpoint(self, path, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint's dict. map_location: None (each tensor where it was saved from; on the CPU
        where there is no GPU), or a device ("cpu", "cuda:0", a torch.device). weights_only: any
        value; gdsckpt never unpickles."""
        path = _local_path(path)
        self._wait(_resolved(path))
        if not path.exists():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return gdsckpt.load(path, device=_device(map_location))

    def remove_checkpoint(self, path) -> None:
        """Remove the checkpoint file at `path` (after its save, if one is in flight); a missing file
        is not an error, as for Lightning's TorchCheckpointIO. While a save of this instance is in
        flight (ModelCheckpoint removes the previous checkpoint right after it saves the next), the
        file goes only once that save is durable, and stays if it fails: a kill or a failed write
        in between leaves the previous checkpoint, as synchronous saves do."""
        path = _local_path(path)
        self._wait(_resolved(path))
        if path.is_dir() and not path.is_symlink():
            raise IsADirectoryError(f"{type(self).__name__}.remove_checkpoint: {str(path)!r} is a directory, not a "
                                    "checkpoint file this CheckpointIO wrote; not removing it")
        with self._lock:
            newest = self._in_flight[-1] if self._in_flight else None
        if newest is None:
            path.unlink(missing_ok=True)
        else:  # run on the writer's thread as the save commits: before any later save's commit
            removed = threading.Event()  # teardown() waits for it: a future's waiters wake before its callbacks run

            def remove(fut) -> None:
                try:
                    _remove_after(fut, path)
                finally:
                    removed.set()
            with self._lock:
                self._removals.append(removed)
            newest.add_done_callback(remove)

    def teardown(self) -> None:
        """Wait for every save in flight, and the removals waiting for them; raise the first
        save that failed."""
        self._wait(None)

    def _wait(self, resolved: Path | None) -> None:
        """Wait for the saves in flight to `resolved`, this instance's or any other's in the process
        (a new Trainer's plugin, `GdsckptCheckpointIO().load_checkpoint(path)`), or for all of
        this instance's (None); then raise the first failure of any of its finished saves."""
        if resolved is not None:
            gdsckpt.wait_for_saves_to(resolved)
        else:
            with self._lock:
                waiting, removals = list(self._in_flight), list(self._removals)
            for fut in waiting:
                fut.exception()
            for removed in removals:  # the removals those saves' callbacks make
                removed.wait()
            with self._lock:
                self._removals = [r for r in self._removals if not r.is_set()]
        self._reap()

    def _reap(self) -> None:
        """Forget finished saves; raise the first one that failed (the others were looked at too,
        so save_async does not raise them again as unseen)."""
        with self._lock:
            done = [f for f in self._in_flight if f.done()]
            self._in_flight = [f for f in self._in_flight if not f.done()]
        errors = [e for e in (f.exception() for f in done) if e is not None]
        if errors:
            raise errors[0]


def _remove_after(save, path: Path) -> None:
    """`path` removed once `save` (a SaveFuture) is done, if it succeeded; a failed one keeps it."""
    if Future.exception(save) is not None:  # not SaveFuture's: the instance's next call raises it (_reap)
        log.warning("gdsckpt: %s is kept: the save after it failed", path)
        return
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        log.warning("gdsckpt: removing %s after the next checkpoint was saved: %s: %s", path, type(e).__name__, e)


def _local_path(path) -> Path:
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if "://" in text:
        raise ValueError(f"GdsckptCheckpointIO: {text!r} is a URL; it writes local files only (a Checkpointer with "
                         "remote='s3://...' uploads them to an object store)")
    return Path(text)


def _resolved(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _device(map_location) -> str | None:
    if map_location is None:
        return None
    if isinstance(map_location, (str, torch.device)):
        return str(map_location)
    raise TypeError(f"GdsckptCheckpointIO.load_checkpoint: map_location must be None or a device (str or "
                    f"torch.device), not {type(map_location).__name__}: gdsckpt loads every tensor onto one device "
                    "and does not call map_location functions or dicts")


def _register_with_pytorch_lightning() -> None:
    """pytorch_lightning checks its plugins against lightning_fabric's CheckpointIO, a class of its
    own: register ours there too (an ABC's virtual subclass), so that one class serves both."""
    try:
        from lightning_fabric.plugins import CheckpointIO as Standalone
    except ImportError:
        return
    if Standalone is not CheckpointIO:
        Standalone.register(GdsckptCheckpointIO)


_register_with_pytorch_lightning()
