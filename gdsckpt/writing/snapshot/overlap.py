"""The overlapped snapshot (save_async(snapshot="overlap"), GdsckptWriter's overlapped staging):
the snapshot runs on a background thread during the next forward/backward, and a step
pre-hook makes the optimizer's next step() wait for it. The contract it relies on, and what it
costs, is in async_save.py's docstring.

One overlapped snapshot runs at a time per process (it owns the save ring and the host pool):
`wait_for_snapshot` waits for it, and drops the hooks of finished ones.
"""

from __future__ import annotations

import concurrent.futures.thread  # before the shutdown hook below: see there
import contextlib
import threading
import time
import traceback
import weakref
from typing import Any, Callable

import torch

from gdsckpt.engine.device_copy import on_device, side_stream, snapshot_tensors
from gdsckpt.writing.save import Snapshot
from gdsckpt.stats import AsyncStats

__all__ = ["run_overlapped", "wait_for_snapshot", "freeze_for_overlap", "freeze", "StepOwned", "optimizer_memory",
           "memory_of", "HookTimer", "OverlapSnapshot", "optimizer_in", "fencing_optimizer", "watch_optimizers", "may_fence"]

_snapshot_done = threading.Event()  # the last overlapped snapshot has ended
_snapshot_done.set()
_hooks: list = []  # [handle, done event] of step pre-hooks not yet removed


def freeze_for_overlap(tensors: list, optimizer) -> list:
    """`tensors` as a snapshot taken during the next forward/backward may read them: those that
    only `optimizer`'s step changes as they are, every other one (buffers) copied now."""
    return freeze(tensors, StepOwned(optimizer).__contains__)


def freeze(tensors: list, keep) -> list:
    """`tensors` with those for which keep(t) holds as they are, every other one copied now on
    its own device (snapshot_tensors)."""
    tensors = list(tensors)
    loose = [i for i, t in enumerate(tensors) if not keep(t)]
    for i, copy in zip(loose, snapshot_tensors([tensors[i] for i in loose])):
        tensors[i] = copy
    return tensors


def wait_for_snapshot(timeout: float | None = None) -> bool:
    """Wait for a running overlapped snapshot (it owns the ring and the pool); drop the step
    hooks of finished ones. False if it is still running after `timeout` seconds."""
    if not _snapshot_done.wait(timeout):
        return False
    _remove_hooks()
    return True


# At the interpreter's exit, threading runs these hooks in reverse order of registration, then
# joins the non-daemon threads (the snapshot's, the background writer). concurrent.futures' own
# hook, registered as it was imported above, makes every thread pool refuse new work: a snapshot
# still running then failed in its codec pool, and a save_async whose caller exited without
# result() was lost. This one, registered after it, runs first: the snapshot ends (its file goes
# to the writer, which the interpreter waits for) before the pools stop.
try:
    threading._register_atexit(wait_for_snapshot)
except RuntimeError:  # imported while the interpreter exits: no snapshot of this module's to wait for
    pass


def run_overlapped(snapshot: Callable[[], Any], gpu: int | None, optimizer, finish: Callable[[Any, BaseException | None], None],
                   hook: HookTimer | None = None) -> None:
    """Run snapshot() on a background thread, on the GPU's "snapshot" side stream started after
    the work queued so far (not after later work), and make `optimizer`'s next step wait for it
    (the wait goes to `hook`; optimizer=None: a snapshot of private copies, which no step
    waits for). finish(result, None) or finish(None, error) runs on that thread before the step
    may go on."""
    fence = None
    if gpu is not None:
        fence = side_stream("snapshot", torch.device("cuda", gpu))
        fence.wait_stream(torch.cuda.current_stream(gpu))
    done = threading.Event()
    hook = hook or HookTimer()
    _snapshot_done.clear()

    def run():
        try:
            with on_device(gpu), (torch.cuda.stream(fence) if fence is not None else contextlib.nullcontext()):
                result = snapshot()
        except BaseException as e:  # noqa: BLE001 - the future carries it; the next save raises it if unseen
            traceback.clear_frames(e.__traceback__)
            finish(None, e)
        else:
            finish(result, None)
        finally:
            done.set()
            _snapshot_done.set()

    try:
        threading.Thread(target=run, name="gdsckpt-snapshot", daemon=False).start()
    except BaseException:
        _snapshot_done.set()
        raise
    if optimizer is not None:
        _install_hook(optimizer, done, hook)


