"""Bench targets with storage removed. They take the ring's writes and complete them at once
(`null`), or after copying the compressed chunk into a pinned host ring (`null-d2h`: the leg
KvikIO's compat mode needs, the stand-in for storage faster than this host's disks)."""

from __future__ import annotations


class _Done:
    def __init__(self, n: int):
        self._n = n

    def get(self) -> int:
        return self._n


class NullSink:
    fd = None

    def __init__(self, backend):
        self.pinned_bytes = 0

    def pwrite(self, buf, nbytes: int, offset: int):
        return _Done(nbytes)

    def close(self):
        pass


class _CopyDone:
    def __init__(self, event, n: int):
        self._event, self._n = event, n

    def get(self) -> int:
        self._event.synchronize()
        return self._n


class HostCopySink:
    """Device-to-host copies on their own stream into a ring of pinned buffers, one per
    outstanding write, so they overlap compression of the next chunk as a file write would."""

    fd = None

    def __init__(self, backend, slots: int = 4, slot_bytes: int = 128 << 20):
        import torch
        self._torch = torch
        self._stream = torch.cuda.Stream(backend.device)
        self._slots = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        self._next = 0
        self.pinned_bytes = slots * slot_bytes

    def pwrite(self, buf, nbytes: int, offset: int):
        torch = self._torch
        dst = self._slots[self._next % len(self._slots)]
        self._next += 1
        if nbytes > dst.numel():
            raise ValueError(f"chunk of {nbytes} bytes exceeds the pinned slot of {dst.numel()}")
        self._stream.wait_stream(torch.cuda.current_stream(buf.device))
        with torch.cuda.stream(self._stream):
            dst[:nbytes].copy_(buf[:nbytes], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._stream)
        return _CopyDone(ev, nbytes)

    def close(self):
        pass
