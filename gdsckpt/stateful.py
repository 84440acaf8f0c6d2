"""Stateful objects in the state: what is saved in their place, and how they are restored.

A Stateful, as torch.distributed.checkpoint defines it, has `state_dict()` and
`load_state_dict()`: nn.Module, optimizers, LR schedulers, torchdata's StatefulDataLoader, your
own classes. Wherever one sits in the state, `tree.flatten` saves its `state_dict()` in its place
(at the call, for save_async), and `restore.restore_into` reads that value back and hands it to
its `load_state_dict()`. A `torch.Generator` is restored the same way through get_state() and
set_state(), and `RNG()` is the process's global generators as one Stateful.
"""

from __future__ import annotations

import random
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