class HookTimer:
    """The step pre-hook's wait, added to the save's stats whenever they exist."""

    def __init__(self):
        self.waited = 0.0
        self.stats: AsyncStats | None = None
        self.lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self.lock:
            self.waited += seconds
            if self.stats is not None:
                self.stats.hook_wait_s = self.waited


def _install_hook(optimizer, done: threading.Event, timer: HookTimer) -> None:
    """A step pre-hook that waits for the snapshot, then goes away. It cannot remove itself while
    the optimizer iterates its hooks (an OrderedDict) unless it is the last one; otherwise a
    step post-hook removes it, and is itself removed by the next save_async."""
    entry: list = []

    def pre_hook(opt, args, kwargs):
        if not done.is_set():
            t = time.perf_counter()
            done.wait()
            timer.add(time.perf_counter() - t)
        handle = entry[0]
        hooks = opt._optimizer_step_pre_hooks
        if handle.id in hooks and next(reversed(hooks)) == handle.id:
            handle.remove()
        elif handle.id in hooks and len(entry) == 1:
            def post_hook(opt, args, kwargs):
                handle.remove()
            entry.append(opt.register_step_post_hook(post_hook))
            _hooks.append([entry[1], done])
        return None

    entry.append(optimizer.register_step_pre_hook(pre_hook))
    _hooks.append([entry[0], done])


def _remove_hooks() -> None:
    """Remove the hooks of earlier overlap saves whose snapshot has ended (called outside any
    step, in save_async): a pre-hook whose step never came, a post-hook left to do nothing."""
    for entry in list(_hooks):
        handle, done = entry
        if done.is_set():
            handle.remove()
            _hooks.remove(entry)


class StepOwned:
    """`t in StepOwned(optimizer)`: whether `t` is memory that only the optimizer's step changes
    (optimizer_memory), asked per leaf of a save's state: first by identity (the state's tensors
    are the very objects optimizer.state_dict() hands out: an AdamW's 3 of 4 leaves), then by the
    parameters' memory (a model.state_dict() entry is a view of its parameter), and the whole
    state's memory only for a tensor neither answers. Per save of the bench's 1,172 tensors this
    reads ~600 storages instead of ~2,300: each read is ~0.5 us of the call, which the GPU waits
    for where the loop synchronizes every step."""

    def __init__(self, optimizer):
        self._optimizer = optimizer
        self._ids = {id(v) for st in optimizer.state.values() if isinstance(st, dict)
                     for v in st.values() if isinstance(v, torch.Tensor)}
        self._params = {memory_of(p) for group in optimizer.param_groups for p in group["params"]}
        self._params.discard(None)
        self._all: set | None = None

    def __contains__(self, t: torch.Tensor) -> bool:
        if id(t) in self._ids:  # alive in `optimizer.state` and in the caller's state: the same object
            return True
        memory = memory_of(t)
        if memory is None:
            return False
        if memory in self._params:
            return True
        if self._all is None:
            self._all = optimizer_memory(self._optimizer)
        return memory in self._all

    def gpu(self) -> int | None:
        """A GPU the parameters are on (one of them, if several): the device to fence."""
        return next((device.index for device, _ in self._params if device.type == "cuda"), None)


def optimizer_in(state, depth: int = 0):
    """The optimizer `state` holds itself (a torch.optim.Optimizer object whose step() runs its
    hooks, among its values and the dicts, lists and tuples under them), where it holds exactly
    one; None where it holds none or several (no single step fences the state)."""
    found = _optimizers_in(state, depth)
    return next(iter(found.values())) if len(found) == 1 else None


