"""Device memory outside torch's caching allocator, for a large buffer held only for a while: it
goes back to the device once the last view of it is gone, instead of staying reserved in
torch's cache, where NCCL and other libraries (and a colocated inference engine sizing itself
by the free memory) could not use it.
- stream_ordered: CUDA's stream-ordered allocator (cudaMallocAsync, through CuPy), freed in a
  stream's order without waiting for the device: a first save's copy of the state, freed on
  a background thread while training runs (async_save.py).
- allocated: cudaMalloc itself, freed by cudaFree (which waits for the device): a restore's
  buffer of every stored byte (ring.read_verified), freed at the end of the call. cuFile reads
  into it under GPUDirect Storage, for which a memory pool's memory cannot be mapped by default
  (the same P2P mapping as GPUDirect RDMA)."""

from __future__ import annotations

import cupy
import torch


class _Allocation:
    """What torch.as_tensor makes the tensor from; the tensor holds it, and it the memory."""

    def __init__(self, memory: cupy.cuda.MemoryAsync | cupy.cuda.Memory, nbytes: int):
        self.memory = memory
        # version 2: no stream to synchronize with; the caller orders its uses
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (memory.ptr, False),
                                         "version": 2}


def stream_ordered(nbytes: int, device: torch.device, stream: torch.cuda.Stream) -> torch.Tensor:
    """`nbytes` (> 0) of memory on `device` as a uint8 tensor, allocated in `stream`'s order and
    freed in it once the tensor and every view of it are gone: whoever reads it on another stream
    must have finished (synchronized) by then. CUDA's error (out of memory, no memory pools on
    this device) is raised as CuPy raises it."""
    with cupy.cuda.Device(device.index):
        memory = cupy.cuda.MemoryAsync(nbytes, cupy.cuda.ExternalStream(stream.cuda_stream, device.index))
    return torch.as_tensor(_Allocation(memory, nbytes), device=device)


def allocated(nbytes: int, device: torch.device) -> torch.Tensor:
    """`nbytes` (> 0) of memory on `device` from cudaMalloc, usable on every stream at once and
    freed by cudaFree, which waits for the whole device, once the tensor and every view of it
    are gone. CUDA's error (out of memory) is raised as CuPy raises it."""
    with cupy.cuda.Device(device.index):
        memory = cupy.cuda.Memory(nbytes)
    return torch.as_tensor(_Allocation(memory, nbytes), device=device)
