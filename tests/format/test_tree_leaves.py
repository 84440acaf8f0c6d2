"""tree.flatten's leaves: which placements share a leaf, and which tensor an error names (the
checks run over all tensors at once, then tensor by tensor where one fails)."""

import pytest
import torch

from gdsckpt.errors import UnsupportedStateError
from gdsckpt.format.tree import flatten


def test_one_object_placed_twice_is_one_leaf_even_when_empty():
    empty, other_empty, t = torch.empty(0), torch.empty(0), torch.arange(6.0)
    skeleton, leaves = flatten({"a": empty, "b": empty, "c": other_empty, "d": t, "e": t.view(6), "f": [t]})
    assert skeleton == {"dict": [["a", {"tensor": 0}], ["b", {"tensor": 0}], ["c", {"tensor": 1}],
                                 ["d", {"tensor": 2}], ["e", {"tensor": 2}], ["f", {"list": [{"tensor": 2}]}]]}
    assert [l.key for l in leaves] == ["a", "c", "d"]
    assert leaves[0].tensor is empty and leaves[1].tensor is other_empty and leaves[2].tensor is t


def test_leaves_after_a_shared_one_are_numbered_densely():
    w = torch.nn.Parameter(torch.ones(2, 3))
    skeleton, leaves = flatten({"wte": w, "x": torch.zeros(1), "lm_head": w.detach(), "y": torch.ones(4)})
    assert [n for _, n in skeleton["dict"]] == [{"tensor": 0}, {"tensor": 1}, {"tensor": 0}, {"tensor": 2}]
    assert [l.key for l in leaves] == ["wte", "x", "y"]
    assert not leaves[0].tensor.requires_grad


def test_the_first_tensor_that_fails_in_walk_order_is_named():
    state = {"ok": torch.ones(2), "sparse": torch.ones(2).to_sparse(), "quantized": torch.quantize_per_tensor(
        torch.ones(2), 0.1, 0, torch.qint8)}
    with pytest.raises(UnsupportedStateError, match="tensor 'sparse' has layout torch.sparse_coo"):
        flatten(state)
    state = {"ok": torch.ones(2), "quantized": state["quantized"], "sparse": state["sparse"]}
    with pytest.raises(UnsupportedStateError, match="tensor 'quantized' has dtype torch.qint8"):
        flatten(state)


def test_a_tensor_subclass_without_its_own_dispatch_is_saved_as_its_memory():
    class Marked(torch.Tensor):
        pass

    marked = torch.arange(3.0).as_subclass(Marked)
    skeleton, leaves = flatten({"m": marked, "alias": marked.as_subclass(torch.Tensor)})
    assert [n for _, n in skeleton["dict"]] == [{"tensor": 0}, {"tensor": 0}]
    assert len(leaves) == 1