def _optimizers_in(state, depth: int = 0) -> dict:
    """{id: the optimizer, or None where its step may skip the hooks} of every optimizer object
    `state` holds."""
    found: dict[int, object] = {}

    def walk(o, depth):
        if isinstance(o, torch.optim.Optimizer):
            if getattr(type(o).step, "hooked", False):  # torch wrapped its step: the step pre-hooks run
                found[id(o)] = o
            else:
                found[id(o)] = None  # a step that may skip the hooks fences nothing
        elif isinstance(o, dict) and depth < 8:
            for v in o.values():
                walk(v, depth + 1)
        elif isinstance(o, (list, tuple)) and depth < 8:
            for v in o:
                walk(v, depth + 1)

    walk(state, depth)
    return found


_stepped: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # optimizers whose step ran, since watched
_watching: list = []  # the global step hook's handle, once installed


def watch_optimizers() -> None:
    """From now on, note every optimizer whose step() runs (a global step post-hook, installed
    once: a weak reference added per step), so that a save of state_dict()s taken afresh, which
    holds no optimizer object, can still find the one optimizer whose step alone changes them."""
    if not _watching:
        from torch.optim.optimizer import register_optimizer_step_post_hook
        _watching.append(register_optimizer_step_post_hook(
            lambda opt, args, kwargs: _stepped.add(opt)))


def fencing_optimizer(state, tensors: list):
    """The optimizer whose step pre-hook fences every tensor of a save: the one `state` holds
    itself, else the one optimizer that stepped in this process (watch_optimizers) whose
    parameters and moments are all of `tensors` memory (a model's state_dict() views of its
    parameters, its state_dict()'s moments); None where none does (a buffer, a second model, an
    EMA copy: memory the forward or another step may change), or where several would."""
    watch_optimizers()
    held = _optimizers_in(state)
    if held:  # the state's own: exactly one, whose step runs its hooks (another's step fences nothing)
        candidates = list(held.values()) if len(held) == 1 and None not in held.values() else []
    else:
        candidates = [o for o in list(_stepped) if getattr(type(o).step, "hooked", False)]
    fencing = [o for o in candidates if tensors and _owns(StepOwned(o), tensors)]
    return fencing[0] if len(fencing) == 1 else None


def _owns(owned: "StepOwned", tensors: list) -> bool:
    return all(t in owned for t in tensors)  # one StepOwned per optimizer: its memory is gathered once


def may_fence(state) -> bool:
    """Whether a save of `state` that names no mode may be inferred to overlap (fencing_optimizer
    may find one): it holds an optimizer, or one has stepped. Cheap: no walk of the state."""
    watch_optimizers()
    held = _optimizers_in(state)
    return len(held) == 1 if held else len(_stepped) > 0


def optimizer_memory(optimizer) -> set:
    """The memory of every parameter of `optimizer` and every tensor in its state: what only
    its step changes."""
    out = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.add(memory_of(p))
    for st in optimizer.state.values():
        if isinstance(st, dict):
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    out.add(memory_of(v))
    out.discard(None)
    return out


def memory_of(t: torch.Tensor):
    """The tensor's storage (device, base address): a state_dict() entry shares it with its
    parameter; a DTensor (FSDP2's parameters and optimizer state) by its local shard's."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    if t.numel() == 0:
        return None
    return (t.device, t.untyped_storage().data_ptr())


class OverlapSnapshot:
    """snapshot="overlap" (a snapshot_modes.SnapshotMode; optimizer= needed): the tensors only the
    optimizer's step changes are read by a snapshot on a background thread during the next
    forward/backward, the others copied in the call; the next step() waits for the snapshot. A
    first save, whose pool is not there yet, copies the state instead (no step waits)."""

    name = Snapshot.OVERLAP
    used_by = ("save_async", "dcp")
    optimizer = "needed"
    with_optimizer = None
    uses_pool = True

    def save(self, call):
        return call.copy_first() or call.in_background(StepOwned(call.optimizer).__contains__, call.optimizer)

    def stage(self, call):
        staged = call.copy_first()
        if staged is None:
            staged = call.in_background(StepOwned(call.optimizer).__contains__, call.optimizer)
        return staged
