"""The memory tier under torch.distributed: what one rank keeps in its own tier, and how it reads
it back (gdsckpt/manager/memory/steps.py decides when, and makes the ranks agree).

A rank's memory copy is its view of the state as DCP saves it (stateful.dcp_view: the state
dicts of modules and optimizers, through torch's get_model_state_dict / get_optimizer_state_dict)
with every DTensor replaced by the rank's local shard: the rank's compressed shards, taken by
save_async's snapshot from the live tensors on the rank's own GPU, and nothing of other ranks'.
So it is read back by the same rank into the same shards: a restart on the same nodes, with the
same world size and sharding. A shard of another shape is a StateMismatchError, which the ranks
treat as a copy they cannot use (they fall back together).
"""

from __future__ import annotations

from collections import OrderedDict

from torch.distributed.checkpoint.stateful import Stateful

from gdsckpt import api
from gdsckpt.format.stateful import dcp_view, dcp_write_back
from gdsckpt.stats import Stats


def snapshot(state) -> dict:
    """What a rank saves into its memory tier for `state`: the DCP view's state dicts, local shards."""
    return _local(_state_dicts(dcp_view(state)))


def load_rank(source, state, strict: bool = True) -> Stats:
    """Fill `state` from this rank's copy `source` (a ChunkSource): every chunk verified before a
    byte reaches `state` (atomic), the shards in place, then each stateful object's state through
    the DCP view's load_state_dict (set_model_state_dict, set_optimizer_state_dict, ...), plain
    values written back."""
    view = dcp_view(state, strict=strict)
    dicts = _state_dicts(view)
    local = _local(dicts)
    stats = api.load_into(source, local, strict=strict, atomic=True)
    loaded = _merge(dicts, local)
    for k, v in view.items():
        if isinstance(v, Stateful):
            v.load_state_dict(loaded[k])
        else:
            view[k] = loaded[k]
    dcp_write_back(state, view)
    return stats


def _state_dicts(view: dict) -> dict:
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in view.items()}


def _local(tree):
    """`tree` with every DTensor replaced by its local shard (same memory); containers rebuilt."""
    from torch.distributed.tensor import DTensor
    if isinstance(tree, DTensor):
        return tree.to_local()
    if isinstance(tree, dict):
        return _like(tree, [(k, _local(v)) for k, v in tree.items()])
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(_local(v) for v in tree)
    return tree


def _merge(original, loaded):
    """`original`'s DTensors (their shards filled in place) with `loaded`'s other values."""
    from torch.distributed.tensor import DTensor
    if isinstance(original, DTensor):
        return original
    if isinstance(original, dict):
        return _like(original, [(k, _merge(original[k], v) if k in original else v) for k, v in loaded.items()])
    if isinstance(original, (list, tuple)) and not hasattr(original, "_fields"):
        return type(original)(_merge(a, b) for a, b in zip(original, loaded))
    return loaded


def _like(d: dict, pairs: list) -> dict:
    return OrderedDict(pairs) if isinstance(d, OrderedDict) else dict(pairs)
