"""Device memory outside torch's caching allocator, for a copy held only for a while (a first
save's copy of the state, async_save.py): CUDA's stream-ordered allocator (cudaMallocAsync,
through CuPy) gives it, and it goes back to the device (cudaFreeAsync) once the last view of it
is gone, instead of staying reserved in torch's cache, where NCCL and other libraries could not
use it."""

from __future__ import annotations

import cupy
import torch


class _Allocation:
    """What torch.as_tensor makes the tensor from; the tensor holds it, and it the memory."""

    def __init__(self, memory: cupy.cuda.MemoryAsync, nbytes: int):
        self.memory = memory
        # version 2: no stream to synchronize with; the caller orders its uses on `stream`
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
