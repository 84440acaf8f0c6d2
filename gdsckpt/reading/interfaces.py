"""The reading side's interface: `ChunkSource`, a checkpoint opened for reading, as the reader
sees it (a local file, a store object, a memory copy: gdsckpt/reading/sources.py and
gdsckpt/manager/memory/source.py implement it).

The call order of one read (gdsckpt/reading/reader.py):

    source = open_source(locate(path))         # or a ChunkSource the caller made (a memory copy)
    source.pread(footer), source.pread(index)  # the footer, then the index it locates
    file = source.open_chunks(backend)         # the chunk records, through the engine's ring
    ... the ring's preads on `file` ...
    source.child_file()                        # only for trusted=False: a child decodes
    source.close()
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gdsckpt.engine.interfaces import Backend, ChunkFile


@dataclass(frozen=True)
class ChildFile:
    """A local checkpoint as a child process opens it: `path` names the descriptor `fd` that the
    child inherits (/proc/self/fd/N: the very file the parent opened, which a rename over its
    path cannot redirect), or the file's path once the parent has closed it (`fd` None).
    `identity` (st_dev, st_ino) lets the child check that it opened the parent's file."""

    path: str
    fd: int | None
    identity: tuple[int, int]


class ChunkSource(Protocol):
    """A checkpoint opened for reading, as the reader sees it."""

    label: Path | str  # names the checkpoint in errors and stats: the user's path, or the URL
    size: int  # bytes
    io_threads: int | None  # the I/O workers that suit it where the caller names none; None: the backend's
    io: str  # the I/O path that suits it where the caller asks for "auto" (backend.IO_CHOICES)
    read_task_bytes: int | None  # KvikIO's task size that suits it (defaults.py); None: KvikIO's

    def pread(self, n: int, offset: int) -> bytes:
        """`n` bytes at `offset` of the checkpoint that was opened (fewer only past its end)."""

    def open_chunks(self, backend: Backend) -> ChunkFile:
        """A ChunkFile on the same bytes, reading into `backend`'s buffers (the ring's)."""

    def child_file(self) -> ChildFile:
        """The checkpoint as a child process can open it; a ValueError where it cannot."""

    def close(self) -> None: ...
