"""GdsckptWriter's staging for dcp.async_save: what the state dict becomes before
dcp.async_save returns, for each snapshot mode (writing/snapshot/modes.py; "cpu", GdsckptWriter's alone,
is registered here).

* `stage_compressed` (HOST, and the background part of OVERLAP and DEVICE): the rank's tensors
  compressed into the host pool by save_flat, and a stand-in state dict for DCP to plan with.
* `snapshot_state_dict` (the call-time part of OVERLAP and DEVICE): a private copy of the state
  dict, each tensor (a DTensor's local shard) copied on its own device.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, fields
from typing import Any

import torch

from gdsckpt.writing.snapshot import modes as snapshot_modes
from gdsckpt.engine.device_copy import cuda_device_of, on_device, snapshot_tensors
from ..errors import UnsupportedStateError
from gdsckpt.writing.snapshot.host import PoolDestination
from gdsckpt.writing.save import SaveOptions, Snapshot, save_flat
from ..stats import Stats
from gdsckpt.format.tree import flatten
from .standins import STAND_INS, StandInElements, data_address

__all__ = ["Staged", "StandInElements", "stage_compressed", "staged_tensors", "snapshot_state_dict", "state_tensors",
           "data_address", "reserve", "stateful_values", "CpuStaging"]


@dataclass
class Staged:
    """A compressed staging waiting for GdsckptWriter.write_data: the records in the host pool
    (`destination`, a PoolDestination with no path yet), and how write_data finds each write
    item's key: by its stand-in's data_address."""

    destination: PoolDestination
    keys: dict[tuple[int, int], str]  # data_address of a stand-in -> its key in the rank file
    shapes: dict[str, tuple]  # key -> the staged tensor's shape
    stats: Stats  # of the staging's save_flat (path "<staged>", no file yet)
    stand_ins: dict  # key -> its stand-in (standins._Entry): kept alive, their addresses stay distinct
    layout: object  # standins.StandIns' layout token: the same while every key kept its stand-in

    def drop(self) -> None:
        """Give the pool back the records of a staging no write_data will write."""
        self.destination.job.drop()


def stage_compressed(state_dict, options: SaveOptions) -> tuple[Any, Staged]:
    """Compress the tensors of a DCP state dict (DTensor local shards, plain tensors) into this
    process's host pool, as save_async does; return (stand-in state dict, Staged) where the
    stand-ins have the shapes, dtypes and DTensor placements of the tensors but hold no memory
    (one element, expanded) and other values are deep-copied."""
    tensors: dict[str, torch.Tensor] = {}
    with STAND_INS.round() as round_:
        def stand_in(t: torch.Tensor, path: str, dtensor) -> torch.Tensor:
            # On the tensor's own device: DTensor.from_local moves a local tensor that is not on
            # the mesh's device type, and write_data would then not recognise the copy as staged.
            return round_.stand_in(_keyed(tensors, path, t), t, dtensor)

        state = _rebuild(state_dict, stand_in, _copied)
    skeleton, leaves = flatten(tensors)
    dest = PoolDestination(None, None, options.chunk_bytes)
    with on_device(cuda_device_of(tensors.values())):
        snap = save_flat(skeleton, leaves, dest, options)
    return state, Staged(dest, round_.keys, round_.shapes, snap, round_.entries, round_.layout)


def staged_tensors(state_dict) -> dict[str, torch.Tensor]:
    """The tensors stage_compressed saves, under the keys it saves them (reserve's: a save of
    the same keys and shapes reuses codec="auto"'s choice)."""
    tensors: dict[str, torch.Tensor] = {}
    _rebuild(state_dict, lambda t, path, dtensor: _keyed(tensors, path, t), lambda o: None)
    return tensors


def _keyed(tensors: dict, path: str, t: torch.Tensor) -> str:
    """Add `t` to `tensors` under its path (made unique): the key it is staged under."""
    if t.layout != torch.strided or t.device.type not in ("cpu", "cuda") or t.is_quantized:
        raise UnsupportedStateError(f"cannot stage a {t.layout} {t.dtype} tensor on {t.device} at {path!r}; "
                                    "pass snapshot='cpu' to GdsckptWriter")
    key = path
    while key in tensors:
        key += "#"
    tensors[key] = t.detach()
    return key


def _copied(o):
    return o if isinstance(o, (bool, int, float, complex, str, bytes, type(None))) else copy.deepcopy(o)


def _rebuild(o, tensor, other, path: str = "", depth: int = 0):
    """`o` rebuilt: dicts, lists and tuples as they are, tensor(local tensor, path, its DTensor or
    None) for each tensor (a DTensor's local shard), other(value) for any other value."""
    from torch.distributed.tensor import DTensor

    if depth > 512:
        raise UnsupportedStateError("state dict is nested deeper than 512 levels (or cyclic)")
    if isinstance(o, DTensor):
        return tensor(o.to_local(), path, o)
    if isinstance(o, torch.Tensor):
        return tensor(o, path, None)
    sep = "/" if path else ""
    if isinstance(o, dict):
        items = [(k, _rebuild(v, tensor, other, f"{path}{sep}{k}", depth + 1)) for k, v in o.items()]
        return OrderedDict(items) if isinstance(o, OrderedDict) else dict(items)
    if isinstance(o, list):
        return [_rebuild(v, tensor, other, f"{path}{sep}{i}", depth + 1) for i, v in enumerate(o)]
    if isinstance(o, tuple):
        items = [_rebuild(v, tensor, other, f"{path}{sep}{i}", depth + 1) for i, v in enumerate(o)]
        return type(o)(*items) if hasattr(o, "_fields") else type(o)(items)
    if type(o).__name__ == "ShardedTensor":
        raise UnsupportedStateError("ShardedTensor cannot be staged compressed; pass snapshot='cpu' "
                                    "to GdsckptWriter")
    return other(o)


def reserve(state_dict, *, wait: bool = False, snapshot: str | None = None, **writer_options) -> Future:
    """gdsckpt.reserve for GdsckptWriter's compressed staging (snapshot "host" or "overlap", the
    defaults, and "device"): the host pool it compresses this rank's tensors (a DTensor's local
    shard) into, made and page-locked on a background thread ahead of the first dcp.async_save,
    which would otherwise grow it in its staging (beside the training, in the overlap mode).
    writer_options: GdsckptWriter's (those a save takes are used). snapshot "cpu" stages without
    the pool: nothing is reserved, the future's result is None."""
    if snapshot is not None and not snapshot_modes.lookup(snapshot, snapshot_modes.DCP).uses_pool:
        nothing: Future = Future()
        nothing.set_result(None)
        return nothing
    from gdsckpt.writing.reserve import reserve as reserve_pool
    names = {f.name for f in fields(SaveOptions)}
    save_options = {k: v for k, v in writer_options.items() if k in names}
    return reserve_pool(staged_tensors(stateful_values(state_dict)), wait=wait, **save_options)


def stateful_values(state_dict):
    """`state_dict` with each top-level Stateful (dcp_view's trees, modules, optimizers) replaced
    by its state_dict(), as dcp.save and dcp.async_save replace them before staging."""
    from torch.distributed.checkpoint.stateful import Stateful
    if not isinstance(state_dict, dict):
        return state_dict
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}


