"""State tree <-> (JSON skeleton, tensor leaves).

The skeleton is plain JSON so that loading never unpickles: containers are
{"dict": [[key, node], ...]}, {"list": [...]}, {"tuple": [...]}, tensors are
{"tensor": i} (an index into the leaf list) and plain values {"value": v}.
From format 1.1: an OrderedDict is {"odict": {"items": [[key, node], ...], "metadata": {...}}}
("metadata": its `_metadata`, which Module.load_state_dict reads for versioned modules), and
tensors that share memory as identical views (tied weights) are one leaf placed more than once.
Also in 1.1 (FORMAT.md): a NumPy array, a NumPy scalar and a `bytes` are stored as a tensor (a
copy; uint8 for bytes) placed as {"ndarray": i}, {"npscalar": i} or {"bytes": i}, and load as
what they were. A stateful object (stateful.py: a module, an optimizer, a torch.Generator, ...)
is saved as its state_dict(), in its place; it loads as that state.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import accumulate, repeat
from operator import add, attrgetter, lt, mul
from typing import Callable, NamedTuple

import sys

import torch

from gdsckpt.core import collector, dtypes
from gdsckpt.errors import UnsupportedStateError
from .stateful import is_stateful, state_of, warn_unstepped
from .file import INT_LIMIT, MAX_DEPTH, MAX_NDIM, MAX_TENSORS, metadata_problem, shape_problem


_PLAIN = (bool, int, float, str, type(None))
# Types that are never stateful, NumPy or bytes: the walk skips those checks for them.
_COMMON = {dict, OrderedDict, list, tuple, bool, int, float, str, type(None)}
# Tensor placements that load as something else than a tensor (format 1.1; `typed_value`).
TYPED = ("ndarray", "npscalar", "bytes")


class Leaf(NamedTuple):
    key: str  # "/"-joined key path, as users see it in errors and in `open(path).keys()`
    tensor: torch.Tensor


@collector.paused()  # the walk's objects meet one young collection, when the save is done with them
def flatten(state, *, saving: bool = False) -> tuple[dict, list[Leaf]]:
    """Check the whole state, then split it. Raises before anything is written. saving: the state
    is being saved (not sized or reserved): an optimizer's state_dict() in it taken before its
    first step is warned of (stateful.warn_unstepped).

    Runs on every save over thousands of nodes: keys ("/"-joined, "" for a bare tensor) are
    built as strings on the way down, and the tensors are checked after the walk, all of them
    at once attribute by attribute (_leaves).

    Tensors that are the same memory seen the same way (one tensor referenced twice, or tied
    weights: `state_dict()` gives each name its own `detach()` of the one parameter) become one
    leaf, placed twice in the skeleton, so they are stored once and load as one tensor. Views
    that overlap without being identical (a tensor and its transpose, or a row of it) are
    refused: storing them apart would silently untie them."""
    found: list[torch.Tensor] = []  # the tensor of every placement, in the order the walk meets them
    found_keys: list[str] = []  # the key path of each
    nodes: list[dict] = []  # each placement's node, {kind: index into found} until _leaves numbers the leaves
    seen_keys: set[str] = set()

    def walk(obj, key: str, depth: int) -> dict:
        if isinstance(obj, torch.Tensor):
            return place(obj, key)
        if depth > MAX_DEPTH:
            raise UnsupportedStateError(
                f"state is nested deeper than {MAX_DEPTH} levels (or cyclic) at {key or '<root>'!r}")
        sep = "/" if depth else ""
        if type(obj) not in _COMMON:
            if is_stateful(obj):
                return walk(_state_of(obj, key), key, depth)
            np = sys.modules.get("numpy")  # not imported: no NumPy value can be in the state
            if np is not None and isinstance(obj, (np.ndarray, np.generic)):
                kind, t = _numpy_tensor(obj, np, key or "<root>")
                return place(t, key, kind)
            if type(obj) is bytes:
                return place(_bytes_tensor(obj), key, "bytes")
            _check_not_a_subclass(obj, key)
        if isinstance(obj, dict):
            if saving and "param_groups" in obj:  # an optimizer's state_dict()
                warn_unstepped(obj, key)
            items = []
            for k, v in obj.items():
                if type(k) is not str:
                    _check_key(k, key)
                path = f"{key}{sep}{k}"
                # a tensor value (most of a state's nodes) without the recursive call
                items.append([k, place(v, path) if isinstance(v, torch.Tensor) else walk(v, path, depth + 1)])
            if isinstance(obj, OrderedDict):
                body = {"items": items}
                meta = getattr(obj, "_metadata", None)
                if meta is not None:
                    problem = metadata_problem(meta)
                    if problem:
                        raise UnsupportedStateError(f"OrderedDict at {key or '<root>'!r}: {problem}; gdsckpt stores "
                                                    "_metadata as torch's state_dict() makes it")
                    body["metadata"] = {p: dict(e) for p, e in meta.items()}
                return {"odict": body}
            return {"dict": items}
        if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
            kind = "list" if isinstance(obj, list) else "tuple"
            return {kind: [walk(v, f"{key}{sep}{i}", depth + 1) for i, v in enumerate(obj)]}
        if isinstance(obj, _PLAIN):
            if isinstance(obj, int) and not -INT_LIMIT < obj < INT_LIMIT:
                raise UnsupportedStateError(
                    f"int at {key or '<root>'!r} has more than 4300 digits, more than a reader accepts")
            return {"value": obj}
        raise UnsupportedStateError(
            f"cannot save {type(obj).__module__}.{type(obj).__qualname__} at {key or '<root>'!r}: "
            "gdsckpt saves tensors, NumPy arrays and scalars, int, float, bool, str, bytes and None in dicts, "
            "lists and tuples, and objects with state_dict() and load_state_dict()")

    def place(t: torch.Tensor, key: str, kind: str = "tensor") -> dict:
        if key in seen_keys:
            raise UnsupportedStateError(f"two tensors share the key path {key or '<root>'!r}; rename one")
        seen_keys.add(key)
        node = {kind: len(found)}
        found.append(t)
        found_keys.append(key)
        nodes.append(node)
        return node

    try:
        skeleton = walk(state, "", 0)
    finally:
        walk = None  # noqa: F841 - a recursive closure is a reference cycle; broken, `found` goes with the call
    leaves = _leaves(found, found_keys, nodes)
    return skeleton, leaves


# A subclass of one of these would be saved as the base type and load as it (an IntEnum as an
# int, a defaultdict as a dict, losing its type and default factory): refused instead.
_BASES = (dict, bytes, int, float, str)


def _check_not_a_subclass(obj, key: str) -> None:
    """Refuse a subclass of dict, bytes, int, float or str (UnsupportedStateError naming the key):
    nothing in the file could say what it was, so it would load, silently, as the base type. Only
    values of other types than the common ones reach this, after NumPy's scalars (np.float64 is a
    float) and stateful objects were taken; an OrderedDict is a common type, kept as one."""
    base = next((b for b in _BASES if isinstance(obj, b)), None)
    if base is not None:
        how = "dict(value)" if base is dict else f"{base.__name__}(value), or an enum member's .value"
        raise UnsupportedStateError(
            f"cannot save {type(obj).__module__}.{type(obj).__qualname__} at {key or '<root>'!r}: a subclass of "
            f"{base.__name__}, it would load as a plain {base.__name__}; convert it first: {how}")


_PLAIN_TENSORS = {torch.Tensor, torch.nn.Parameter}  # no dispatch of their own: their memory is their data
_new_leaf = tuple.__new__  # Leaf(key, t) without NamedTuple's Python-level __new__ (~0.3 us a tensor)
_is_nested, _layout, _dtype = attrgetter("is_nested"), attrgetter("layout"), attrgetter("dtype")
_is_cuda, _is_cpu, _requires_grad = attrgetter("is_cuda"), attrgetter("is_cpu"), attrgetter("requires_grad")
_itemsize = attrgetter("itemsize")


def _leaves(found: list[torch.Tensor], keys: list[str], nodes: list[dict]) -> list[Leaf]:
    """The leaves of the tensors the walk placed (`found`, at `keys`), and `nodes` (each one's
    {kind: index into found}) numbered by leaf. Every check of _check_tensor runs attribute by
    attribute over all of them (map: one C loop an attribute, not Python per tensor); where one
    fails, the tensor-by-tensor checks name the first that fails. Tensors
    that are the same memory seen the same way (one object placed twice, tied weights) become one
    leaf; overlapping views are refused."""
    n = len(found)
    numels = _checked_numels(found)
    if numels is None:
        for t, key in zip(found, keys):
            _check_tensor(t, key)  # raises for the first tensor that fails
        numels = list(map(torch.Tensor.numel, found))
    devs = list(map(torch.Tensor.get_device, found))
    ptrs = list(map(torch.Tensor.data_ptr, found))
    # The first placement of each memory: non-empty tensors by (first byte's address, device)
    # packed into one int (plain ints are not tracked by Python's collector: a tuple per tensor
    # tripled the walk's time through full collections), empty ones by object.
    where = [p << 10 | (d + 1) if m else -id(t) for p, d, m, t in zip(ptrs, devs, numels, found)]
    first = {w: i for w, i in zip(reversed(where), range(n - 1, -1, -1))}
    own = range(n)  # the placement of each leaf
    if len(first) < n:  # a memory placed twice: one leaf, if seen the same way
        number, own = [0] * n, []  # the leaf of each placement
        for i, j in enumerate(map(first.__getitem__, where)):
            if j == i:
                number[i] = len(own)
                own.append(i)
            elif _same_view(found[j], found[i]):
                number[i] = number[j]
            else:
                raise _overlap(keys[j], keys[i])
        for node, k in zip(nodes, number):
            node[next(iter(node))] = k
        found, keys, numels, devs, ptrs = ([x[i] for i in own] for x in (found, keys, numels, devs, ptrs))
    if len(own) > MAX_TENSORS:
        raise UnsupportedStateError(f"more than {MAX_TENSORS} tensors, more than a reader accepts")
    if any(map(_requires_grad, found)):
        found = [t.detach() if t.requires_grad else t for t in found]
    leaves = list(map(_new_leaf, repeat(Leaf), zip(keys, found)))
    _refuse_overlaps(leaves, numels, devs, ptrs)
    return leaves


def _checked_numels(found: list[torch.Tensor]) -> list[int] | None:
    """Each tensor's numel() if every tensor passes _check_tensor, else None."""
    if not set(map(type, found)) <= _PLAIN_TENSORS or any(map(_is_nested, found)):
        return None
    if set(map(_layout, found)) - {torch.strided} or not set(map(_dtype, found)) <= dtypes.NAME_OF.keys():
        return None
    if sum(map(_is_cuda, found)) + sum(map(_is_cpu, found)) != len(found):
        return None
    numels = list(map(torch.Tensor.numel, found))
    if max(map(torch.Tensor.dim, found), default=0) > MAX_NDIM or not all(0 < m < 1 << 62 for m in numels):
        if any(shape_problem(t.shape) for t, m in zip(found, numels) if t.dim() > MAX_NDIM or not 0 < m < 1 << 62):
            return None
    return numels


