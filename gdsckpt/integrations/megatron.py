"""Megatron-core: a `dist_checkpointing` strategy that writes gdsckpt files.

    from megatron.core import dist_checkpointing
    from gdsckpt.integrations.megatron import AsyncCallsQueue, load_strategy, save_strategy

    dist_checkpointing.save(sharded_sd, ckpt_dir, sharded_strategy=save_strategy())
    state = dist_checkpointing.load(sharded_sd, ckpt_dir, sharded_strategy=load_strategy())

    # async, as Megatron-LM's training loop schedules it, with no worker process:
    queue = AsyncCallsQueue()
    request = dist_checkpointing.save(sharded_sd, ckpt_dir, sharded_strategy=save_strategy(),
                                      async_sharded_save=True)
    queue.schedule_async_request(request)
    ...  # every step: queue.maybe_finalize_async_calls(blocking=False); at the end blocking=True

The strategies are Megatron's own torch_dist ones (TorchDistSaveShardedStrategy,
TorchDistLoadShardedStrategy) with torch.distributed.checkpoint's storage layer replaced by
gdsckpt's (GdsckptWriter / GdsckptReader): Megatron translates its ShardedTensors and
ShardedObjects for DCP as it does for torch_dist, and DCP plans and reshards; each rank's main
replicas are compressed into its own `__{rank}_0.gdsckpt` (its ShardedObjects, already pickled by
Megatron, into `__{rank}_1.gdsckpt`), DCP's `.metadata` is the DCP commit point and Megatron's
`metadata.json` (backend "gdsckpt") the checkpoint's. Common (non-sharded) state is Megatron's
`common.pt`, as its torch_dist checkpoints held it up to megatron-core 0.18 and 0.19 still reads it.

Async (`async_sharded_save=True`): `async_save` compresses the rank's shards into gdsckpt's host
pool before it returns (pinned memory on the GPU: the state may change at once), and hands the
write, fsync and DCP's commit to one background thread of this process; no process is forked or
spawned. Its AsyncRequest has no `async_fn`: its finalize function waits for that write, then
Megatron's own finalize writes `metadata.json`. So any AsyncCallsQueue runs it without a worker;
this module's `AsyncCallsQueue` (Megatron's interface) finalizes it only once every rank's write is
done, so that `maybe_finalize_async_calls(blocking=False)` never waits. Megatron's own queue
finalizes such a request at its next call, waiting there for the write. Host memory: the pool
holds one save's compressed bytes; a save made while the previous one's write is still running
waits for it before staging (its blocked time), so two never share the pool.

Loading a directory with no gdsckpt files (one Megatron's torch_dist wrote) goes through
Megatron's own reader, so a run switches from torch_dist to gdsckpt with its next save.

megatron-core 0.16-0.18 keep a registry of default strategies: importing this module registers
"gdsckpt" there, so `get_default_save_sharded_strategy("gdsckpt")` is the save strategy and
`dist_checkpointing.load` without a strategy picks the load strategy from `metadata.json`.
megatron-core 0.19 has no registry (its `save` replaces any strategy that is not a
TorchDistSaveShardedStrategy, which these are): pass the strategies as above.

Megatron-LM's training loop (megatron.training) builds its strategies and its async queue itself:
`gdsckpt.integrations.megatron.use_in_megatron_lm()` before `pretrain(...)` points them at these.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing import ShardedObject
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy,
)

from gdsckpt.dcp import SUFFIX, CachedSavePlanner, GdsckptReader, GdsckptWriter, shared_group
from gdsckpt.errors import GdsckptError, UnsupportedStateError
from gdsckpt.options import check_save_options

__all__ = ["BACKEND", "VERSION", "GdsckptSaveShardedStrategy", "GdsckptLoadShardedStrategy", "AsyncCallsQueue",
           "MegatronSavePlanner", "save_strategy", "load_strategy", "register", "use_in_megatron_lm"]

BACKEND, VERSION = "gdsckpt", 1
COMMON_FILE = "common.pt"  # megatron.core.dist_checkpointing.strategies.common.COMMON_STATE_FNAME
_COMMON_KEY = "common_state"  # megatron-core 0.19's ShardedObject of the common state


class MegatronSavePlanner(CachedSavePlanner):
    """CachedSavePlanner planning as Megatron's MCoreSavePlanner: every rank writes its own byte
    items (its ShardedObjects; DCP's default planner writes byte items on the coordinator only),
    which Megatron has already pickled (written as they are), and nothing is flattened."""

    def __init__(self):
        super().__init__(cache_key="megatron", flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self):
        coordinator, self.is_coordinator = self.is_coordinator, True  # what decides the byte items
        try:
            return super().create_local_plan()
        finally:
            self.is_coordinator = coordinator

    def transform_object(self, write_item, object):  # noqa: A002 - DCP's name
        return object


class GdsckptSaveShardedStrategy(TorchDistSaveShardedStrategy):
    """Megatron's torch_dist save strategy writing gdsckpt files (module docstring).

    codec: gdsckpt's ("auto": typed or byte-plane ANS on the GPU, zstd on the CPU; "ans",
    "ans-planes", "bitcomp", "zstd", "raw"). keep_only_main_replica: as Megatron's. Other keyword
    arguments Megatron-LM passes its torch_dist strategy (thread_count, cached_metadata,
    cpu_shm_mode, ...) are accepted and have no effect: gdsckpt writes one file per rank, from its
    own writer thread, and caches DCP's plan itself."""

    def __init__(self, backend: str = BACKEND, version: int = VERSION, keep_only_main_replica: bool = True, *,
                 codec: str = "auto", **megatron_options: Any):
        check_save_options({"codec": codec})
        super().__init__(backend, version, keep_only_main_replica)
        self.codec = codec
        self.last_writer: GdsckptWriter | None = None  # the last save's (its last_stats: this rank's Stats)

    @property
    def can_handle_sharded_objects(self):
        return True

    def save(self, sharded_state_dict, checkpoint_dir, *args: Any) -> None:
        """Durable on return (Megatron writes metadata.json after it)."""
        state, _ = self._translated(sharded_state_dict, Path(checkpoint_dir))
        writer = self.last_writer = GdsckptWriter(checkpoint_dir, codec=self.codec)
        group = shared_group()
        # on the writer thread, after any async save's write: DCP's collectives on `group` run
        # there, one save at a time
        _WRITER.submit(_relayed, lambda: dcp.save(state, storage_writer=writer, planner=MegatronSavePlanner(),
                                                  process_group=group), checkpoint_dir).result()

    def async_save(self, sharded_state_dict, checkpoint_dir, async_strategy: str | None = None) -> AsyncRequest:
        """The rank's shards compressed into the host pool now, written on a background thread:
        an AsyncRequest (megatron-core's) with no async_fn whose first finalize function waits for
        the write. `async_strategy` (megatron-core 0.17+: "nvrx" or "mcore", the worker process
        that writes torch_dist files) does not apply: nothing is handed to a worker."""
        checkpoint_dir = Path(checkpoint_dir)
        state, tensors = self._translated(sharded_state_dict, checkpoint_dir)
        writer = self.last_writer = GdsckptWriter(checkpoint_dir, codec=self.codec)
        # The pool holds a staged save until its write; the previous save's write ends first, so
        # that host memory holds one save's compressed bytes, never two.
        wait([_WRITER.submit(lambda: None)])
        # GdsckptWriter's own staging (dcp.async_save's stager): the tensors compressed into the
        # pool, stand-ins back, put where DCP's planner will find them (_swap). On a GPU the
        # staging may go on in the background (a Future of the stand-ins: the tensors copied on
        # the device first), so the swap waits for it on the writer thread, not here. A staging
        # that failed hands the tensors back and keeps its error for write_data, which DCP raises
        # on every rank alike.
        staged = writer.stage(tensors)
        group = shared_group()  # made on the caller's thread, in step with the other ranks

        def write():
            _swap(state, staged.result() if isinstance(staged, Future) else staged)
            return dcp.save(state, storage_writer=writer, planner=MegatronSavePlanner(), process_group=group)
        future = _WRITER.submit(_relayed, write, checkpoint_dir)
        return AsyncRequest(None, (), [WriteDone(future)])

    def reserve(self, sharded_state_dict, *, wait: bool = False) -> Future:
        """gdsckpt.dcp.reserve for this strategy's async saves: the host pool their staging
        compresses into, made and page-locked on a background thread before the first async save
        (which would otherwise grow it in its call, the training waiting). sharded_state_dict: what
        the saves will pass (taken once the optimizer holds its state); it is not saved. A Future
        of the reservation (wait=True: done on return)."""
        from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
        from gdsckpt.dcp import reserve
        sharded, _ = save_preprocess(sharded_state_dict, validate_access_integrity=False)
        sharded, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(sharded, self.keep_only_main_replica)
        state = mcore_torch.mcore_to_pyt_state_dict(sharded, False)
        return reserve({key: t for key, (t, _) in _local_tensors(state).items()}, wait=wait, codec=self.codec)

    def _translated(self, sharded_state_dict, checkpoint_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
        """Megatron's own translation for DCP (its main replicas as DCP's sharded tensors, its
        ShardedObjects pickled into BytesIO), and the local tensors of it by staging key. The
        common state of megatron-core 0.19 goes to common.pt (rank 0)."""
        common = sharded_state_dict.pop(_COMMON_KEY, None) if isinstance(sharded_state_dict, dict) else None
        if isinstance(common, ShardedObject) and dist.get_rank() == 0:
            _write_common(common.data, checkpoint_dir)
        sharded, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica)
        state = mcore_torch.mcore_to_pyt_state_dict(sharded, False)
        return state, {key: t for key, (t, _) in _local_tensors(state).items()}


