"""A non-tensor value as DCP stores it (a BYTE_IO item: torch.save's pickle of the value), loaded
without running anything: torch.load(weights_only=True), with NumPy's arrays and scalars allowed.

One check, made on both sides: the reader (dcp/reader.py) loads a byte item this way before DCP's
planner unpickles it, so the writer refuses at save a value this cannot load (an Enum, a Path, a
user's class), naming it, instead of writing a step that every restore would refuse as damaged.
"""

from __future__ import annotations

import contextlib
import functools
import io
import threading

import torch

from ..errors import UnsupportedStateError

__all__ = ["RefusedPickle", "check_savable", "load_plain"]


class RefusedPickle(ValueError):
    """torch.load(weights_only=True) refused the pickle; the message names what it refused."""


def load_plain(data: bytes):
    """The value that `data` (a torch.save pickle) holds, built from plain values, containers,
    tensors and NumPy's arrays and scalars only; else RefusedPickle, nothing of it run."""
    try:
        with _numpy_allowed():
            return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 - a refused global, or whatever a damaged pickle raises
        raise RefusedPickle(_why(e)) from None


def check_savable(data: bytes, fqn: str) -> None:
    """A value about to be saved as a byte item, checked as a restore will load it: an
    UnsupportedStateError naming `fqn` where it could not be. Cached by the pickle's bytes: a
    training run saves the same few values (an LR scheduler's, an optimizer's param_groups')
    at every step."""
    data = bytes(data)
    why = _known_refusal(data) if len(data) <= _CACHED_BYTES else _refusal(data)
    if why is not None:
        raise UnsupportedStateError(
            f"the non-tensor value {fqn!r} cannot be restored: torch.load(weights_only=True), which a restore "
            f"loads it with (loading never unpickles), refuses its pickle ({why}); save it as plain values "
            "(int, float, str, bool, None, lists, dicts, tensors, NumPy arrays), e.g. an Enum as its .value")


def _refusal(data: bytes) -> str | None:
    """Why a restore could not load `data`; None where it could."""
    try:
        load_plain(data)
    except RefusedPickle as e:
        return str(e)
    return None


_CACHED_BYTES = 64 << 10  # larger pickles (a data loader's state, say) are checked anew, not kept
_known_refusal = functools.lru_cache(maxsize=1024)(_refusal)


def _why(e: Exception) -> str:
    """The line of torch's weights-only refusal that names what was refused (its first line otherwise)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    named = next((ln for ln in lines if ln.startswith("WeightsUnpickler error:")), lines[0] if lines else "")
    return f"{type(e).__name__}: {named}"


_NUMPY_LOCK = threading.Lock()


@contextlib.contextmanager
def _numpy_allowed():
    """While it lasts, torch.load(weights_only=True) also builds NumPy's arrays, scalars and dtypes:
    data, no code (an object array's items come through the same allowlist), and RNG() and users'
    own Statefuls hold them (NumPy's generator state is a tuple with an array). torch keeps its
    allowlist process-wide: those of them the process has not allowed itself are added, then
    removed."""
    with _NUMPY_LOCK:
        allowed = torch.serialization.get_safe_globals()
        with torch.serialization.safe_globals([g for g in _numpy_globals() if g not in allowed]):
            yield


@functools.cache
def _numpy_globals() -> tuple:
    """What torch.save's pickles of NumPy values name (NumPy 1's module path and NumPy 2's), and
    the dtype classes that some NumPy versions pickle dtypes as."""
    try:
        import numpy as np
    except ImportError:
        return ()
    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    names = [(getattr(multiarray, f), f"{module}.{f}") for f in ("_reconstruct", "scalar")
             for module in ("numpy.core.multiarray", "numpy._core.multiarray")]
    dtypes = getattr(np, "dtypes", None)
    classes = [c for n, c in vars(dtypes).items() if n.endswith("DType") and isinstance(c, type)] if dtypes else []
    return tuple(names + [np.ndarray, np.dtype] + classes)
