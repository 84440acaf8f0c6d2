"""load_into: a checkpoint restored into the caller's state, stateful objects included.

The state is walked beside the checkpoint's skeleton in three phases, so that nothing of it
changes before every check has passed (and, with atomic=True, every chunk was verified):

1. plan: a tensor the caller holds in a dict, list or tuple is filled in place. A stateful object
   (stateful.py) gets, for each tensor of its saved state, the tensor at that key of its own
   state_dict() where it has one (a module's parameters: filled in place), else a new one on the
   device its tensors live on (a fresh optimizer's moments: on their parameter's device). A plain
   value in the caller's dicts and lists is to be replaced by the saved one. Mismatches raise
   StateMismatchError here.
2. read: Checkpoint.read_into fills every tensor (atomic=True: after verifying every chunk).
3. apply: each stateful object's load_state_dict() with its restored state, and the plain values
   written back.
"""

from __future__ import annotations

from itertools import chain
from typing import Callable

import torch

from gdsckpt.core import collector
from gdsckpt.core.dtypes import BY_NAME
from gdsckpt.errors import StateMismatchError
from gdsckpt.format.stateful import is_stateful, load_state
from gdsckpt.format.tree import TYPED, placements, rebuild

_CPU = torch.device("cpu")
_ALL_PLACEMENTS = ("tensor",) + TYPED
_LEAVES = _ALL_PLACEMENTS + ("value",)  # what a saved subtree holds: tensors and plain values


@collector.paused()  # the plan's objects (a target per tensor, their actions) meet one young collection
def restore_into(ck, state, *, strict: bool = True, atomic: bool = False):
    """Restore the checkpoint `ck` (an open Checkpoint) into `state`; returns read_into's Stats.

    strict=True: the keys must match (every tensor and plain value the checkpoint holds has its
    place in `state`, and everything `state` names is in the checkpoint; an nn.Module's keys
    exactly), else a StateMismatchError before anything is read. strict=False: what is missing on
    either side is left alone (nn.Module.load_state_dict(strict=False)). A plain value at the root,
    or in a tuple at the root, has no place to be written back to and is left alone (strict: a
    plain value at the root where the checkpoint holds a container or a tensor is a mismatch)."""
    plan = _Plan(ck, strict)
    plan.into(state, ck.index.skeleton, "", 0)
    if strict and (plan.missing or plan.unknown):
        raise StateMismatchError(f"{ck.path}: keys differ from the checkpoint's: missing from the target "
                                 f"{plan.missing[:5]}, not in the checkpoint {plan.unknown[:5]} (strict=False "
                                 "leaves what is missing on either side alone, tensors and plain values alike)")
    stats = ck.read_into(plan.targets, atomic=atomic)
    try:
        for action in plan.actions:
            action()
    finally:
        plan.actions.clear()  # each refers to the plan: a cycle, left to the collector that restores pause
    return stats


def _kind(node) -> str | None:
    return None if node is None else next(iter(node))


def _items(node) -> list:
    (kind, body), = node.items()
    return body["items"] if kind == "odict" else body


def _child_key(key: str, depth: int, k) -> str:
    return f"{key}/{k}" if depth else str(k)


def _what(node) -> str:
    kind = _kind(node)
    return {"value": "a plain value", "odict": "a dict", "npscalar": "a NumPy scalar", "ndarray": "a NumPy array",
            "bytes": "bytes"}.get(kind, f"a {kind}")