class WriteDone:
    """The first finalize function of an async save's AsyncRequest: waits for the rank's write (and
    DCP's commit) and raises its error; `future` is that write (AsyncCallsQueue polls it)."""

    def __init__(self, future: Future):
        self.future = future

    def __call__(self) -> None:
        self.future.result()


class GdsckptLoadShardedStrategy(TorchDistLoadShardedStrategy):
    """Megatron's torch_dist load strategy reading gdsckpt files through GdsckptReader (a
    directory with no gdsckpt file through Megatron's own reader). Keyword arguments are
    Megatron's (those its installed version takes)."""

    def __init__(self, **megatron_options: Any):
        import inspect
        takes = inspect.signature(TorchDistLoadShardedStrategy.__init__).parameters
        super().__init__(**{k: v for k, v in megatron_options.items() if k in takes})

    def load(self, sharded_state_dict, checkpoint_dir, *args: Any, **kwargs: Any):
        with _reading(checkpoint_dir):
            return super().load(sharded_state_dict, checkpoint_dir, *args, **kwargs)

    def load_tensors_metadata(self, checkpoint_dir, *args: Any, **kwargs: Any):
        with _reading(checkpoint_dir):
            return super().load_tensors_metadata(checkpoint_dir, *args, **kwargs)

    def load_sharded_metadata(self, checkpoint_dir, *args: Any, **kwargs: Any):
        with _reading(checkpoint_dir):
            return super().load_sharded_metadata(checkpoint_dir, *args, **kwargs)

    def remove_sharded_tensors(self, checkpoint_dir, key_prefix: str):
        if _holds_gdsckpt(checkpoint_dir):
            raise NotImplementedError("removing tensors from a gdsckpt checkpoint in place is not supported")
        return super().remove_sharded_tensors(checkpoint_dir, key_prefix)

    def check_backend_compatibility(self, loaded_backend):
        pass

    def check_version_compatibility(self, loaded_version):
        pass


