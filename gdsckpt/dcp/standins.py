"""The stand-ins of GdsckptWriter's compressed staging: what DCP plans with in place of the
staged tensors (the shapes, dtypes and DTensor placements of the tensors, but no memory: one
element, expanded), each found again by its data address.

They are kept per process and handed out again while a key keeps its layout (shape, dtype,
device, requires_grad, DTensor spec): a steady save builds none, and the whole staging keeps
one `layout` token while every key keeps its stand-in, so that what depends only on the
stand-ins (DCP's local plan, our write results: planner.py, results.py) is prepared once per
layout and reused. Nothing changes a stand-in after it is made, and only DCP's planner and
GdsckptWriter see them, so the same object means the same layout.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field

import torch

__all__ = ["StandInElements", "StandIns", "StandInRound", "data_address", "STAND_INS"]


class StandInElements:
    """The one element behind each stand-in: a distinct element of a block per (dtype,
    device), so that no two stand-ins share a data address (write_data finds each one's key
    by it) while a staging of thousands of tensors allocates a few blocks, not a tensor
    (and, on a GPU, a kernel) each. Kept alive with the staging."""

    BLOCK = 4096

    def __init__(self):
        self.blocks: list[torch.Tensor] = []  # all of them: a freed block's addresses could come back
        self.current: dict[tuple, list] = {}  # (dtype, device) -> [block, elements used]
        self.taken = 0

    def take(self, dtype: torch.dtype, device: torch.device, requires_grad: bool) -> torch.Tensor:
        entry = self.current.get((dtype, device))
        if entry is None or entry[1] == self.BLOCK:
            self.blocks.append(torch.zeros(self.BLOCK, dtype=dtype, device=device))
            entry = self.current[(dtype, device)] = [self.blocks[-1], 0]
        one = entry[0][entry[1]:entry[1] + 1]
        entry[1] += 1
        self.taken += 1
        # a stand-in of a parameter requires grad as the parameter does
        return one.detach().requires_grad_(True) if requires_grad else one


def data_address(t: torch.Tensor) -> tuple[int, int]:
    """Where a tensor's data starts, also for one of no elements (whose data_ptr() is 0)."""
    return t.untyped_storage().data_ptr(), t.storage_offset()


@dataclass
class _Entry:
    signature: tuple  # (local shape, dtype, device, requires_grad, DTensor spec or None)
    stand_in: torch.Tensor  # what the stand-in state dict holds (a DTensor for a DTensor)
    address: tuple[int, int]  # data_address of its local tensor


@dataclass
class StandInRound:
    """One staging's stand-ins, in walk order: `keys` (data address -> key) and `shapes` (key
    -> local shape) as write_data needs them; `layout`, set when the round ends."""

    owner: "StandIns"
    entries: dict[str, _Entry] = field(default_factory=dict)
    keys: dict[tuple[int, int], str] = field(default_factory=dict)
    shapes: dict[str, tuple] = field(default_factory=dict)
    reused: int = 0
    layout: object = None

    def stand_in(self, key: str, local: torch.Tensor, dtensor=None):
        """The stand-in for `local` (a plain tensor, or `dtensor`'s local shard) at `key`: the
        one made before for this key if its layout is the same, else a new one."""
        shape = tuple(local.shape)
        requires_grad = local.requires_grad and (local.is_floating_point() or local.is_complex())
        spec = None if dtensor is None else dtensor._spec
        signature = (shape, local.dtype, local.device, requires_grad, spec)
        entry = self.owner.by_key.get(key)
        if entry is not None and entry.signature == signature:
            self.reused += 1
        else:
            one = self.owner.elements.take(local.dtype, local.device, requires_grad)
            stand_in = one.reshape(()).expand(shape)
            if dtensor is not None:
                stand_in = _dtensor_like(dtensor, stand_in)
            entry = _Entry(signature, stand_in, data_address(one))
            self.owner.note(stand_in)
        self.entries[key] = entry
        self.keys[entry.address] = key
        self.shapes[key] = shape
        return entry.stand_in


class StandIns:
    """The process's stand-ins by key, from the last staging (a `round` around each)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.elements = StandInElements()
        self.by_key: dict[str, _Entry] = {}
        self.layout = object()
        self.made_here: dict[int, weakref.ref] = {}  # id -> every stand-in made, while it lives

    def made(self, t: torch.Tensor) -> bool:
        """t is a stand-in made here (so its layout never changes)."""
        ref = self.made_here.get(id(t))
        return ref is not None and ref() is t

    def note(self, stand_in: torch.Tensor) -> None:
        key = id(stand_in)
        self.made_here[key] = weakref.ref(stand_in, lambda _, k=key, d=self.made_here: d.pop(k, None))

    @contextlib.contextmanager
    def round(self):
        """A StandInRound for one staging's walk. If the walk succeeds its stand-ins are kept for
        the next staging and its layout named: the last one while every key kept its stand-in,
        else a new one."""
        with self.lock:
            # Stand-ins a changed layout replaced keep their elements: start over once most of
            # the blocks' elements are stale (the blocks live on while a staging holds them).
            if self.elements.taken > 2 * len(self.by_key) + StandInElements.BLOCK:
                self.elements, self.by_key = StandInElements(), {}
            round_ = StandInRound(self)
            yield round_
            if not round_.reused == len(round_.entries) == len(self.by_key):
                self.layout = object()
            self.by_key = round_.entries
            round_.layout = self.layout


STAND_INS = StandIns()


def _dtensor_like(d, local: torch.Tensor):
    """A DTensor of `d`'s global shape, mesh and placements over `local`. DTensor's own
    constructor with d's (immutable) spec: DTensor.from_local re-derives and validates the
    spec through an autograd Function, ~0.1 ms a tensor, most of a 1,748-tensor staging's
    Python time (bench/probes/dcp_stage_profile.py); from_local where that constructor differs."""
    from torch.distributed.tensor import DTensor
    try:
        return DTensor(local, d._spec, requires_grad=local.requires_grad)
    except (AttributeError, TypeError):
        return DTensor.from_local(local, d.device_mesh, d.placements, run_check=False, shape=d.shape, stride=d.stride())
