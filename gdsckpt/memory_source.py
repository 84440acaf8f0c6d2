"""A committed memory copy (gdsckpt/memory_tier.py) as the reader's ChunkSource
(gdsckpt/sources.py): `gdsckpt.open(MemorySource(...))`, `load_into(...)`, as for a file.

The image in the slot is byte for byte a checkpoint file, so the reader validates its footer and
index and verifies every chunk's checksum as it does a file's; only the bytes come from the
mapping instead of the disk. On the GPU backend each chunk record is copied host-to-device on a
side stream (asynchronous where the slot is page-locked in this process, as in the process that
wrote it; from pageable memory otherwise), straight into the ring's device buffer.
"""

from __future__ import annotations

import torch

from pathlib import Path

from .device_copy import side_stream
from .errors import GdsckptError
from .memory_slot import Slot
from .ring import Backend, ChunkFile, Completion


class MemorySource:
    """The image of `nbytes` at the start of `slot`; `label` names it in errors and stats."""

    def __init__(self, slot: Slot, nbytes: int, label: str):
        self.label, self.size, self._slot = label, nbytes, slot

    def pread(self, n: int, offset: int) -> bytes:
        n = max(0, min(n, self.size - offset))
        return self._slot.read(n, offset)

    def open_chunks(self, backend: Backend) -> ChunkFile:
        return SlotReader(self._slot, self.label)

    def child_file(self):
        raise ValueError(f"{self.label}: a memory copy is read in this process only (trusted=False decodes "
                         "files in a child process); the copy is this run's own")

    def close(self) -> None:
        pass  # the tier owns the slot


class SlotReader:
    """ring.ChunkFile over a slot's mapping: chunk records copied into the ring's buffers."""

    fd = None

    def __init__(self, slot: Slot, label: str):
        self._slot, self._label = slot, label

    def pread(self, buf: torch.Tensor, nbytes: int, offset: int) -> Completion:
        src = self._slot.tensor[offset:offset + nbytes]  # records lie in the mapping (the index may not)
        n = src.numel()
        if buf.is_cuda:
            stream = side_stream("copy-in", buf.device)
            stream.wait_stream(torch.cuda.current_stream(buf.device))  # the ring's work on `buf` first
            with torch.cuda.stream(stream):
                buf[:n].copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)

            def wait() -> int:
                done.synchronize()
                return n
            return Completion(wait)
        buf[:n].copy_(src)
        return Completion(lambda: n)

    def pwrite(self, buf, nbytes: int, offset: int):
        raise GdsckptError(f"{self._label} is opened for reading")

    def close(self) -> None:
        pass


def check_copy(folder: Path, rec: dict, deep: bool) -> str:
    """"ok" or why not, for a commit record of `folder` (memory_tier.read_record) read without
    the tier's lock (the CLI): its segment ends in the committed footer (memory_tier.check_record)
    and its footer and index are valid; deep: every chunk checksum too."""
    from . import api
    from .memory_tier import check_record
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