def save_strategy(**options: Any) -> GdsckptSaveShardedStrategy:
    """GdsckptSaveShardedStrategy(**options): dist_checkpointing.save's sharded_strategy."""
    return GdsckptSaveShardedStrategy(**options)


def load_strategy(**options: Any) -> GdsckptLoadShardedStrategy:
    """GdsckptLoadShardedStrategy(**options): dist_checkpointing.load's sharded_strategy."""
    return GdsckptLoadShardedStrategy(**options)


class AsyncCallsQueue:
    """Megatron's AsyncCallsQueue (megatron.core.dist_checkpointing.strategies.async_utils) with
    no worker process: schedule_async_request, maybe_finalize_async_calls, get_num_unfinalized_calls,
    close, called on every rank as Megatron's.

    A request from GdsckptSaveShardedStrategy.async_save is already being written on gdsckpt's
    background thread: it is finalized once that write is done on every rank (one all-reduce per
    maybe_finalize call, as Megatron's). Any other request (e.g. torch_dist's) has its preload_fn
    run on the caller's thread and its async_fn on a background thread of this process instead of
    a forked one. `persistent` is accepted for Megatron-LM's call and has no effect."""

    def __init__(self, persistent: bool = False):
        self.call_idx = -1
        self._calls: deque[tuple[int, Future, AsyncRequest]] = deque()

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        self.call_idx += 1
        write = next((fn.future for fn in async_request.finalize_fns if isinstance(fn, WriteDone)), None)
        if write is None:
            args = list(async_request.async_fn_args)
            if async_request.preload_fn is not None:
                args[1] = async_request.preload_fn()  # as Megatron's callers: the state dict staged
            if async_request.async_fn is None:
                write = Future()
                write.set_result(None)
            else:
                write = _OTHERS.submit(async_request.async_fn, *args, **(async_request.async_fn_kwargs or {}))
        self._calls.append((self.call_idx, write, async_request))
        return self.call_idx

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> list[int]:
        finalized = []
        while self._calls:
            idx, write, request = self._calls[0]
            if blocking:
                wait([write])
            if not (write.done() if no_dist else _everywhere(write.done())):
                break
            self._calls.popleft()
            for fn in request.finalize_fns:
                fn()
            finalized.append(idx)
        return finalized

    def get_num_unfinalized_calls(self) -> int:
        return len(self._calls)

    def close(self, abort: bool = False) -> None:
        if not abort:
            self.maybe_finalize_async_calls(blocking=True)
        self._calls.clear()


