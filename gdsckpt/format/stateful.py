"""Stateful objects in the state: what is saved in their place, and how they are restored.

A Stateful, as torch.distributed.checkpoint defines it, has `state_dict()` and
`load_state_dict()`: nn.Module, optimizers, LR schedulers, torchdata's StatefulDataLoader, your
own classes. Wherever one sits in the state, `tree.flatten` saves its `state_dict()` in its place
(at the call, for save_async), and `restore.restore_into` reads that value back and hands it to
its `load_state_dict()`. A `torch.Generator` is restored the same way through get_state() and
set_state(), and `RNG()` is the process's global generators as one Stateful.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import warnings
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Stateful(Protocol):
    """torch.distributed.checkpoint.stateful.Stateful's shape, without importing torch.distributed."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


def is_stateful(obj) -> bool:
    """Saved through its state: a Stateful (an instance, not a class) or a torch.Generator."""
    if isinstance(obj, torch.Generator):
        return True
    return (not isinstance(obj, type) and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)))


def state_of(obj):
    """What is saved in the place of a stateful object."""
    return obj.get_state() if isinstance(obj, torch.Generator) else obj.state_dict()


def load_state(obj, value, *, strict: bool) -> None:
    """Give a stateful object its restored state. strict reaches nn.Module.load_state_dict; other
    objects' load_state_dict decide for themselves (an optimizer checks its parameter groups)."""
    if isinstance(obj, torch.Generator):
        obj.set_state(value)
    elif isinstance(obj, torch.nn.Module):
        obj.load_state_dict(value, strict=strict)
    else:
        obj.load_state_dict(value)


# ---------------------------------------------------------------- an optimizer saved before its first step

# Hyperparameters of the optimizers that keep state (moments, buffers) once they step: the betas
# and eps of Adam and its kin (AdamW, NAdam, RAdam, Adamax, Adafactor), and Adagrad's eps, RMSprop's
# alpha, Adadelta's rho, Rprop's etas, ASGD's lambd; SGD's momentum where it is not 0. SGD without
# momentum keeps no state, and an optimizer of one's own with none of these may not either: their
# empty state is no sign of a missed step.
STATEFUL_HYPERPARAMETERS = ("betas", "eps", "alpha", "rho", "etas", "lambd")


def unstepped_parameters(state, param_groups) -> int:
    """How many parameters an optimizer (its `state` and `param_groups`, or its state_dict()'s)
    names while holding no state of them, where it would keep some once it steps (Adam's moments:
    STATEFUL_HYPERPARAMETERS); 0 if it holds state, names none, or would keep none."""
    if state or not isinstance(param_groups, (list, tuple)):
        return 0
    count, keeps_state = 0, False
    for group in param_groups:
        if not isinstance(group, dict):
            return 0
        params, momentum = group.get("params"), group.get("momentum")
        count += len(params) if isinstance(params, (list, tuple)) else 0
        keeps_state = (keeps_state or any(h in group for h in STATEFUL_HYPERPARAMETERS)
                       or (isinstance(momentum, (int, float)) and momentum != 0))
    return count if keeps_state else 0


_warned_unstepped = False  # the warning below: once a process


def warn_unstepped(state_dict: dict, key: str) -> None:
    """Warn, once a process, that the dict at `key` being saved is an optimizer's state_dict()
    without its moments (unstepped_parameters): taken before the optimizer's first step."""
    global _warned_unstepped
    if _warned_unstepped or type(state_dict.get("state")) is not dict:
        return
    count = unstepped_parameters(state_dict["state"], state_dict.get("param_groups"))
    if count:
        _warned_unstepped = True
        warnings.warn(
            f"gdsckpt: the optimizer state saved at {key or '<root>'!r} holds no moments: its param_groups name "
            f"{count} parameter(s) but its 'state' is empty, as before the optimizer's first step(). Unless this "
            "save is meant to precede training, the state_dict() was taken too early (build it at each save, or "
            "put the optimizer itself in the state); a restore from it starts the moments from zero. "
            "(Warned once a process.)", stacklevel=_first_caller_outside())


