"""Chunk I/O from device memory through KvikIO's CuFile: cuFile (GPUDirect Storage) where the
host has it, KvikIO's compat mode (POSIX through its pinned bounce buffers) where it does not.
The calls are the same in both modes, so a GDS host runs this code unchanged."""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

import kvikio
import kvikio.cufile_driver
import kvikio.defaults

from ..errors import GDSUnavailableError


# Chosen from bench/results/2026-11-22-h100-b/kvikio-sweep.json (H100 host, compat mode, virtio
# ext4): 4 threads, 4 MiB tasks and O_DIRECT gave the best cold restore (2.9 GB/s logical) and a
# save within the sweep's noise of the best. Over 8 saves interleaved with the disk probe
# (2026-11-22-h100-k/save-paths-8rounds.json) they were the steadiest, 81-99% of the disk's bound;
# 8 threads x 16 MiB tasks averaged a few points higher but swung between 56% and 126%.
DEFAULT_THREADS = 4
DEFAULT_DIRECT = True


@functools.cache
def gds_available() -> bool:
    try:
        return bool(kvikio.cufile_driver.get("is_gds_available"))
    except Exception:  # no libcufile at all
        return False


def io_settings(requested: str, io_threads: int | None, task_size: int | None):
    """(io path that will run, context manager applying the KvikIO settings for it)."""
    settings = {}
    if task_size:
        settings["task_size"] = task_size
    if "KVIKIO_AUTO_DIRECT_IO_WRITE" not in os.environ:  # a user's own KvikIO setting wins
        settings["auto_direct_io_write"] = DEFAULT_DIRECT
    if "KVIKIO_AUTO_DIRECT_IO_READ" not in os.environ:
        settings["auto_direct_io_read"] = DEFAULT_DIRECT
    gds = gds_available()
    if requested == "gds":
        if not gds:
            raise GDSUnavailableError(
                "io='gds' asked for GPUDirect Storage, but cuFile reports is_gds_available=False on this host "
                "(no nvidia-fs driver, or the file system does not support it). Use io='auto' to fall back to "
                "KvikIO's compat mode, which gdsckpt reports as io_path='compat'")
        settings["compat_mode"] = kvikio.CompatMode.OFF
        path = "gds"
    elif requested == "compat" or not gds:
        settings["compat_mode"] = kvikio.CompatMode.ON
        path = "compat"
    elif requested == "auto":
        path = "compat" if kvikio.defaults.is_compat_mode_preferred() else "gds"
    else:
        raise ValueError(f"io must be 'auto', 'gds' or 'compat', not {requested!r}")
    # KvikIO rebuilds its thread pool whenever num_threads changes, so the pool is resized only
    # when asked for a different size, and left at that size afterwards (not reverted per save).
    threads = io_threads or DEFAULT_THREADS
    if kvikio.defaults.get("num_threads") != threads:
        kvikio.defaults.set("num_threads", threads)
    changed = {k: v for k, v in settings.items() if kvikio.defaults.get(k) != v}
    return path, kvikio.defaults.set(changed) if changed else contextlib.nullcontext()


class _Once:
    """A KvikIO future whose result can be asked for more than once."""

    def __init__(self, fut):
        self._fut, self._result = fut, None

    def get(self) -> int:
        if self._fut is not None:
            self._result, self._fut = self._fut.get(), None
        return self._result


class DeviceFile:
    """A CuFile with the ring's interface; `fd` is for the small host-side writes and fsync.

    host_staging (compat mode only): copy each chunk into a pinned host buffer first and hand
    KvikIO the host buffer, instead of letting KvikIO bounce device memory through its own
    4 MiB buffers. The GDS path always hands CuFile the device buffer."""

    STAGING_BUFFERS = 4

    def __init__(self, path: Path, mode: str, as_cupy, task_size: int | None = None, host_staging: bool = False):
        if mode == "w":  # claim the name first: two writers never share a temporary
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        self._f = kvikio.CuFile(path, mode)
        self.fd = self._f.fileno()
        self._cp = as_cupy
        self._task = task_size
        self._staging = host_staging
        self._host = [None] * self.STAGING_BUFFERS
        self._pending = [None] * self.STAGING_BUFFERS
        self._next = 0

    @property
    def pinned_bytes(self) -> int:
        return sum(h.numel() for h in self._host if h is not None)

    def pwrite(self, buf, nbytes: int, offset: int):
        if not self._staging:
            return self._f.pwrite(self._cp(buf), nbytes, offset, self._task)
        import torch
        i = self._next % self.STAGING_BUFFERS
        self._next += 1
        if self._pending[i] is not None:  # the write that last used this buffer must be done
            self._pending[i].get()
        if self._host[i] is None or self._host[i].numel() < nbytes:
            self._host[i] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self._host[i][:nbytes].copy_(buf[:nbytes])  # pinned device-to-host: ~50 GB/s, waits for it
        self._pending[i] = _Once(self._f.pwrite(self._host[i].numpy(), nbytes, offset, self._task))
        return self._pending[i]

    def pread(self, buf, nbytes: int, offset: int):
        return self._f.pread(self._cp(buf), nbytes, offset, self._task)

    def close(self) -> None:
        for fut in self._pending:
            if fut is not None:
                try:
                    fut.get()
                except Exception:
                    pass  # the ring has already raised the first error
        if not self._f.closed:
            self._f.close()