def _state_of(obj, key: str):
    """A stateful object's state_dict() (a generator's get_state()), called at save time; a failure
    says whose."""
    where = key or "<root>"
    try:
        inner = state_of(obj)
    except Exception as e:
        e.add_note(f"gdsckpt: raised by state_dict() of the {type(obj).__qualname__} at {where!r}")
        raise
    if is_stateful(inner):  # would be walked again, and again
        raise UnsupportedStateError(f"state_dict() of the {type(obj).__qualname__} at {where!r} returned a "
                                    f"{type(inner).__qualname__}, itself an object with state_dict(); it must "
                                    "return the state (a dict)")
    return inner


def _numpy_tensor(obj, np, where: str) -> tuple[str, torch.Tensor]:
    """A NumPy array or scalar as ("ndarray" or "npscalar", a tensor over a C-ordered copy of it).
    Only what comes back exactly is accepted: a plain ndarray or a scalar, of a dtype torch has
    too (dtypes.NUMPY_NAMES), in native byte order."""
    kind = "ndarray" if isinstance(obj, np.ndarray) else "npscalar"
    what = f"NumPy {'array' if kind == 'ndarray' else 'scalar'} at {where!r}"
    if kind == "ndarray" and type(obj) is not np.ndarray:
        raise UnsupportedStateError(f"{what} is a {type(obj).__module__}.{type(obj).__qualname__}, an ndarray "
                                    "subclass that would load as a plain ndarray; save np.asarray(x)")
    dt = obj.dtype
    if dt.name not in dtypes.NUMPY_NAMES or not dt.isnative:
        raise UnsupportedStateError(f"{what} has dtype {dt.str} ({dt.name}); gdsckpt stores NumPy values of "
                                    f"native byte order and the dtypes {', '.join(dtypes.NUMPY_NAMES)}")
    return kind, torch.from_numpy(np.array(obj, order="C"))  # a copy: later changes to obj are not saved


