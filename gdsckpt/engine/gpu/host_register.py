"""Page-locking host memory that gdsckpt did not allocate through CUDA (a slot of the memory tier:
a shared-memory segment mapped into the process), so that device-to-host copies into it run
asynchronously at full speed, as into the pinned host pool. cudaHostRegister, through torch's
binding of the CUDA runtime (the call torch's own shared-memory stager makes)."""

from __future__ import annotations

import torch

PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context of the process


def register(address: int, nbytes: int) -> None:
    """Page-lock [address, address + nbytes): page-aligned memory of this process's mapping.
    RuntimeError with CUDA's error code if the runtime refuses."""
    err = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, PORTABLE))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with cudaError {err}")


def unregister(address: int) -> None:
    """Undo register(address, ...): before the memory is unmapped."""
    err = int(torch.cuda.cudart().cudaHostUnregister(address))
    if err != 0:
        raise RuntimeError(f"cudaHostUnregister failed with cudaError {err}")