class _Plan:
    """What restore_into will do, built by walking `state` beside the skeleton (phase 1)."""

    def __init__(self, ck, strict: bool):
        self.ck, self.strict = ck, strict
        self.targets: dict[str, torch.Tensor] = {}  # key path -> the tensor read_into fills there
        self.actions: list[Callable[[], None]] = []  # phase 3, in tree order
        self.missing: list[str] = []  # the checkpoint's keys (tensors, plain values) `state` has no place for
        self.unknown: list[str] = []  # keys `state` names that the checkpoint does not have
        self._new: dict[tuple, torch.Tensor] = {}  # (stored tensor, device) -> its new tensor: aliases stay one

    # -- the caller's containers
    def into(self, target, node, key: str, depth: int):
        """Plan restoring skeleton `node` into `target`. Returns None where `target` is restored
        itself (a tensor filled, a container or object updated), else a function giving the value
        to store in its place once read."""
        if isinstance(target, torch.Tensor):
            if _kind(node) != "tensor":
                return self._conflict(key, "a tensor", node)
            self.targets[key] = target
            return None
        if is_stateful(target):
            self._stateful(target, node, key, depth)
            return None
        if isinstance(target, dict):
            if _kind(node) not in ("dict", "odict"):
                return self._conflict(key, "a dict", node)
            saved = dict(_items(node))
            for k, value in target.items():
                sub = _child_key(key, depth, k)
                if k not in saved:
                    self.unknown.append(sub)
                    continue
                put = self.into(value, saved[k], sub, depth + 1)
                if put is not None:
                    self.actions.append(lambda k=k, put=put: target.__setitem__(k, put()))
            for k, n in saved.items():
                if k not in target:
                    self._missing(n, _child_key(key, depth, k), depth + 1)
            return None
        if isinstance(target, list) or type(target) is tuple:
            if _kind(node) not in ("list", "tuple"):
                return self._conflict(key, f"a {type(target).__name__}", node)
            saved = _items(node)
            self.unknown.extend(_child_key(key, depth, i) for i in range(len(saved), len(target)))
            for i in range(len(target), len(saved)):
                self._missing(saved[i], _child_key(key, depth, i), depth + 1)
            puts = [self.into(target[i], saved[i], _child_key(key, depth, i), depth + 1)
                    for i in range(min(len(target), len(saved)))]
            if isinstance(target, list):
                for i, put in enumerate(puts):
                    if put is not None:
                        self.actions.append(lambda i=i, put=put: target.__setitem__(i, put()))
                return None
            if all(put is None for put in puts):
                return None
            return lambda: tuple(v if put is None else put() for v, put in zip(target, puts)) + target[len(puts):]
        # a plain value (or a NumPy value, bytes, anything else): replaced by what was saved there
        if node is None:
            self.unknown.append(key or "<root>")
            return None
        if not depth:  # nowhere to write it back to: nothing to read
            return self._conflict(key, "a plain value", node) if _kind(node) != "value" else None
        self._choose(node, None, key, depth, None)
        return lambda: rebuild(node, self._leaf, key, depth)

    def _missing(self, node, key: str, depth: int) -> None:
        """A saved subtree at `key` that the target has no place for: its tensors and plain values
        (or the key itself, an empty container's)."""
        self.missing.extend([p for p, _ in placements(node, key, depth, _LEAVES)] or [key])

    def _conflict(self, key: str, what: str, node) -> None:
        if node is None:
            self.unknown.append(key or "<root>")
        elif self.strict:
            raise StateMismatchError(f"{self.ck.path}: {key or '<root>'!r} is {what} in the target but "
                                     f"{_what(node)} in the checkpoint")
        return None

    # -- stateful objects
    def _stateful(self, obj, node, key: str, depth: int) -> None:
        if node is None:
            self.unknown.append(key or "<root>")
            return
        where = key or "<root>"
        if isinstance(obj, torch.Generator):
            if _kind(node) != "tensor":
                return self._conflict(key, "a torch.Generator", node)
            like = None
        else:
            try:
                like = obj.state_dict()
            except Exception as e:
                e.add_note(f"gdsckpt: raised by state_dict() of the {type(obj).__qualname__} at {where!r}, "
                           "called to restore into it")
                raise
        if isinstance(obj, torch.nn.Module):
            node = self._module_keys(obj, node, like, key, depth)
            if node is None:
                return
        home = _home(obj, like)
        if isinstance(obj, torch.optim.Optimizer):
            self._optimizer(obj, node, like, key, depth, home)
        else:
            self._choose(node, like, key, depth, home)
        strict = self.strict

        def apply():
            try:
                load_state(obj, rebuild(node, self._leaf, key, depth), strict=strict)
            except Exception as e:
                e.add_note(f"gdsckpt: raised by load_state_dict() of the {type(obj).__qualname__} at {where!r}; "
                           "the tensors were read, the objects before it in the state restored")
                raise
        self.actions.append(apply)

    def _module_keys(self, module, node, like, key: str, depth: int):
        """A module's saved keys against its own: under strict, any difference is a mismatch;
        else only the keys it has are read (load_state_dict(strict=False) ignores the others)."""
        if _kind(node) not in ("dict", "odict") or not isinstance(like, dict):
            return self._conflict(key, "an nn.Module", node)
        items = _items(node)
        saved = {k for k, _ in items}
        for k, n in items:
            if k not in like:
                self._missing(n, _child_key(key, depth, k), depth + 1)
        self.unknown.extend(_child_key(key, depth, k) for k in like if k not in saved)
        kept = [[k, n] for k, n in items if k in like]
        if len(kept) == len(items):
            return node
        body = {"items": kept}
        if _kind(node) == "odict" and "metadata" in node["odict"]:
            body["metadata"] = node["odict"]["metadata"]
        return {"odict": body}

    def _optimizer(self, opt, node, like, key: str, depth: int, home) -> None:
        """An optimizer's groups must hold as many parameters as the saved ones (load_state_dict's
        own check, made before anything is read); each parameter's saved state goes to that
        parameter's device."""
        saved = dict(_items(node)) if _kind(node) in ("dict", "odict") else {}
        groups = saved.get("param_groups")
        sizes = None
        if _kind(groups) == "list":
            sizes = []
            for g in _items(groups):
                params = dict(_items(g)).get("params") if _kind(g) in ("dict", "odict") else None
                sizes.append(len(_items(params)) if _kind(params) == "list" else None)
        here = [len(g["params"]) for g in opt.param_groups]
        if sizes != here:
            raise StateMismatchError(f"{self.ck.path}: the optimizer at {key or '<root>'!r} has parameter groups "
                                     f"of {here} parameters, the checkpoint's has {sizes}")
        devices = {}
        for g_like, g in zip(like["param_groups"], opt.param_groups):
            devices.update((pid, p.device) for pid, p in zip(g_like["params"], g["params"]))
        like_state = like.get("state", {})
        for k, n in _items(node):
            sub = _child_key(key, depth, k)
            if k == "state" and _kind(n) in ("dict", "odict"):
                for pid, s in _items(n):
                    self._choose(s, like_state.get(pid), _child_key(sub, depth + 1, pid), depth + 2,
                                 devices.get(pid, home))
            else:
                self._choose(n, like.get(k), sub, depth + 1, home)

    # -- the tensors of a saved subtree
    def _choose(self, node, like, key: str, depth: int, home: torch.device | None) -> None:
        """Give every placement under `node` its tensor: `like`'s tensor at the same place (filled
        in place), else a new one (on `home` where it was saved from a GPU; NumPy and bytes
        placements on the CPU)."""
        (kind, body), = node.items()
        if is_stateful(like) and not isinstance(like, torch.Generator):
            like = like.state_dict()  # an object inside the object's state: its own tensors, read in place
        if kind == "tensor":
            self.targets[key] = like if isinstance(like, torch.Tensor) else self._fresh(body, key, home)
        elif kind in TYPED:
            self.targets[key] = self._fresh(body, key, _CPU)
        elif kind in ("dict", "odict"):
            for k, n in _items(node):
                sub_like = like.get(k) if isinstance(like, dict) else None
                self._choose(n, sub_like, _child_key(key, depth, k), depth + 1, home)
        elif kind in ("list", "tuple"):
            for i, n in enumerate(body):
                sub_like = like[i] if isinstance(like, (list, tuple)) and i < len(like) else None
                self._choose(n, sub_like, _child_key(key, depth, i), depth + 1, home)

    def _fresh(self, index: int, key: str, home: torch.device | None) -> torch.Tensor:
        info = self.ck.info(key)
        if info["device"] == "cpu":
            dev = _CPU
        elif home is not None:
            dev = home
        else:  # saved from a GPU, for no object of ours: as load(device=None) puts it
            dev = torch.device("cuda") if torch.cuda.is_available() else _CPU
        t = self._new.get((index, dev))
        if t is None:
            t = self._new[(index, dev)] = torch.empty(info["shape"], dtype=BY_NAME[info["dtype"]], device=dev)
        return t

    def _leaf(self, index: int, key: str) -> torch.Tensor:
        return self.targets[key]


def _home(obj, like) -> torch.device | None:
    """Where a stateful object's tensors live: the device for new tensors of its saved state that
    were saved from a GPU (None: no tensor to go by)."""
    if isinstance(obj, torch.Generator):
        return _CPU  # get_state() / set_state() take a CPU tensor, whatever the generator's device
    if isinstance(obj, torch.nn.Module):
        t = next(chain(obj.parameters(), obj.buffers()), None)
    elif isinstance(obj, torch.optim.Optimizer):
        t = next((p for g in obj.param_groups for p in g["params"]), None)
    else:
        t = _first_tensor(like, 0)
    return None if t is None else t.device


def _first_tensor(obj, depth: int):
    if isinstance(obj, torch.Tensor):
        return obj
    if depth < 8:
        values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
        for v in values:
            t = _first_tensor(v, depth + 1)
            if t is not None:
                return t
    return None