def snapshot_state_dict(obj, keep=lambda t: False, block=None):
    """A private copy of a DCP state dict: tensors (plain or DTensor, whose local shards are
    copied on their own device) through `snapshot_tensors` (and its `block`), except those for
    which keep(local tensor) holds (kept as they are); containers rebuilt, any other object
    deep-copied. The call-time part of GdsckptWriter's "device" and overlapped stagings and of a
    first staging."""
    from torch.distributed.tensor import DTensor

    found = state_tensors(obj)
    kept = [keep(t) for t in found]  # decided once per tensor, in the order rebuild meets them
    copied = iter(snapshot_tensors([t for t, k in zip(found, kept) if not k], block=block))
    decisions = iter(kept)

    def rebuild(o):
        if isinstance(o, DTensor):
            if next(decisions):
                return o
            return DTensor.from_local(next(copied), o.device_mesh, o.placements, run_check=False,
                                      shape=o.shape, stride=o.stride())
        if isinstance(o, torch.Tensor):
            if next(decisions):
                return o
            t = next(copied)
            return torch.nn.Parameter(t, o.requires_grad) if isinstance(o, torch.nn.Parameter) else t
        if isinstance(o, dict):
            items = [(k, rebuild(v)) for k, v in o.items()]
            return OrderedDict(items) if isinstance(o, OrderedDict) else dict(items)
        if isinstance(o, list):
            return [rebuild(v) for v in o]
        if isinstance(o, tuple):
            items = [rebuild(v) for v in o]
            return type(o)(*items) if hasattr(o, "_fields") else type(o)(items)
        if isinstance(o, (bool, int, float, complex, str, bytes, type(None))):
            return o
        return copy.deepcopy(o)

    try:
        return rebuild(obj)
    finally:
        # A recursive closure is a reference cycle, and `copied` holds every copy: unbroken, the
        # copies (a rank's state) waited for the cyclic collector, which saves pause.
        rebuild = None  # noqa: F841


def state_tensors(obj) -> list[torch.Tensor]:
    """The tensors of a DCP state dict in walk order (a DTensor's local shard), checked."""
    from torch.distributed.tensor import DTensor

    found: list[torch.Tensor] = []

    def collect(o, depth=0):
        if depth > 512:
            raise UnsupportedStateError("state dict is nested deeper than 512 levels (or cyclic)")
        if isinstance(o, DTensor):
            found.append(o.to_local())
        elif isinstance(o, torch.Tensor):
            if o.layout != torch.strided or o.device.type not in ("cpu", "cuda") or o.is_quantized:
                raise UnsupportedStateError(f"cannot snapshot a {o.layout} {o.dtype} tensor on {o.device}; "
                                   "pass snapshot='cpu' to GdsckptWriter")
            found.append(o)
        elif isinstance(o, dict):
            for v in o.values():
                collect(v, depth + 1)
        elif isinstance(o, (list, tuple)):
            for v in o:
                collect(v, depth + 1)
        elif type(o).__name__ == "ShardedTensor":
            raise UnsupportedStateError("ShardedTensor cannot be snapshotted on its device; "
                               "pass snapshot='cpu' to GdsckptWriter")

    try:
        collect(obj)
    finally:
        collect = None  # noqa: F841 - a recursive closure is a reference cycle; broken, `found` goes with the call
    return found


class CpuStaging:
    """snapshot="cpu" (a snapshot_modes.SnapshotMode, GdsckptWriter's alone): the state dict
    copied to host memory as torch.distributed.checkpoint's DefaultStager copies it (no GPU
    memory, no pool; the background save then compresses on the CPU)."""

    name = Snapshot.CPU
    used_by = (snapshot_modes.DCP,)
    optimizer = "unused"
    with_optimizer = None
    uses_pool = False

    def save(self, call):
        raise NotImplementedError("snapshot='cpu' is GdsckptWriter's alone")

    def stage(self, call):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        stager = DefaultStager(StagingOptions(False, False, False, False))
        try:
            return stager.stage(call.state_dict)
        finally:
            stager.close()


snapshot_modes.register(CpuStaging())
