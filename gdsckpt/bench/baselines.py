"""The alternatives gdsckpt-bench --compare measures on the same state, target and process.

Each takes (state, directory, device) and returns {name, save_s, load_s, stored_bytes,
logical_bytes, io_path, notes}. Saves are timed to fsync; loads start from a dropped page
cache and end when the tensors are on `device` (synchronized).
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import torch

from gdsckpt.tree import flatten


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _drop(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _logical(state) -> int:
    return sum(leaf.tensor.nbytes for leaf in flatten(state)[1])


def _result(name, save_s, load_s, path, state, io_path, notes=""):
    return {"name": name, "save_s": save_s, "load_s": load_s, "stored_bytes": os.path.getsize(path),
            "logical_bytes": _logical(state), "io_path": io_path, "notes": notes}


def torch_save(state, directory, device):
    path = Path(directory) / "baseline.pt"
    _sync(device)
    t = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    save_s = time.perf_counter() - t
    _drop(path)
    t = time.perf_counter()
    out = torch.load(path, map_location=device, weights_only=True)
    _sync(device)
    load_s = time.perf_counter() - t
    del out
    r = _result("torch.save + fsync / torch.load", save_s, load_s, path, state, "cpu",
                f"map_location={device}, weights_only=True")
    path.unlink()
    return r


def safetensors_file(state, directory, device):
    from safetensors.torch import load_file, save_file
    path = Path(directory) / "baseline.safetensors"
    tensors = {leaf.key: leaf.tensor.contiguous() for leaf in flatten(state)[1]}
    _sync(device)
    t = time.perf_counter()
    save_file(tensors, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    save_s = time.perf_counter() - t
    _drop(path)
    t = time.perf_counter()
    out = load_file(path, device=device)
    _sync(device)
    load_s = time.perf_counter() - t
    del out
    r = _result("safetensors save_file / load_file", save_s, load_s, path, state, "cpu",
                "tensors only (plain values dropped); shared storage not supported")
    path.unlink()
    return r


def kvikio_raw(state, directory, device):
    """The uncompressed floor of the same I/O path: every tensor's bytes from device memory."""
    if not device.startswith("cuda"):
        raise RuntimeError("needs a CUDA device")
    import kvikio
    from gdsckpt.gpu.backend import as_cupy
    path = Path(directory) / "baseline.raw"
    views = [leaf.tensor.contiguous().reshape(-1).view(torch.uint8) for leaf in flatten(state)[1]]
    views = [v if v.is_cuda else v.to(device) for v in views]
    offsets, pos = [], 0
    for v in views:
        offsets.append(pos)
        pos = (pos + v.numel() + 4095) // 4096 * 4096
    torch.cuda.synchronize()
    t = time.perf_counter()
    with kvikio.CuFile(path, "w") as f:
        futs = [f.pwrite(as_cupy(v), v.numel(), o) for v, o in zip(views, offsets) if v.numel()]
        for fut in futs:
            fut.get()
        os.fsync(f.fileno())
    save_s = time.perf_counter() - t
    _drop(path)
    dst = [torch.empty_like(v) for v in views]
    torch.cuda.synchronize()
    t = time.perf_counter()
    with kvikio.CuFile(path, "r") as f:
        futs = [f.pread(as_cupy(v), v.numel(), o) for v, o in zip(dst, offsets) if v.numel()]
        for fut in futs:
            fut.get()
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t
    mode = "compat" if kvikio.defaults.is_compat_mode_preferred() else "gds"
    r = _result("KvikIO raw (uncompressed)", save_s, load_s, path, state, mode, "one CuFile, 4 KiB aligned")
    path.unlink()
    return r


def nvcomp_zstd_blob(state, directory, device):
    """NVIDIA's checkpoint-compression blog approach: torch.save to memory, one nvCOMP Zstd
    compression of the whole blob on the GPU, one KvikIO write; the reverse on load."""
    if not device.startswith("cuda"):
        raise RuntimeError("needs a CUDA device")
    import cupy
    import kvikio
    from nvidia import nvcomp
    path = Path(directory) / "baseline.zst"
    codec = nvcomp.Codec(algorithm="Zstd")
    torch.cuda.synchronize()
    t = time.perf_counter()
    buf = io.BytesIO()
    torch.save(state, buf)
    blob = cupy.asarray(memoryview(buf.getbuffer()).cast("B"))
    comp = cupy.asarray(codec.encode(nvcomp.as_array(blob))).view(cupy.uint8)
    with kvikio.CuFile(path, "w") as f:
        f.pwrite(comp, comp.nbytes, 0).get()
        os.fsync(f.fileno())
    save_s = time.perf_counter() - t
    n = comp.nbytes
    del blob, comp, buf
    _drop(path)
    t = time.perf_counter()
    comp = cupy.empty(n, dtype=cupy.uint8)
    with kvikio.CuFile(path, "r") as f:
        f.pread(comp, n, 0).get()
    raw = cupy.asarray(codec.decode(nvcomp.as_array(comp))).view(cupy.uint8).get()
    out = torch.load(io.BytesIO(raw.tobytes()), map_location=device, weights_only=True)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t
    del out
    mode = "compat" if kvikio.defaults.is_compat_mode_preferred() else "gds"
    r = _result("torch.save -> nvCOMP Zstd blob (NVIDIA blog)", save_s, load_s, path, state, mode,
                "serialize on the CPU, compress whole blob on the GPU")
    path.unlink()
    return r


BASELINES = {"torch_save": torch_save, "safetensors": safetensors_file, "kvikio_raw": kvikio_raw,
             "nvcomp_zstd_blob": nvcomp_zstd_blob}
