"""The bench's views of a state tree: its tensors, their bytes, the state moved to a device.

Where the library's walk gives the answer, these use it: the leaves of gdsckpt.format.tree.flatten
are the tensors a save stores (a tensor placed twice, as tied weights are, is one leaf).
`every_tensor` is the bench's own walk, for what flatten does not answer: every place a tensor
sits (a baseline such as safetensors writes each place), and states that hold DTensors (a
rank's sharded checkpoint under torchrun; flatten refuses them, gdsckpt saves them through
gdsckpt.dcp).
"""

from __future__ import annotations

import torch

from gdsckpt.format import tree


def nbytes(state) -> int:
    """Bytes of the tensors a save of this (plain, DTensor-free) state stores."""
    return sum(leaf.tensor.nbytes for leaf in tree.flatten(state)[1])


def to_device(state, device):
    """The state with every tensor on `device` (one that is there already is kept, not copied)."""
    skeleton, leaves = tree.flatten(state)
    return tree.unflatten(skeleton, [leaf.tensor.to(device) for leaf in leaves])


def every_tensor(state) -> tuple[list[tuple[str, torch.Tensor]], int]:
    """((key, tensor) for every place a tensor sits, DTensors as they are, keys "/"-joined as
    tree.flatten makes them; the count of non-tensor values), over dicts, lists and tuples."""
    out: list[tuple[str, torch.Tensor]] = []
    others = 0

    def walk(obj, key: str) -> None:
        nonlocal others
        if isinstance(obj, torch.Tensor):
            out.append((key, obj))
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{key}/{k}" if key else str(k))
        elif isinstance(obj, (list, tuple)):
            for k, v in enumerate(obj):
                walk(v, f"{key}/{k}" if key else str(k))
        else:
            others += 1
    walk(state, "")
    return out, others


def placed_bytes(state) -> int:
    """Bytes of every place a tensor sits (a tied tensor counts at each), DTensors at their
    global size."""
    return sum(t.nbytes for _, t in every_tensor(state)[0])


def local_tensors(state) -> dict[str, torch.Tensor]:
    """{key: tensor} for every tensor of a rank's state, each DTensor as its local shard."""
    from torch.distributed.tensor import DTensor
    return {k: (t.to_local() if isinstance(t, DTensor) else t) for k, t in every_tensor(state)[0]}


def local_bytes(state) -> int:
    """Bytes this rank holds of a state (DTensors count their local shard)."""
    return sum(t.nbytes for t in local_tensors(state).values())
