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

from gdsckpt.core.defaults import KVIKIO_DIRECT_IO, KVIKIO_THREADS
from gdsckpt.errors import GDSUnavailableError
from gdsckpt.engine.ring import Completion


@functools.cache
def gds_available() -> bool:
    try:
        return bool(kvikio.cufile_driver.get("is_gds_available"))
    except Exception:  # no libcufile at all
        return False


_DIRECT_ENV = ("KVIKIO_AUTO_DIRECT_IO_WRITE", "KVIKIO_AUTO_DIRECT_IO_READ")


def set_direct_io(enabled: bool) -> None:
    """O_DIRECT on or off from now on, as if the user had set KvikIO's own variables (which win)."""
    for name in _DIRECT_ENV:
        os.environ[name] = str(int(enabled))
    kvikio.defaults.set({"auto_direct_io_write": enabled, "auto_direct_io_read": enabled})


def io_path(requested: str) -> str:
    """The path KvikIO's reads and writes take here with io=`requested`: "gds" or "compat"."""
    # The GDS probe opens cuFile's driver: 0.22 s the first time in a process on the H100 host, so
    # it runs only where the answer matters (io="compat" never asks: a memory copy's restore).
    if requested == "gds":
        if not gds_available():
            raise GDSUnavailableError(
                "io='gds' asked for GPUDirect Storage, but cuFile reports is_gds_available=False on this host "
                "(no nvidia-fs driver, or the file system does not support it). Use io='auto' to fall back to "
                "KvikIO's compat mode, which gdsckpt reports as io_path='compat'")
        return "gds"
    if requested == "compat" or (requested == "auto" and not gds_available()):
        return "compat"
    if requested == "auto":
        return "compat" if kvikio.defaults.is_compat_mode_preferred() else "gds"
    raise ValueError(f"io must be 'auto', 'gds' or 'compat', not {requested!r}")


def io_settings(requested: str, io_threads: int | None, read_task_bytes: int | None = None):
    """(io path that will run, context manager applying the KvikIO settings for it).
    read_task_bytes: KvikIO's task and bounce buffer size for reading a file (None: KvikIO's)."""
    settings = {}
    if _DIRECT_ENV[0] not in os.environ:  # a user's own KvikIO setting wins
        settings["auto_direct_io_write"] = KVIKIO_DIRECT_IO
    if _DIRECT_ENV[1] not in os.environ:
        settings["auto_direct_io_read"] = KVIKIO_DIRECT_IO
    if read_task_bytes:
        for key in ("task_size", "bounce_buffer_size"):
            if f"KVIKIO_{key.upper()}" not in os.environ:
                settings[key] = read_task_bytes
    path = io_path(requested)
    if requested != "auto" or not gds_available():  # else KvikIO's own choice, as io_path reports it
        settings["compat_mode"] = kvikio.CompatMode.OFF if path == "gds" else kvikio.CompatMode.ON
    # KvikIO rebuilds its thread pool whenever num_threads changes, so the pool is resized only
    # when asked for a different size, and left at that size afterwards (not reverted per save).
    threads = io_threads or KVIKIO_THREADS
    if kvikio.defaults.get("num_threads") != threads:
        kvikio.defaults.set("num_threads", threads)
    changed = {k: v for k, v in settings.items() if kvikio.defaults.get(k) != v}
    return path, kvikio.defaults.set(changed) if changed else contextlib.nullcontext()


class DeviceFile:
    """A KvikIO CuFile with the ring's ChunkFile interface; `fd` is for the small host-side
    writes and fsync. The GDS path and compat mode both hand CuFile the device buffer.
    `ready()` waits for the pipeline's stream: KvikIO reads device memory outside stream order,
    so a record is written only once the work that made it has run."""

    def __init__(self, path: Path, mode: str, as_cupy, ready):
        if mode == "w":  # claim the name first: two writers never share a temporary
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # less the umask
        self._f = kvikio.CuFile(path, mode)
        self.fd = self._f.fileno()
        self._cp, self._ready = as_cupy, ready

    def pwrite(self, buf, nbytes: int, offset: int) -> Completion:
        self._ready()
        return Completion(self._f.pwrite(self._cp(buf), nbytes, offset).get)

    def pread(self, buf, nbytes: int, offset: int) -> Completion:
        return Completion(self._f.pread(self._cp(buf), nbytes, offset).get)

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