def _bytes_tensor(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8)


def typed_value(kind: str, t: torch.Tensor):
    """What a placement of `kind` loads as, from its tensor: the tensor itself, or the NumPy array
    (sharing the tensor's memory when on the CPU), NumPy scalar or bytes it was saved from."""
    if kind == "tensor":
        return t
    arr = t.cpu().numpy()
    if kind == "ndarray":
        return arr
    return arr[()] if kind == "npscalar" else arr.tobytes()


def _check_key(k, where: str) -> None:
    """A dict key that is not a str: an int a reader takes, else an UnsupportedStateError."""
    if isinstance(k, bool) or not isinstance(k, (str, int)):
        raise UnsupportedStateError(f"dict key {k!r} at {where or '<root>'!r} is a {type(k).__name__}; "
                                    "only str and int keys can be saved")
    if isinstance(k, int) and not -INT_LIMIT < k < INT_LIMIT:
        raise UnsupportedStateError(
            f"int key at {where or '<root>'!r} has more than 4300 digits, more than a reader accepts")


def _check_tensor(t: torch.Tensor, key: str) -> None:
    """Everything save refuses about one tensor, as an UnsupportedStateError naming it (key path
    `key`); attribute reads in the order that keeps each one safe to ask (a nested tensor has no
    sizes). _checked_numels asks the same of all tensors at once; this names the one that fails."""
    where = key or "<root>"
    if t.is_nested:
        raise UnsupportedStateError(f"tensor {where!r} is a nested tensor; only dense tensors can be saved "
                                    "(save its components, t.unbind(), as a list)")
    if t.layout != torch.strided:
        raise UnsupportedStateError(f"tensor {where!r} has layout {t.layout}; only dense tensors can be saved")
    if type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        raise UnsupportedStateError(
            f"tensor {where!r} is a {type(t).__module__}.{type(t).__qualname__}, a tensor subclass with its own "
            "dispatch (FakeTensor, DTensor, ...) whose memory is not its data; save plain tensors "
            "(DTensor: through gdsckpt.dcp)")
    if t.dtype not in dtypes.NAME_OF:  # quantized dtypes included
        raise UnsupportedStateError(f"tensor {where!r} has dtype {t.dtype}, which gdsckpt does not store")
    if not (t.is_cuda or t.is_cpu):
        raise UnsupportedStateError(f"tensor {where!r} is on {t.device}; only cpu and cuda tensors can be saved")
    if t.dim() > MAX_NDIM or not 0 < t.numel() < 1 << 62:  # else shape_problem has nothing to say
        problem = shape_problem(t.shape)
        if problem:
            raise UnsupportedStateError(f"tensor {where!r}: {problem}, which a reader refuses")


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            and a.is_conj() == b.is_conj() and a.is_neg() == b.is_neg())


