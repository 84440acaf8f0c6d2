"""Which backend runs a save or restore. The one place that probes the GPU stack: the GPU
backend (gdsckpt/engine/gpu/) is imported only when CUDA, nvCOMP and KvikIO are all usable, so
`import gdsckpt` works with no CUDA driver."""

from __future__ import annotations

import functools

import torch

from .cpu_backend import CpuBackend
from gdsckpt.errors import BackendUnavailableError, GDSUnavailableError

__all__ = ["CpuBackend", "IO_CHOICES", "check_gds", "check_io", "choose", "gpu_status", "kvikio_settings",
           "gpu_io_path", "make_backend", "nvcomp_version", "set_direct_io"]

IO_CHOICES = ("auto", "gds", "compat")


@functools.cache
def gpu_status() -> tuple[bool, str]:
    """(usable, why not). Cached: probing CUDA, nvCOMP and KvikIO costs time."""
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    try:
        from .gpu import backend as _  # noqa: F401
    except Exception as e:  # missing wheels or a broken CUDA install: say which
        return False, f"GPU modules failed to import ({type(e).__name__}: {e}); install gdsckpt[cu12] or [cu13]"
    return True, ""


def choose(wants_gpu: bool, backend: str | None) -> str:
    """"cpu" or "gpu": `backend` as asked ("auto"/None: the GPU where the data wants it and it is usable)."""
    if backend in ("cpu", "gpu"):
        return backend
    if backend not in (None, "auto"):
        raise ValueError(f"backend must be 'auto', 'gpu' or 'cpu', not {backend!r}")
    return "gpu" if wants_gpu and gpu_status()[0] else "cpu"


def check_io(io, io_threads) -> None:
    """A save's or a read's io= and io_threads= checked before anything runs; else a ValueError."""
    if io not in IO_CHOICES:
        raise ValueError(f"io must be one of {', '.join(map(repr, IO_CHOICES))}, not {io!r}")
    if io_threads is not None and (not isinstance(io_threads, int) or isinstance(io_threads, bool) or io_threads < 1):
        raise ValueError(f"io_threads must be a positive int or None, not {io_threads!r}")


def check_gds(io: str, kind: str, op: str) -> None:
    """io="gds" is a demand: where GPUDirect Storage cannot run, an error on every backend. The CPU
    backend moves host memory with POSIX I/O, so it never can (the GPU backend checks cuFile)."""
    if io == "gds" and kind == "cpu":
        raise GDSUnavailableError(
            f"io='gds' asked for GPUDirect Storage, but this {op} runs on the CPU backend (host tensors, "
            "backend='cpu', or no usable GPU), which reads and writes with POSIX I/O. Use io='auto', or "
            "backend='gpu' on a host whose cuFile has GDS")


def make_backend(kind: str, *, io: str = "auto", io_threads: int | None = None, read_task_bytes: int | None = None):
    """kind: "gpu" or "cpu". io: "auto", "gds" or "compat" (GPU only). io_threads: I/O workers.
    read_task_bytes: KvikIO's task and bounce buffer for a read (GPU only; None: KvikIO's)."""
    if kind == "cpu":
        return CpuBackend(io_threads) if io_threads else CpuBackend()
    ok, why = gpu_status()
    if not ok:
        raise BackendUnavailableError(f"the GPU backend is not available: {why}")
    from .gpu.backend import GpuBackend
    return GpuBackend(io=io, io_threads=io_threads, read_task_bytes=read_task_bytes)


def gpu_io_path(io: str) -> str | None:
    """The path the GPU backend's file I/O takes with io=`io` ("gds" or "compat"); None where there
    is no usable GPU. io="gds" where cuFile has no GDS: GDSUnavailableError, as make_backend."""
    if not gpu_status()[0]:
        return None
    from .gpu.io import io_path
    return io_path(io)


def nvcomp_version() -> str | None:
    """The nvCOMP this process would decode with; None where there is no usable GPU."""
    if not gpu_status()[0]:
        return None
    from .gpu.codecs import nvcomp_version as version
    return version()


def set_direct_io(enabled: bool) -> None:
    """Make KvikIO open files with O_DIRECT (or not) from now on; a no-op with no usable GPU.
    gdsckpt then leaves the setting alone, as it does for KVIKIO_AUTO_DIRECT_IO_* set by the user."""
    if gpu_status()[0]:
        from .gpu.io import set_direct_io as set_it
        set_it(enabled)


def kvikio_settings(io: str = "auto", io_threads: int | None = None):
    """(io path, context manager applying gdsckpt's KvikIO settings), for code that does its own
    KvikIO I/O next to gdsckpt's (the bench's raw-KvikIO baseline): like for like."""
    ok, why = gpu_status()
    if not ok:
        raise BackendUnavailableError(f"the GPU backend is not available: {why}")
    from .gpu.io import io_settings
    return io_settings(io, io_threads)
