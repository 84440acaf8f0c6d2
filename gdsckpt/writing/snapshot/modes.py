"""Snapshot modes behind one interface, in the spirit of torch.distributed.checkpoint's AsyncStager:
where a save that must not stop training takes its snapshot, when its caller may go on, and what
waits for it. save_async(snapshot=) and GdsckptWriter(snapshot=) look the mode up here by name
instead of branching on it.

The built-in modes (options.Snapshot names them) live beside what they use: "host" in
snapshot/host.py, "overlap" in snapshot/overlap.py, "device" in snapshot/device.py (registered below), and
"cpu", GdsckptWriter's alone, in dcp/staging.py (registered there). A new mode is one module
and one line:

    class Mine:                                   # a SnapshotMode
        name, used_by, optimizer, uses_pool = "mine", ("save_async",), "unused", True
        def save(self, call): return call.in_background(keep=lambda t: False, optimizer=None)
        def stage(self, call): ...                # only if used_by names "dcp"

    snapshot_modes.register(Mine())
    gdsckpt.save_async(state, path, snapshot="mine")
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable, Protocol

import torch

from .device import DeviceSnapshot
from .host import HostSnapshot
from .overlap import OverlapSnapshot

__all__ = ["SnapshotMode", "SaveCall", "StageCall", "register", "unregister", "lookup", "names", "with_optimizer", "check_optimizer",
           "SAVE_ASYNC", "DCP"]

SAVE_ASYNC = "save_async"  # SnapshotMode.used_by: gdsckpt.save_async (and the Checkpointer's saves through it)
DCP = "dcp"  # GdsckptWriter's staging for dcp.async_save

OPTIMIZER_NEEDED, OPTIMIZER_REFUSED, OPTIMIZER_UNUSED = "needed", "refused", "unused"


class SaveCall(Protocol):
    """One save_async call as a mode sees it (async_save.py makes it). Each method takes the
    compressed snapshot of the call's state into its destination (the host pool, or the memory
    tier's slot) one way, and returns the future save_async returns (complete once the file is
    durable). The state was checked and flattened before; `tensors` are its tensors in file order."""

    tensors: list[torch.Tensor]
    optimizer: Any  # save_async's optimizer= (None: none given)
    label: str  # the checkpoint's path, for messages

    def take(self) -> Future:
        """The snapshot taken in the call, from the live tensors: the caller goes on once it
        returns, nothing waits afterwards."""

    def in_background(self, keep: Callable[[torch.Tensor], bool], optimizer) -> Future:
        """The tensors for which keep(t) holds read as they are by a snapshot on a background
        thread, every other one copied on its own device before this returns (its caller goes on
        then); `optimizer`'s next step() waits for that snapshot (None: nothing waits; keep must
        then hold for no tensor anyone may change)."""

    def copied(self, block=None) -> Future | None:
        """Every tensor copied on its own device (device_copy.snapshot_tensors' `block`: None
        allocates from torch's cache), then the snapshot taken from the copies on a background
        thread, which no step waits for. None where the device had no room for the copy."""

    def copy_first(self) -> Future | None:
        """copied() for a first save, whose host pool is not there yet (device_copy.copy_first):
        the copy taken outside torch's cache, its memory back once the snapshot ends. None where
        that does not apply (a steady save, no GPU room, the memory tier's target)."""


class StageCall(Protocol):
    """One GdsckptWriter.stage (dcp.async_save's staging) as a mode sees it (dcp/writer.py makes
    it). Each method returns what stage() returns: the staged state dict DCP plans and writes
    from, or a Future of it."""

    state_dict: Any
    optimizer: Any  # GdsckptWriter's optimizer= where the mode takes one, else None

    def take(self):
        """The rank's tensors compressed into the host pool now; the stand-in state dict."""

    def in_background(self, keep: Callable[[torch.Tensor], bool], optimizer) -> Future:
        """As SaveCall.in_background, for the state dict (a DTensor's local shard per tensor;
        other values deep-copied now)."""

    def copied(self, block=None) -> Future | None:
        """As SaveCall.copied."""

    def copy_first(self) -> Future | None:
        """As SaveCall.copy_first."""


class SnapshotMode(Protocol):
    """Where a save that must not stop training takes its snapshot, before its caller may change
    the state again. Call order, per save:

        mode = lookup(name, used_by)                  # at the call: ValueError for an unknown name
        check_optimizer(mode, optimizer, caller)      # before the state is walked: ValueError
        ...the caller waits for the previous overlapped snapshot (overlap.wait_for_snapshot),
           which owns the save ring and the host pool, and checks the state...
        fut = mode.save(call)                         # save_async: a SaveCall
      | staged = mode.stage(call)                     # GdsckptWriter.stage: a StageCall

    save/stage return once the caller may change the state: the snapshot taken (take), or the
    tensors that may change copied (in_background, copied, copy_first). What still reads live
    tensors after the return must be fenced by `optimizer`'s next step (in_background's hook).
    A failure raised by save/stage is the call's; one in the background goes to the future.

    name: what snapshot= takes (the built-ins' are save.Snapshot members, equal to their string).
    used_by: SAVE_ASYNC and/or DCP: which of save_async and GdsckptWriter take it.
    optimizer: "needed" (the mode hooks its step: a ValueError without one), "refused" (a
        ValueError with one: it would go unused, the overlap the caller meant never running), or
        "unused" (taken and ignored: a caller that always passes its optimizer may choose it).
    with_optimizer: the name a save given optimizer= takes instead where this mode was only the
        default (GdsckptWriter's and the Checkpointer's "host" becomes "overlap"); None: itself.
    uses_pool: its snapshot is compressed into the host pool, which gdsckpt.reserve makes ahead."""

    name: str
    used_by: tuple[str, ...]
    optimizer: str
    with_optimizer: str | None
    uses_pool: bool

    def save(self, call: SaveCall) -> Future: ...

    def stage(self, call: StageCall): ...


_modes: dict[str, SnapshotMode] = {}
_lock = threading.Lock()


def register(mode: SnapshotMode) -> SnapshotMode:
    """Make `mode` available under mode.name (replacing one of that name); returns it."""
    if not isinstance(mode.name, str) or not mode.name:
        raise ValueError(f"a snapshot mode needs a name, not {mode.name!r}")
    unknown = set(mode.used_by) - {SAVE_ASYNC, DCP}
    if unknown or not mode.used_by:
        raise ValueError(f"snapshot mode {mode.name!r}: used_by must name {SAVE_ASYNC!r} and/or {DCP!r}, "
                         f"not {tuple(mode.used_by)!r}")
    if mode.optimizer not in (OPTIMIZER_NEEDED, OPTIMIZER_REFUSED, OPTIMIZER_UNUSED):
        raise ValueError(f"snapshot mode {mode.name!r}: optimizer must be 'needed', 'refused' or 'unused', "
                         f"not {mode.optimizer!r}")
    with _lock:
        _modes[mode.name] = mode
    return mode


def unregister(name: str) -> None:
    """Forget the mode registered as `name` (a KeyError if none is)."""
    with _lock:
        del _modes[name]


def names(used_by: str) -> tuple[str, ...]:
    """The names of the modes `used_by` (SAVE_ASYNC or DCP) takes, in registration order."""
    return tuple(str(getattr(m.name, "value", m.name)) for m in list(_modes.values()) if used_by in m.used_by)


def lookup(value, used_by: str, keyword: str = "snapshot") -> SnapshotMode:
    """The mode named `value` that `used_by` takes; a ValueError naming the choices otherwise."""
    mode = _modes.get(value) if isinstance(value, str) else None
    if mode is None or used_by not in mode.used_by:
        raise ValueError(f"{keyword} must be one of {', '.join(map(repr, names(used_by)))}, not {value!r}")
    return mode


def with_optimizer(name):
    """The mode a save given optimizer= takes where `name` was only the default (SnapshotMode.
    with_optimizer: "host" becomes "overlap"); `name` itself otherwise, an unknown one included
    (lookup refuses it where it is used)."""
    mode = _modes.get(name) if isinstance(name, str) else None
    return name if mode is None or mode.with_optimizer is None else mode.with_optimizer


def check_optimizer(mode: SnapshotMode, optimizer, caller: str) -> None:
    """The optimizer `mode` takes: given where it hooks the step, an optimizer (it has step
    hooks), none where the snapshot is taken before `caller` returns and would leave it unused."""
    name = str(getattr(mode.name, "value", mode.name))
    if mode.optimizer == OPTIMIZER_REFUSED and optimizer is not None:
        raise ValueError(f"optimizer= is for snapshot='overlap' (the snapshot taken during the next forward/backward, "
                         f"the next opt.step() waiting for it); snapshot={name!r} takes the snapshot before {caller} "
                         "returns: pass snapshot='overlap', or no optimizer=")
    if mode.optimizer == OPTIMIZER_NEEDED and optimizer is None:
        raise ValueError(f"snapshot={name!r} (overlap=True) needs optimizer=: the snapshot runs during the next "
                         "forward/backward, and only a step pre-hook on the optimizer keeps the step from "
                         "changing the state under it")
    if optimizer is not None and not hasattr(optimizer, "register_step_pre_hook"):
        raise ValueError(f"optimizer= must be a torch.optim.Optimizer, not {type(optimizer).__name__}")


register(HostSnapshot())
register(OverlapSnapshot())
register(DeviceSnapshot())