def _overlap(a: str, b: str) -> UnsupportedStateError:
    return UnsupportedStateError(
        f"tensors {a or '<root>'!r} and {b or '<root>'!r} share memory as different views (overlapping, not "
        "identical: e.g. a tensor and its transpose or a slice of it); gdsckpt stores shared tensors once only "
        "when the views are identical. Save one of them, or .clone() the other to store it separately")


def _refuse_overlaps(leaves: list[Leaf], numels: list[int], devs: list[int], ptrs: list[int]) -> None:
    """Distinct non-empty leaves on one device whose byte ranges overlap: views that share memory
    without being identical. (Interleaved views such as t[::2] and t[1::2] overlap by range too and
    are refused with them: conservative, never silently untied.) numels, devs, ptrs: per leaf."""
    tensors = [l.tensor for l in leaves]
    sizes = list(map(mul, numels, map(_itemsize, tensors)))
    if not all(map(torch.Tensor.is_contiguous, tensors)):
        sizes = [b if t.is_contiguous() else span(t) * t.itemsize for b, t in zip(sizes, tensors)]
    ends = list(map(add, ptrs, sizes))
    groups = [range(len(leaves))] if len(set(devs)) == 1 else [
        [k for k in range(len(leaves)) if devs[k] == d] for d in set(devs)]
    for group in groups:
        ks = sorted(group if all(numels) else [k for k in group if numels[k]], key=ptrs.__getitem__)
        starts, reach = [ptrs[k] for k in ks], list(accumulate((ends[k] for k in ks), max))
        if not any(map(lt, starts[1:], reach)):  # each starts at or after every earlier one's end
            continue
        end, owner = ends[ks[0]], ks[0]
        for k in ks[1:]:
            if ptrs[k] < end:
                raise _overlap(leaves[owner].key, leaves[k].key)
            if ends[k] > end:
                end, owner = ends[k], k