def register() -> bool:
    """Register the strategies as the "gdsckpt" backend in megatron-core's registry of default
    strategies (0.16-0.18; done on import); False where the installed megatron-core has none."""
    try:
        from megatron.core.dist_checkpointing.strategies.base import StrategyAction, register_default_strategy
    except ImportError:
        return False
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, GdsckptSaveShardedStrategy())
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, GdsckptLoadShardedStrategy())
    return True


def use_in_megatron_lm() -> None:
    """Make Megatron-LM's training loop (megatron.training, not part of megatron-core) checkpoint
    through gdsckpt: call once before pretrain(...), with `--ckpt-format torch_dist` (its default)
    and, for async saves, `--async-save`. Its checkpointing module's names for the torch_dist
    strategies (megatron-core 0.19: TorchDistSaveShardedStrategy / TorchDistLoadShardedStrategy;
    0.16-0.18: get_default_save_sharded_strategy / get_default_load_sharded_strategy) are pointed
    at gdsckpt's, and its async queue (megatron.training.async_utils._async_calls_queue) is this
    module's AsyncCallsQueue. Directories torch_dist wrote before still load (Megatron's reader)."""
    from megatron.training import async_utils, checkpointing
    if hasattr(checkpointing, "TorchDistSaveShardedStrategy"):
        checkpointing.TorchDistSaveShardedStrategy = GdsckptSaveShardedStrategy
    if hasattr(checkpointing, "TorchDistLoadShardedStrategy"):
        checkpointing.TorchDistLoadShardedStrategy = GdsckptLoadShardedStrategy
    if hasattr(checkpointing, "get_default_save_sharded_strategy"):
        checkpointing.get_default_save_sharded_strategy = lambda *args, **kwargs: GdsckptSaveShardedStrategy()
    if hasattr(checkpointing, "get_default_load_sharded_strategy"):
        checkpointing.get_default_load_sharded_strategy = lambda *args, **kwargs: GdsckptLoadShardedStrategy()
    async_utils._async_calls_queue = AsyncCallsQueue()


# ---------------------------------------------------------------- helpers

# One writer thread: an async save's write and DCP's commit, in the order the saves were made.
_WRITER = ThreadPoolExecutor(1, thread_name_prefix="gdsckpt-megatron")
_OTHERS = ThreadPoolExecutor(1, thread_name_prefix="gdsckpt-megatron-other")
_READER_LOCK = threading.RLock()


