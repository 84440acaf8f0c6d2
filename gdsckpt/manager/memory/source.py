"""A committed memory copy (gdsckpt/manager/memory/tier.py) as the reader's ChunkSource
(gdsckpt/reading/sources.py): `gdsckpt.open(MemorySource(...))`, `load_into(...)`, as for a file.

The image in the slot is byte for byte a checkpoint file, so the reader validates its footer and
index and verifies every chunk's checksum as it does a file's; only the bytes come from shared
memory instead of the disk:

* on the CPU backend the chunk records are checked and decoded where they lie in the mapping
  (`SlotView`, a ring.MappedChunkFile): no copy, no second read;
* on the GPU backend the segment is read as the file it is, by KvikIO (`open_segment`): its
  threads pread into pinned bounce buffers and copy those to the device, so no byte crosses PCIe
  from pageable memory, and a new process neither maps nor page-locks the segment to read it
  (copies from the pageable mapping ran 7.5 GB/s on an H100 host, 53 from pinned memory).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gdsckpt.core.defaults import MEMORY_READ_THREADS
from gdsckpt.errors import CheckpointFormatError, GdsckptError
from .slot import Slot
from gdsckpt.engine.interfaces import Backend, ChunkFile
from gdsckpt.engine.ring import Completion


class MemorySource:
    """The image of `nbytes` at the start of `slot`; `label` names it in errors and stats."""

    io_threads = MEMORY_READ_THREADS  # KvikIO threads reading it into device memory (defaults.py)
    # The segment is in host memory (tmpfs), which GPUDirect Storage does not read: KvikIO's compat
    # mode, asked for by name, spares a new process cuFile's driver probe (gpu/io.py: 0.22 s).
    io = "compat"
    read_task_bytes = None  # KvikIO's: more, smaller reads of memory in parallel (defaults.py)

    def __init__(self, slot: Slot, nbytes: int, label: str):
        self.label, self.size, self._slot = label, nbytes, slot

    def pread(self, n: int, offset: int) -> bytes:
        n = max(0, min(n, self.size - offset))
        return self._slot.read(n, offset)

    def open_chunks(self, backend: Backend) -> ChunkFile:
        if backend.name == "gpu":
            return open_segment(self._slot, backend, self.label)
        return SlotView(self._slot, self.label)

    def child_file(self):
        raise ValueError(f"{self.label}: a memory copy is read in this process only (trusted=False decodes "
                         "files in a child process); the copy is this run's own")

    def close(self) -> None:
        pass  # the tier owns the slot


def open_segment(slot: Slot, backend: Backend, label: str) -> ChunkFile:
    """The backend's own ChunkFile on the slot's segment file: the very file this process holds
    open (/proc/self/fd), which a segment made anew under its name cannot replace."""
    proc = Path(f"/proc/self/fd/{slot.fd}")
    file = backend.open(proc if proc.exists() else slot.path, "r")
    try:
        mine, theirs = os.fstat(slot.fd), os.fstat(file.fd)
        if (mine.st_dev, mine.st_ino) != (theirs.st_dev, theirs.st_ino):
            raise CheckpointFormatError("the segment was replaced since it was opened", path=label)
    except BaseException:
        file.close()
        raise
    return file


class SlotView:
    """ring.MappedChunkFile over a slot's mapping (host memory: the CPU backend's): chunk records
    viewed in place; pread copies, for a caller that wants its own buffer."""

    fd = None

    def __init__(self, slot: Slot, label: str):
        self._slot, self._label = slot, label

    def view(self, nbytes: int, offset: int) -> torch.Tensor:
        return self._slot.tensor[offset:offset + nbytes]  # records lie in the mapping (the index may not)

    def pread(self, buf: torch.Tensor, nbytes: int, offset: int) -> Completion:
        src = self.view(nbytes, offset).numpy()
        buf.numpy()[:len(src)] = src  # numpy, not torch's copy_: see cpu_backend.py
        return Completion(lambda n=len(src): n)

    def pwrite(self, buf, nbytes: int, offset: int):
        raise GdsckptError(f"{self._label} is opened for reading")

    def close(self) -> None:
        pass


def check_copy(folder: Path, rec: dict, deep: bool) -> str:
    """"ok" or why not, for a commit record of `folder` (memory_tier.read_record) read without
    the tier's lock (the CLI): its segment ends in the committed footer (memory_folders.check_record)
    and its footer and index are valid; deep: every chunk checksum too."""
    from gdsckpt import api
    from .folders import check_record
    why = check_record(folder, rec)
    if why is None:
        slot = Slot(folder / rec["slot"])
        try:
            with api.open(MemorySource(slot, int(rec["bytes"]), f"memory copy in {folder / rec['slot']}")) as ck:
                if deep:
                    ck.verify()
        except (GdsckptError, OSError) as e:
            why = f"{type(e).__name__}: {e}"
        finally:
            slot.close()
        if why is not None and check_record(folder, rec) is not None:
            why = "dropped while being read"
    return "ok" if why is None else f"DAMAGED: {why}"