def _first_caller_outside() -> int:
    """The warnings stacklevel, from the function that calls this one, of the first frame outside
    gdsckpt (and contextlib, whose decorators wrap some of its functions): the caller's save."""
    package = sys.modules[__name__.partition(".")[0]]
    inside = (os.path.dirname(os.path.abspath(package.__file__)) + os.sep, contextlib.__file__)
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


class RNG:
    """The process's random number generators, as one Stateful to put in the state
    (`{"rng": gdsckpt.RNG(), ...}`): Python's `random`, NumPy's global generator (where NumPy is
    installed), torch's CPU generator and, once CUDA is initialised, every CUDA device's default
    generator. Restoring sets each of them to what it was at the save."""

    def state_dict(self) -> dict:
        state = {"python": random.getstate(), "torch": torch.get_rng_state()}
        np = _numpy()
        if np is not None:
            state["numpy"] = np.random.get_state()  # the legacy 5-tuple: ("MT19937", keys, pos, has_gauss, gauss)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict) -> None:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        if "numpy" in state:
            np = _numpy()
            if np is None:
                warnings.warn("gdsckpt.RNG: the checkpoint holds NumPy's generator state, but NumPy is not "
                              "installed here; it is not restored", stacklevel=2)
            else:
                np.random.set_state(state["numpy"])
        if "cuda" in state:
            saved = list(state["cuda"])
            here = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if len(saved) != here:
                warnings.warn(f"gdsckpt.RNG: the checkpoint holds {len(saved)} CUDA generator state(s) and this "
                              f"process sees {here} CUDA device(s); the first {min(len(saved), here)} are restored",
                              stacklevel=2)
            for i, s in enumerate(saved[:here]):
                torch.cuda.set_rng_state(s, i)

    def __repr__(self) -> str:
        return "gdsckpt.RNG()"


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


# ---------------------------------------------------------------- torch.distributed.checkpoint


def dcp_view(state: dict, *, strict: bool = True) -> dict:
    """`state` as torch.distributed.checkpoint takes it, for dcp.save, dcp.async_save and dcp.load.

    DCP calls state_dict() and load_state_dict() of the top-level values only, and loads into the
    tensors that state_dict() gives: a fresh optimizer gives none, so it would stay fresh. Here
    each top-level value that is, or holds, a stateful object becomes one Stateful (`_DcpTree`):
    modules through get_model_state_dict / set_model_state_dict, optimizers through
    get_optimizer_state_dict / set_optimizer_state_dict with the module in `state` whose
    parameters they optimize (they initialise a fresh optimizer's state, which is then loaded
    into, as torchtitan does), every other stateful object through its own state_dict() and
    load_state_dict(), and plain values written back into the dicts and lists that hold them.
    Other top-level values are passed as they are; DCP writes their plain values back into the
    view, and `dcp_write_back` copies them into `state`. strict reaches set_model_state_dict.

    torch's initialisation is a zero-gradient step at learning rate 0, taken only when the
    optimizer has no state and no parameter has a gradient: restore before the first backward.
    An optimizer saved before its first step is saved so initialised (its step counts 1)."""
    modules = _modules(state)
    view = DcpView()
    for k, v in state.items():
        key = rank_key(k) if isinstance(v, RNG) else k
        view[key] = _DcpTree(v, modules, strict, k) if _holds_stateful(v) else v
        if key != k:
            view.rank_keys[key] = k
    return view


class DcpView(dict):
    """dcp_view's dict; `rank_keys`: its keys of this rank's own state (rank_key) -> the state's."""

    def __init__(self):
        super().__init__()
        self.rank_keys: dict[str, str] = {}


