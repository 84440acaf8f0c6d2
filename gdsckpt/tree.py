"""State tree <-> (JSON skeleton, tensor leaves).

The skeleton is plain JSON so that loading never unpickles: containers are
{"dict": [[key, node], ...]}, {"list": [...]}, {"tuple": [...]}, tensors are
{"tensor": i} (an index into the leaf list) and plain values {"value": v}.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import dtypes
from .errors import UnsupportedStateError

MAX_DEPTH = 256
_PLAIN = (bool, int, float, str, type(None))
_INT_LIMIT = 10 ** 4300  # Python's JSON reader refuses longer ints (sys.get_int_max_str_digits)


@dataclass(frozen=True)
class Leaf:
    key: str  # "/"-joined key path, as users see it in errors and in `open(path).keys()`
    tensor: torch.Tensor


def key_str(path: tuple) -> str:
    return "/".join(str(k) for k in path)


def flatten(state) -> tuple[dict, list[Leaf]]:
    """Check the whole state, then split it. Raises before anything is written."""
    leaves: list[Leaf] = []
    seen_keys: set[str] = set()

    def at(path: tuple) -> str:  # only on the error path: most states hold thousands of nodes
        return key_str(path) or "<root>"

    def walk(obj, path: tuple) -> dict:
        if len(path) > MAX_DEPTH:
            raise UnsupportedStateError(f"state is nested deeper than {MAX_DEPTH} levels (or cyclic) at {at(path)!r}")
        if isinstance(obj, torch.Tensor):
            return {"tensor": add_leaf(obj, path)}
        if isinstance(obj, dict):
            items = []
            for k, v in obj.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise UnsupportedStateError(
                        f"dict key {k!r} at {at(path)!r} is a {type(k).__name__}; only str and int keys can be saved")
                items.append([k, walk(v, path + (k,))])
            return {"dict": items}
        if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
            kind = "list" if isinstance(obj, list) else "tuple"
            return {kind: [walk(v, path + (i,)) for i, v in enumerate(obj)]}
        if isinstance(obj, _PLAIN):
            if isinstance(obj, int) and not -_INT_LIMIT < obj < _INT_LIMIT:
                raise UnsupportedStateError(f"int at {at(path)!r} has more than 4300 digits, more than a reader accepts")
            return {"value": obj}
        raise UnsupportedStateError(
            f"cannot save {type(obj).__module__}.{type(obj).__qualname__} at {at(path)!r}: "
            "gdsckpt saves tensors and int, float, bool, str, None in dicts, lists and tuples")

    def add_leaf(t: torch.Tensor, path: tuple) -> int:
        key = key_str(path)
        where = key or "<root>"
        if t.layout != torch.strided:
            raise UnsupportedStateError(f"tensor {where!r} has layout {t.layout}; only dense tensors can be saved")
        if t.is_quantized:
            raise UnsupportedStateError(f"tensor {where!r} is quantized ({t.dtype}); only dense tensors can be saved")
        if dtypes.name_of(t.dtype) is None:
            raise UnsupportedStateError(f"tensor {where!r} has dtype {t.dtype}, which gdsckpt does not store")
        if t.device.type not in ("cpu", "cuda"):
            raise UnsupportedStateError(f"tensor {where!r} is on {t.device}; only cpu and cuda tensors can be saved")
        if key in seen_keys:
            raise UnsupportedStateError(f"two tensors share the key path {key!r}; rename one")
        seen_keys.add(key)
        leaves.append(Leaf(key, t.detach()))
        return len(leaves) - 1

    return walk(state, ()), leaves


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
