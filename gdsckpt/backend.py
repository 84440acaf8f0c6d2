"""Which backend runs a save or restore, and the CPU backend itself.

Both backends give the ring the same operations on 1-D uint8 torch tensors;
the GPU one (gdsckpt/gpu/backend.py) is imported only when CUDA, nvCOMP and
KvikIO are all usable, so `import gdsckpt` works with no CUDA driver.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from .checksum import checksum
from .codecs import CpuCodecs, cpu_can_decode
from .storage import HostFile


class CpuBackend:
    name = "cpu"
    io_path = "cpu"
    nvcomp_version = None
    device = torch.device("cpu")

    def __init__(self, io_threads: int = 2):
        self.io_threads = io_threads
        self._codecs = CpuCodecs()

    def can_decode(self, spec: dict) -> bool:
        return cpu_can_decode(spec)

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def direct(self, view: torch.Tensor) -> bool:
        return view.device.type == "cpu"

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def gatherer(self, plan, views):
        """(chunk, staging) -> the chunk's logical bytes: a view of its tensor where the chunk
        lies inside one, else its segments copied into `staging`."""
        def gather(chunk, staging: torch.Tensor) -> torch.Tensor:
            segs = chunk.segments
            if len(segs) == 1 and views.tensors[segs[0].tensor].device.type == "cpu":
                s = segs[0]
                return views[s.tensor][s.tensor_offset:s.tensor_offset + s.length]
            for s in segs:
                staging[s.chunk_offset:s.chunk_offset + s.length].copy_(
                    views[s.tensor][s.tensor_offset:s.tensor_offset + s.length])
            return staging
        return gather

    def max_stored(self, spec: dict, nbytes: int) -> int:
        return nbytes  # anything larger is stored raw instead

    def encode(self, spec, src, out, scratch):
        return self._codecs.encode(spec, src.numpy(), out.numpy())

    def decode(self, spec, stored, out, frames) -> None:
        self._codecs.decode(spec, stored.numpy(), out.numpy(), frames)

    def checksum(self, buf: torch.Tensor) -> int:
        return checksum(buf.numpy())

    def open(self, path: Path, mode: str) -> HostFile:
        return HostFile(path, mode, self.io_threads)

    def synchronize(self) -> None:
        pass

    def begin(self) -> None:
        pass

    def finish(self) -> None:
        pass

    def memory(self) -> dict:
        return {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@functools.cache
def gpu_status() -> tuple[bool, str]:
    """(usable, why not). Cached: probing CUDA, nvCOMP and KvikIO costs time."""
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    try:
        from .gpu import backend as _  # noqa: F401
    except Exception as e:  # missing wheels or a broken CUDA install: say which
        return False, f"GPU modules failed to import ({type(e).__name__}: {e}); install gdsckpt[cu12] or [cu13]"
    return True, ""


def make_backend(kind: str, **options):
    """kind: "gpu" or "cpu". options: io ("auto"|"gds"|"compat"), io_threads, task_size, device."""
    if kind == "cpu":
        return CpuBackend(options.get("io_threads") or 2)
    ok, why = gpu_status()
    if not ok:
        raise RuntimeError(f"the GPU backend is not available: {why}")
    from .gpu.backend import GpuBackend
    return GpuBackend(**options)