def rank_key(key: str) -> str:
    """The view's key of a top-level `gdsckpt.RNG()`: of this rank under torch.distributed. DCP keeps
    one copy of a value every rank names alike, taking it for replicated, and every rank loads that
    copy; each rank's generators are its own."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return f"{key}@rank{dist.get_rank()}"
    return key


def dcp_write_back(state: dict, view: DcpView) -> None:
    """After dcp.load(view): the top-level values DCP replaced in the view, and those a `_DcpTree`
    rebuilt (a tuple, which cannot be written back into), into `state`."""
    for k, v in view.items():
        k = view.rank_keys.get(k, k)
        v = v.value if isinstance(v, _DcpTree) else v
        if state.get(k) is not v:
            state[k] = v


class _DcpTree:
    """One top-level value of the state that is, or holds, stateful objects, as a Stateful for DCP."""

    def __init__(self, value, modules: list, strict: bool, key: str):
        self.value, self._modules, self._strict, self._key = value, modules, strict, key
        self.left_as_is = False  # a load planned nothing for it (dcp.planner.RankStateLoadPlanner)

    def state_dict(self):
        return self._state(self.value, self._key)

    def load_state_dict(self, loaded) -> None:
        if self.left_as_is:
            return
        new = self._restore(self.value, loaded, self._key)
        if new is not self._KEEP:  # a tuple, rebuilt with its restored plain values: for dcp_write_back
            self.value = new

    def _state(self, v, key: str):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
        if isinstance(v, torch.nn.Module):
            return get_model_state_dict(v)
        if isinstance(v, torch.optim.Optimizer):
            return get_optimizer_state_dict(_module_of(v, self._modules, key), v)
        if is_stateful(v):
            return self._state(state_of(v), key)
        if isinstance(v, dict):
            return {k: self._state(x, f"{key}.{k}") for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(self._state(x, f"{key}.{i}") for i, x in enumerate(v))
        return v

    _KEEP = object()

    def _restore(self, target, loaded, key: str):
        """Restore `loaded` (what DCP read into `_state(target)`) into `target`; the value to put
        in its place, or _KEEP where `target` itself was restored (tensors DCP filled in place)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, set_model_state_dict, set_optimizer_state_dict)
        if isinstance(target, torch.nn.Module):
            set_model_state_dict(target, loaded, options=StateDictOptions(strict=self._strict))
        elif isinstance(target, torch.optim.Optimizer):
            set_optimizer_state_dict(_module_of(target, self._modules, key), target, loaded)
        elif is_stateful(target):
            load_state(target, loaded, strict=self._strict)
        elif isinstance(target, dict):
            for k, x in target.items():
                if k in loaded:
                    new = self._restore(x, loaded[k], f"{key}.{k}")
                    if new is not self._KEEP:
                        target[k] = new
        elif isinstance(target, list):
            for i, x in enumerate(target[:len(loaded)]):
                new = self._restore(x, loaded[i], f"{key}.{i}")
                if new is not self._KEEP:
                    target[i] = new
        elif isinstance(target, tuple):
            return tuple(x if new is self._KEEP else new
                         for x, new in ((x, self._restore(x, y, f"{key}.{i}"))
                                        for i, (x, y) in enumerate(zip(target, loaded))))
        elif not isinstance(target, torch.Tensor):
            return loaded
        return self._KEEP


def _holds_stateful(v, depth: int = 0) -> bool:
    if is_stateful(v):
        return True
    if depth < 64 and isinstance(v, (dict, list, tuple)):
        return any(_holds_stateful(x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return False


def _modules(v, depth: int = 0) -> list:
    """Every nn.Module in the state's containers (where an optimizer's module is looked for)."""
    if isinstance(v, torch.nn.Module):
        return [v]
    if depth < 64 and isinstance(v, (dict, list, tuple)):
        return [m for x in (v.values() if isinstance(v, dict) else v) for m in _modules(x, depth + 1)]
    return []


def _module_of(opt, modules: list, key: str):
    """The first module of the state whose parameters include all of `opt`'s: DCP's optimizer
    state dicts name each parameter's state by its name in that module."""
    from gdsckpt.errors import UnsupportedStateError
    wanted = {id(p) for g in opt.param_groups for p in g["params"]}
    for m in modules:
        if wanted <= {id(p) for p in m.parameters()}:
            return m
    raise UnsupportedStateError(
        f"the optimizer at {key!r}: under torch.distributed the state must also hold the nn.Module whose "
        "parameters it optimizes (DCP names optimizer state by parameter name), e.g. "
        "{'model': model, 'optim': opt}")
