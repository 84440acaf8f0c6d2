"""State tree <-> (JSON skeleton, tensor leaves).

The skeleton is plain JSON so that loading never unpickles: containers are
{"dict": [[key, node], ...]}, {"list": [...]}, {"tuple": [...]}, tensors are
{"tensor": i} (an index into the leaf list) and plain values {"value": v}.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import dtypes
from .errors import UnsupportedStateError
from .format import MAX_DEPTH


_PLAIN = (bool, int, float, str, type(None))
_INT_LIMIT = 10 ** 4300  # Python's JSON reader refuses longer ints (sys.get_int_max_str_digits)


class Leaf(NamedTuple):
    key: str  # "/"-joined key path, as users see it in errors and in `open(path).keys()`
    tensor: torch.Tensor


def flatten(state) -> tuple[dict, list[Leaf]]:
    """Check the whole state, then split it. Raises before anything is written.

    Runs on every save over thousands of nodes: keys ("/"-joined, "" for a bare tensor) are
    built as strings on the way down, and each tensor is checked with cheap attribute reads."""
    leaves: list[Leaf] = []
    seen_keys: set[str] = set()

    def walk(obj, key: str, depth: int) -> dict:
        if isinstance(obj, torch.Tensor):
            return {"tensor": add_leaf(obj, key)}
        if depth > MAX_DEPTH:
            raise UnsupportedStateError(
                f"state is nested deeper than {MAX_DEPTH} levels (or cyclic) at {key or '<root>'!r}")
        sep = "/" if depth else ""
        if isinstance(obj, dict):
            items = []
            for k, v in obj.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise UnsupportedStateError(f"dict key {k!r} at {key or '<root>'!r} is a {type(k).__name__}; "
                                                "only str and int keys can be saved")
                items.append([k, walk(v, f"{key}{sep}{k}", depth + 1)])
            return {"dict": items}
        if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
            kind = "list" if isinstance(obj, list) else "tuple"
            return {kind: [walk(v, f"{key}{sep}{i}", depth + 1) for i, v in enumerate(obj)]}
        if isinstance(obj, _PLAIN):
            if isinstance(obj, int) and not -_INT_LIMIT < obj < _INT_LIMIT:
                raise UnsupportedStateError(
                    f"int at {key or '<root>'!r} has more than 4300 digits, more than a reader accepts")
            return {"value": obj}
        raise UnsupportedStateError(
            f"cannot save {type(obj).__module__}.{type(obj).__qualname__} at {key or '<root>'!r}: "
            "gdsckpt saves tensors and int, float, bool, str, None in dicts, lists and tuples")

    def add_leaf(t: torch.Tensor, key: str) -> int:
        where = key or "<root>"
        if t.layout != torch.strided:
            raise UnsupportedStateError(f"tensor {where!r} has layout {t.layout}; only dense tensors can be saved")
        if t.dtype not in dtypes.NAME_OF:  # quantized dtypes included
            raise UnsupportedStateError(f"tensor {where!r} has dtype {t.dtype}, which gdsckpt does not store")
        if not (t.is_cuda or t.is_cpu):
            raise UnsupportedStateError(f"tensor {where!r} is on {t.device}; only cpu and cuda tensors can be saved")
        if key in seen_keys:
            raise UnsupportedStateError(f"two tensors share the key path {where!r}; rename one")
        seen_keys.add(key)
        leaves.append(Leaf(key, t.detach() if t.requires_grad else t))
        return len(leaves) - 1

    return walk(state, "", 0), leaves


def unflatten(skeleton: dict, tensors: list):
    """Rebuild the state; `tensors[i]` replaces {"tensor": i}. The skeleton was validated by format.py."""

    def build(node):
        (kind, body), = node.items()
        if kind == "tensor":
            return tensors[body]
        if kind == "value":
            return body
        if kind == "dict":
            return {k: build(v) for k, v in body}
        items = [build(v) for v in body]
        return items if kind == "list" else tuple(items)

    return build(skeleton)
