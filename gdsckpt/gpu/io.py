"""Chunk I/O from device memory through KvikIO's CuFile: cuFile (GPUDirect Storage) where the
host has it, KvikIO's compat mode (POSIX through its pinned bounce buffers) where it does not.
The calls are the same in both modes, so a GDS host runs this code unchanged."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import kvikio
import kvikio.cufile_driver
import kvikio.defaults

from ..errors import GDSUnavailableError


# Chosen from bench/results/2026-11-22-h100-b/kvikio-sweep.json (H100 host, compat mode, virtio
# ext4): 4 threads, 4 MiB tasks and O_DIRECT gave the best cold restore (2.9 GB/s logical) and a
# save within the sweep's noise of the best; 8 threads were slower on both.
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
    settings = {"num_threads": io_threads or DEFAULT_THREADS}
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
    return path, kvikio.defaults.set(settings)


class DeviceFile:
    """A CuFile with the ring's interface; `fd` is for the small host-side writes and fsync."""

    def __init__(self, path: Path, mode: str, as_cupy, task_size: int | None = None):
        if mode == "w":  # claim the name first: two writers never share a temporary
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        self._f = kvikio.CuFile(path, mode)
        self.fd = self._f.fileno()
        self._cp = as_cupy
        self._task = task_size

    def pwrite(self, buf, nbytes: int, offset: int):
        return self._f.pwrite(self._cp(buf), nbytes, offset, self._task)

    def pread(self, buf, nbytes: int, offset: int):
        return self._f.pread(self._cp(buf), nbytes, offset, self._task)

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
