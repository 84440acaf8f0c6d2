"""Copies of tensors on their own device, off the training stream: the side streams a snapshot
uses and `snapshot_tensors`, the full device copy behind save_async(snapshot="device"), the
buffers an overlapped snapshot copies, and GdsckptWriter's device staging. With them, the
small CUDA-device helpers the savers share."""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict

import torch

from gdsckpt.core import defaults
from .pinned_pool import pool_for

__all__ = ["side_stream", "snapshot_tensors", "block_bytes", "copy_first", "may_copy_first", "outside_cache", "cuda_device_of",
           "on_device", "settle"]

_streams: dict[tuple[str, int], torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def side_stream(purpose: str, device: torch.device) -> torch.cuda.Stream:
    """One CUDA stream per purpose ("copy": device-to-host copies; "snapshot": save_async's
    device copies and fences) and GPU, made once: creating streams per save would leak them."""
    with _streams_lock:
        s = _streams.get((purpose, device.index))
        if s is None:
            s = _streams[(purpose, device.index)] = torch.cuda.Stream(device=device)
        return s


def snapshot_tensors(tensors: list, block=None) -> list:
    """Contiguous private copies of `tensors`, each on the tensor's own device; complete on return.

    CUDA tensors are copied on a per-GPU side stream that waits for the GPU's current stream, in
    one torch._foreach_copy_ per GPU (a Python copy_ per tensor cost ~25 us of the call each on
    the H100's host); the side streams are synchronized before returning. block(nbytes, device,
    stream): one uint8 tensor per GPU that holds all its copies (views of it, each 256-byte
    aligned), where None allocates each copy from torch's cache."""
    out: list = [None] * len(tensors)
    by_gpu: dict[int, list[int]] = defaultdict(list)
    used = []
    with torch.no_grad():  # copies of parameters that need no grad, without a detach() each
        for i, t in enumerate(tensors):
            if t.is_cuda:
                by_gpu[t.get_device()].append(i)
            else:
                out[i] = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
        for index, idx in by_gpu.items():
            dev = torch.device("cuda", index)
            srcs = [tensors[i] for i in idx]
            side = side_stream("snapshot", dev)
            with torch.cuda.device(dev):
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    total = block_bytes(srcs) if block is not None else 0
                    copies = _in_block(srcs, block(total, dev, side)) if total else [
                        torch.empty(s.shape, dtype=s.dtype, device=dev) for s in srcs]
                    torch._foreach_copy_(copies, srcs, non_blocking=True)
            for i, c in zip(idx, copies):
                out[i] = c
            used.append(side)
    for side in used:
        side.synchronize()
    return out


def _in_block(tensors: list, flat: torch.Tensor) -> list:
    """Views of `flat` (uint8) shaped as `tensors`, one after another, each 256-byte aligned:
    sliced from one view of the block per dtype."""
    typed: dict = {}
    out, offset = [], 0
    for t in tensors:
        dtype = t.dtype
        view = typed.get(dtype)
        if view is None:
            view = typed[dtype] = flat.view(dtype)
        start = offset // t.itemsize
        out.append(view[start:start + t.numel()].view(t.shape))
        offset += _aligned(t.nbytes)
    return out


_BLOCK_ALIGN = 256  # what CUDA aligns its allocations to: a view of any dtype may start there


def _aligned(n: int) -> int:
    return -(-n // _BLOCK_ALIGN) * _BLOCK_ALIGN


def block_bytes(tensors) -> int:
    """The bytes of one block that holds copies of `tensors` (snapshot_tensors' `block`)."""
    return sum(_aligned(t.nbytes) for t in tensors)


def outside_cache(nbytes: int, device: torch.device, stream: torch.cuda.Stream) -> torch.Tensor:
    """snapshot_tensors' `block` from CUDA's stream-ordered allocator, not torch's cache: it goes
    back to the device with the last copy in it (gpu/device_block.py)."""
    from .gpu.device_block import stream_ordered
    return stream_ordered(nbytes, device, stream)


def copy_first(tensors: list) -> int | None:
    """The GPU of a save's tensors where that save should copy them there first and take its
    compressed snapshot from the copy off the call (save_async, GdsckptWriter's staging): its
    host pool is empty with nothing reserving it (the process's first save, or the first after
    release_pools), and one block of copies fits in defaults.FIRST_SAVE_COPY_FREE_FRACTION of the
    GPU's free memory. None otherwise, and for tensors on several GPUs. A steady save asks only
    its first GPU tensor and the pool (every save asks, on the training's critical path)."""
    gpu = cuda_device_of(tensors) if defaults.FIRST_SAVE_COPY_FREE_FRACTION > 0 else None
    if gpu is None:
        return None
    if not _pool_empty(gpu):
        return None
    on_gpu = [t for t in tensors if t.is_cuda]
    if any(t.device.index != gpu for t in on_gpu):
        return None
    free, _ = torch.cuda.mem_get_info(gpu)
    return gpu if block_bytes(on_gpu) <= free * defaults.FIRST_SAVE_COPY_FREE_FRACTION else None


def may_copy_first() -> bool:
    """Whether copy_first could answer a GPU for a state on the current device (the copy on, that
    device's pool empty): spares a steady DCP staging the walk over its state dict that
    copy_first's list of tensors costs (~1 ms for 1,200 tensors)."""
    if defaults.FIRST_SAVE_COPY_FREE_FRACTION <= 0 or not torch.cuda.is_available():
        return False
    return _pool_empty(torch.cuda.current_device())


def _pool_empty(gpu: int) -> bool:
    """GPU `gpu`'s host pool holds nothing and nothing is growing it (no reservation running)."""
    pool = pool_for(torch.device("cuda", gpu))
    return not (pool.capacity or pool.growing)


def cuda_device_of(tensors) -> int | None:
    """The CUDA device index of the first CUDA tensor of `tensors`; None if none is on a GPU."""
    for t in tensors:
        if t.is_cuda:
            return t.device.index if t.device.index is not None else torch.cuda.current_device()
    return None


def on_device(index: int | None):
    """Make CUDA device `index` current (gdsckpt's GPU backend works on the current one, and a new
    thread's current device is 0, not the caller's); None: nothing to do."""
    return torch.cuda.device(index) if index is not None else contextlib.nullcontext()


def settle(tensors) -> None:
    """Wait for work the caller queued on its current CUDA stream(s), which may still be writing
    these tensors (gdsckpt's ring runs on its own stream)."""
    for dev in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.current_stream(dev).synchronize()
