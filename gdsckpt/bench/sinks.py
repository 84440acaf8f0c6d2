"""Bench targets with storage removed. They take the ring's writes and complete them at once
(`null`), or after copying the compressed chunk into a pinned host ring (`null-d2h`: the leg
KvikIO's compat mode needs, the stand-in for storage faster than this host's disks)."""

from __future__ import annotations

from gdsckpt.engine.ring import Completion


class NullSink:
    fd = None

    pinned_bytes = 0

    def pwrite(self, buf, nbytes: int, offset: int) -> Completion:
        return Completion(lambda: nbytes)

    def close(self):
        pass


class HostCopySink:
    """Device-to-host copies on their own stream into a ring of pinned buffers, so that they
    overlap compression of the next chunk as a file write would. Buffers are sized on first use
    and kept, so build one sink per job and reuse it across loops."""

    fd = None

    def __init__(self, device, slots: int = 4):
        import torch
        self._torch = torch
        self._stream = torch.cuda.Stream(device)
        self._slots = [None] * slots
        self._next = 0

    @property
    def pinned_bytes(self) -> int:
        return sum(s.numel() for s in self._slots if s is not None)

    def pwrite(self, buf, nbytes: int, offset: int) -> Completion:
        torch = self._torch
        i = self._next % len(self._slots)
        self._next += 1
        if self._slots[i] is None or self._slots[i].numel() < nbytes:
            self._stream.synchronize()
            self._slots[i] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(buf.device))
        with torch.cuda.stream(self._stream):
            self._slots[i][:nbytes].copy_(buf[:nbytes], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._stream)

        def copied() -> int:
            ev.synchronize()
            return nbytes
        return Completion(copied)

    def close(self):
        pass