def span(t: torch.Tensor) -> int:
    """Elements from a strided tensor's first to its last, inclusive (the memory it reaches)."""
    return sum((d - 1) * s for d, s in zip(t.shape, t.stride())) + 1


def placements(skeleton: dict, key: str = "", depth: int = 0, kinds=("tensor",)) -> list[tuple[str, int]]:
    """(key path, tensor index) of every placement of `kinds` in tree order, keys as flatten builds
    them: what load_into matches a target against. `skeleton` is one flatten made (or validated),
    or a node of one at key path `key`, `depth` levels below the root."""
    out = []
    stack = [(skeleton, key, depth)]
    while stack:
        node, key, depth = stack.pop()
        (kind, body), = node.items()
        if kind in kinds:
            out.append((key, body))
            continue
        if kind == "odict":
            kind, body = "dict", body["items"]
        sep = "/" if depth else ""
        if kind == "dict":
            stack.extend((v, f"{key}{sep}{k}", depth + 1) for k, v in reversed(body))
        elif kind in ("list", "tuple"):
            stack.extend((body[i], f"{key}{sep}{i}", depth + 1) for i in range(len(body) - 1, -1, -1))
    return out


def unflatten(skeleton: dict, tensors: list):
    """Rebuild the state; `tensors[i]` replaces {"tensor": i} (the same object wherever i is placed
    more than once). The skeleton was validated by format.py."""
    return rebuild(skeleton, lambda i, key: tensors[i])


def rebuild(node: dict, leaf: Callable[[int, str | None], torch.Tensor], key: str | None = None, depth: int = 0):
    """The value skeleton `node` stands for; `leaf(i, key)` gives the tensor of each placement
    {"tensor": i} (and of the typed ones, which `typed_value` then converts). With `key`, the
    node's key path (`depth` levels below the root), leaf gets each placement's key path, built as
    flatten builds them; without, None (no strings built)."""

    def build(node, key, depth):
        (kind, body), = node.items()
        if kind == "tensor":
            return leaf(body, key)
        if kind in TYPED:
            return typed_value(kind, leaf(body, key))
        if kind == "value":
            return body

        def child(k):
            return None if key is None else f"{key}/{k}" if depth else str(k)

        if kind == "dict":
            return {k: build(v, child(k), depth + 1) for k, v in body}
        if kind == "odict":
            out = OrderedDict((k, build(v, child(k), depth + 1)) for k, v in body["items"])
            if "metadata" in body:
                out._metadata = OrderedDict((p, dict(e)) for p, e in body["metadata"].items())
            return out
        items = [build(v, child(i), depth + 1) for i, v in enumerate(body)]
        return items if kind == "list" else tuple(items)

    try:
        return build(node, key, depth)
    finally:
        build = None  # noqa: F841 - a recursive closure is a reference cycle; broken, `leaf` goes with the call
