"""Values every rank names alike must be alike, checked at a DCP save.

DCP keeps one copy of a value that every rank names with the same key, taking it for replicated
(a plain tensor, a Python object), and every rank loads that copy at the restore. A value that
differs across ranks under one key (a data loader's position, a per-rank counter, the state of an
RNG() deeper than the top level) would come back on every rank as one rank's, without a word. So
a Checkpointer's DCP save compares, across ranks, a digest of every such value and refuses the
save on every rank, naming the keys, where they differ.

Not compared: DTensors (each rank saves its shards), and what modules and optimizers hold (their
plain tensors are replicated by DDP's contract, and comparing them would read the model at every
save); a top-level gdsckpt.RNG(), which is saved per rank (stateful.rank_key).
"""

from __future__ import annotations

import hashlib
import pickle

import torch

from gdsckpt.format.checksum import crc64nvme
from gdsckpt.errors import UnsupportedStateError
from gdsckpt.format.stateful import RNG, is_stateful, state_of

_SHOWN = 5  # keys named in the error


def check_alike(state: dict, group=None) -> None:
    """A collective on `group` (None: the default group): UnsupportedStateError on every rank,
    naming the keys, if the ranks hold different values under one key (see the module)."""
    import torch.distributed as dist
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, digests(state), group=group)
    keys = sorted(set().union(*every))
    differing = [k for k in keys if len({d[k] for d in every if k in d}) > 1]
    if not differing:
        return
    more = f" and {len(differing) - _SHOWN} more" if len(differing) > _SHOWN else ""
    raise UnsupportedStateError(
        f"{', '.join(map(repr, differing[:_SHOWN]))}{more} differ across ranks: DCP keeps one copy of a value "
        "every rank names alike, and every rank would restore that one. Put each rank's value under a key of its "
        "own (f\"loader_{dist.get_rank()}\", as torchtitan keys its loaders), or a gdsckpt.RNG() at the top "
        "level of the state, where it is saved per rank")


def digests(state: dict) -> dict[str, str]:
    """{dotted key: digest} of the values DCP saves once for all ranks (see the module)."""
    out: dict[str, str] = {}
    for k, v in state.items():
        if not isinstance(v, RNG):  # saved per rank
            _walk(v, str(k), out, 0)
    return out


def _walk(v, key: str, out: dict, depth: int) -> None:
    from torch.distributed.tensor import DTensor
    if isinstance(v, (DTensor, torch.nn.Module, torch.optim.Optimizer)):
        return
    if depth > 64:  # as deep as tree.flatten goes; deeper is refused there
        return
    if is_stateful(v):
        _walk(state_of(v), key, out, depth + 1)
    elif isinstance(v, dict):
        for k, x in v.items():
            _walk(x, f"{key}.{k}", out, depth + 1)
    elif isinstance(v, (list, tuple)) and any(_holds_more(x) for x in v):
        for i, x in enumerate(v):
            _walk(x, f"{key}.{i}", out, depth + 1)
    elif isinstance(v, torch.Tensor):
        t = v.detach().reshape(-1).cpu().contiguous()
        out[key] = f"{t.dtype}{list(v.shape)}:{crc64nvme(t.view(torch.uint8).numpy()):016x}"
    else:
        out[key] = _object_digest(v)


def _holds_more(v) -> bool:
    """Whether a list's element is walked into (else the list is one value: a generator's state of
    624 integers is named once, not per integer)."""
    return isinstance(v, (torch.Tensor, dict, list, tuple)) or is_stateful(v)


def _object_digest(v) -> str:
    """A digest of a plain value, as DCP pickles it; a set's elements in a fixed order (their
    iteration order follows each process's hash seed)."""
    if isinstance(v, (set, frozenset)):
        return "set:" + ",".join(sorted(_object_digest(x) for x in v))
    try:
        return hashlib.sha256(pickle.dumps(v, protocol=4)).hexdigest()
    except Exception:  # noqa: BLE001 - DCP's own pickling says what is wrong with it
        return "unpicklable"