def _local_tensors(state: dict) -> dict[str, tuple[torch.Tensor, tuple]]:
    """{staging key: (local tensor, where it sits)} for each of the rank's shards in Megatron's
    translated state: a CheckpointableShardedTensor's ShardedTensor data, each of a
    LocalShardsContainer's, each local shard of a (pre-0.14 layout) torch ShardedTensor."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor
    found: dict[str, tuple[torch.Tensor, tuple]] = {}
    for key, value in state.items():
        if isinstance(value, io.BytesIO):
            continue
        if isinstance(value, TorchShardedTensor):
            places = [("shard", s) for s in value.local_shards()]
        elif hasattr(value, "_local_shards"):  # LocalShardsContainer
            places = [("sh_ten", s) for s in value._local_shards]
        elif hasattr(value, "_sh_ten"):  # CheckpointableShardedTensor
            places = [("sh_ten", value)]
        else:
            raise UnsupportedStateError(f"{key!r}: Megatron translated it to {type(value).__name__}, which gdsckpt's "
                                        "Megatron strategy does not know")
        for i, (kind, holder) in enumerate(places):
            t = holder.tensor if kind == "shard" else holder._sh_ten.data
            found[key if len(places) == 1 else f"{key}/{i}"] = (t, (kind, holder))
    return found


def _swap(state: dict, staged: dict[str, torch.Tensor]) -> None:
    """Put the staging's stand-ins where DCP's planner takes each shard's data from: a copy of the
    wrapper's ShardedTensor (the caller's own is left as it was) or the torch shard's tensor."""
    for key, (_, (kind, holder)) in _local_tensors(state).items():
        stand_in = staged[key]
        if kind == "shard":
            holder.tensor = stand_in
        else:
            sh_ten = copy.copy(holder._sh_ten)
            sh_ten.data = stand_in
            holder._sh_ten = sh_ten


def _write_common(common, checkpoint_dir: Path) -> None:
    """Megatron's common.pt (torch.save, as its common strategy writes it), whole or not at all."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    tmp = checkpoint_dir / f".{COMMON_FILE}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        torch.save(common, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, checkpoint_dir / COMMON_FILE)


def _relayed(save, checkpoint_dir) -> None:
    """save(); DCP's CheckpointException (a BaseException, which `except Exception` misses) as a
    GdsckptError naming the directory and the ranks that failed, this rank's error first where it
    failed (a gdsckpt error keeps its type and is raised as it is)."""
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        save()
    except CheckpointException as e:
        failures = dict(sorted(getattr(e, "failures", {}).items()))
        mine = failures.get(dist.get_rank()) if dist.is_initialized() else None
        first = (mine or next(iter(failures.values()), (e, None)))[0]
        if isinstance(first, GdsckptError):
            raise first from e
        raise GdsckptError(f"saving the Megatron checkpoint {str(checkpoint_dir)!r} failed on rank(s) "
                           f"{sorted(failures)}: {type(first).__name__}: {first}") from e


def _holds_gdsckpt(checkpoint_dir) -> bool:
    return any(Path(checkpoint_dir).glob(f"*{SUFFIX}"))


@contextlib.contextmanager
def _reading(checkpoint_dir):
    """While it lasts, Megatron's torch_dist strategy reads `checkpoint_dir` through GdsckptReader
    (where it holds gdsckpt files): megatron-core builds its reader in a module function
    (_get_filesystem_reader, 0.16-0.19), which is replaced for the call. Read errors come out as
    gdsckpt's typed errors naming the file (DCP wraps a rank's in a CheckpointException)."""
    from torch.distributed.checkpoint.api import CheckpointException
    if not _holds_gdsckpt(checkpoint_dir):
        yield
        return
    with _READER_LOCK:
        own = mcore_torch._get_filesystem_reader
        mcore_torch._get_filesystem_reader = lambda path, *args, **kwargs: GdsckptReader(path)
        try:
            yield
        except CheckpointException as e:
            failures = getattr(e, "failures", {})
            mine = failures.get(dist.get_rank()) if dist.is_initialized() else None
            first = (mine or next(iter(failures.values()), (None, None)))[0]
            if isinstance(first, GdsckptError):
                raise first from e
            raise
        finally:
            mcore_torch._get_filesystem_reader = own


def _everywhere(done: bool) -> bool:
    """`done` on every rank (one all-reduce on the default group, as Megatron's queue makes it)."""
    if not dist.is_initialized():
        return done
    cuda = "nccl" in str(dist.get_backend()) and torch.cuda.is_available()
    flag = torch.tensor([0 if done else 1], dtype=torch.int32,
                        device=torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu")
    dist.all_reduce(flag)
    return int(flag.item()) == 0


register()
