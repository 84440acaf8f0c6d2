"""The alternatives gdsckpt-bench compares against, on the same state, directory and process.

Each takes (state, directory, device) and returns {name, save_s, load_s, stored_bytes,
logical_bytes, io_path, notes}. Saves are timed until the data is durable (fsync returned).
Loads start cold (the file's pages dropped from the page cache) and end when every tensor is on
`device` (CUDA synchronized). Files are removed afterwards, also on failure. GPU-only baselines
raise RuntimeError with the reason where CUDA, KvikIO or nvCOMP is missing; the caller reports
it. Needs nothing from the library but the bench's own page-cache drop and walk over the state
(states.every_tensor: every place a tensor sits, as these formats write it; the KvikIO rows
borrow gdsckpt's KvikIO settings where gdsckpt is importable, so that the comparison is like for
like).
"""

from __future__ import annotations

import io
import os
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from .disk import drop_page_cache
from .states import every_tensor, placed_bytes


def _fsync(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def same_tensors(a: list, b: list) -> bool:
    """Bitwise equality of two tensor lists (byte views: NaN-safe, -0.0 != 0.0)."""
    def raw(t):
        return t.detach().contiguous().reshape(-1).view(torch.uint8)
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(raw(x), raw(y).to(x.device))
        for x, y in zip(a, b))


def _fs_note(directory) -> str:
    """Cold reads are only cold on real storage: say so where the directory is in memory."""
    best, fstype = "", ""
    target = os.path.realpath(directory)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mnt, fs = line.split()[:3]
                if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, fstype = mnt, fs
    except OSError:
        return ""
    return f"; {fstype} at {best}: reads come from memory, not storage" if fstype in ("tmpfs", "ramfs") else ""


@contextmanager
def _scratch(directory, name):
    path = Path(directory) / name
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def _kvikio_setup(kvikio):
    """(io path, settings context, description). gdsckpt's own KvikIO settings (threads,
    O_DIRECT) where gdsckpt is importable, so that both sides of the comparison do the same I/O;
    else KvikIO's defaults, as the notes then say."""
    import kvikio.defaults  # noqa: F401  (not every KvikIO imports it with the package)
    try:
        from gdsckpt.engine.backend import kvikio_settings
        io_path, ctx = kvikio_settings("auto")
        how = "gdsckpt's KvikIO settings"
    except Exception:
        try:
            io_path = "compat" if kvikio.defaults.is_compat_mode_preferred() else "gds"
        except AttributeError:  # older KvikIO
            io_path = "compat" if kvikio.defaults.compat_mode() else "gds"
        ctx, how = nullcontext(), "KvikIO defaults"
    return io_path, ctx, how


def _kvikio_desc(kvikio, how: str) -> str:
    try:
        get = kvikio.defaults.get
        return f"{how}: {get('num_threads')} threads, {get('task_size') >> 20} MiB tasks"
    except Exception:
        return how


def _need_gpu(device: str, *modules: str):
    """Lazy imports for the GPU baselines, with a clear reason where one is missing."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"needs a CUDA device (device is {device!r})")
    mods = []
    for m in modules:
        try:
            mods.append(__import__(m, fromlist=["_"]))
        except ImportError as e:
            raise RuntimeError(f"needs {m}, which is not installed ({e})") from None
    return mods


def torch_save(state, directory, device):
    """torch.save of the whole state to one file; torch.load(map_location=device, weights_only=True)."""
    originals = [t for _, t in every_tensor(state)[0]]
    with _scratch(directory, "baseline.pt") as path:
        _sync(device)
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        save_s = time.perf_counter() - t0
        drop_page_cache(path)
        t0 = time.perf_counter()
        out = torch.load(path, map_location=device, weights_only=True)
        _sync(device)
        load_s = time.perf_counter() - t0
        exact = same_tensors([t for _, t in every_tensor(out)[0]], originals)
        return {"name": "torch.save + fsync / torch.load", "save_s": save_s, "load_s": load_s,
                "stored_bytes": path.stat().st_size, "logical_bytes": placed_bytes(state), "io_path": "cpu",
                "notes": f"weights_only=True, map_location={device}; bit-exact: {exact}{_fs_note(directory)}"}


def safetensors_file(state, directory, device):
    """safetensors save_file of the flattened tensors ("/"-joined keys); load_file(device=device)."""
    from safetensors.torch import load_file, save_file
    originals, skipped = every_tensor(state)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # safetensors wants an explicit index
        dev = torch.device("cuda", torch.cuda.current_device())
    with _scratch(directory, "baseline.safetensors") as path:
        _sync(device)
        t0 = time.perf_counter()
        # safetensors refuses tensors that share storage (tied weights): those get their own copy.
        seen, tensors, cloned = set(), {}, 0
        for k, t in originals:
            ptr = (t.device, t.untyped_storage().data_ptr())
            if t.numel() and ptr in seen:
                t, cloned = t.clone(), cloned + 1
            seen.add(ptr)
            tensors[k] = t.contiguous()
        save_file(tensors, path)
        _fsync(path)
        save_s = time.perf_counter() - t0
        drop_page_cache(path)
        t0 = time.perf_counter()
        out = load_file(path, device=str(dev))
        _sync(device)
        load_s = time.perf_counter() - t0
        exact = same_tensors([out[k] for k, _ in originals], [t for _, t in originals])
        notes = f"tensors only: {skipped} non-tensor values (e.g. param_groups) not saved"
        notes += f"; {cloned} shared-storage tensors copied" if cloned else ""
        return {"name": "safetensors save_file / load_file", "save_s": save_s, "load_s": load_s,
                "stored_bytes": path.stat().st_size, "logical_bytes": placed_bytes(state), "io_path": "cpu",
                "notes": f"{notes}; bit-exact: {exact}{_fs_note(directory)}"}


def _u8(cupy, t: torch.Tensor):
    """A uint8 CuPy view of a contiguous CUDA tensor's bytes (bf16 has no array-interface type)."""
    return cupy.asarray(t.detach().reshape(-1).view(torch.uint8))


def _kvikio_all(kvikio, cupy, path, mode: str, tensors: list, offsets: list) -> None:
    """Every tensor's bytes written to (mode "w") or read from ("r") `path` at its offset, all
    requests in flight at once, then waited for."""
    with kvikio.CuFile(path, mode) as f:
        io = f.pwrite if mode == "w" else f.pread
        futures = [io(_u8(cupy, t), t.nbytes, off) for t, off in zip(tensors, offsets) if t.nbytes]
        for fut in futures:
            fut.get()


def kvikio_raw(state, directory, device):
    """The uncompressed floor of gdsckpt's I/O path: every tensor's bytes written from device
    memory with KvikIO into one file (back to back, 4 KiB aligned), read back into preallocated
    device tensors."""
    kvikio, cupy = _need_gpu(device, "kvikio", "cupy")
    originals = [t for _, t in every_tensor(state)[0]]
    with _scratch(directory, "baseline.raw") as path:
        # Staging tensors that are not contiguous on `device` is a copy this baseline would make
        # too; keep it out of the timing so that the row measures I/O alone.
        src = [t.to(device).contiguous() for t in originals]
        offsets, pos = [], 0
        for t in src:
            offsets.append(pos)
            pos += -(-t.nbytes // 4096) * 4096
        io_path, settings, how = _kvikio_setup(kvikio)
        with settings:
            desc = _kvikio_desc(kvikio, how)
            _sync(device)
            t0 = time.perf_counter()
            _kvikio_all(kvikio, cupy, path, "w", src, offsets)
            _fsync(path)
            save_s = time.perf_counter() - t0
            del src
            drop_page_cache(path)
            dst = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in originals]
            _sync(device)
            t0 = time.perf_counter()
            _kvikio_all(kvikio, cupy, path, "r", dst, offsets)
            _sync(device)
            load_s = time.perf_counter() - t0
        exact = same_tensors(dst, originals)
        return {"name": "KvikIO raw (uncompressed)", "save_s": save_s, "load_s": load_s,
                "stored_bytes": path.stat().st_size, "logical_bytes": placed_bytes(state), "io_path": io_path,
                "notes": f"{len(dst)} tensors, one CuFile, 4 KiB aligned, {desc}; no container format "
                         f"(offsets kept in memory); bit-exact: {exact}{_fs_note(directory)}"}


def nvcomp_zstd_blob(state, directory, device):
    """The approach of NVIDIA's checkpoint-compression blog post: torch.save into memory, copy
    the blob to the GPU, compress it with nvCOMP Zstd in one call, write it with KvikIO; load
    reads the blob, decompresses it on the GPU and torch.loads the bytes."""
    kvikio, cupy, nvcomp = _need_gpu(device, "kvikio", "cupy", "nvidia.nvcomp")
    import numpy as np
    originals = [t for _, t in every_tensor(state)[0]]
    codec = nvcomp.Codec(algorithm="Zstd")  # created once, as a trainer would
    io_path, settings, how = _kvikio_setup(kvikio)
    with _scratch(directory, "baseline.nvcomp-zstd") as path, settings:
        desc = _kvikio_desc(kvikio, how)
        _sync(device)
        t0 = time.perf_counter()
        buf = io.BytesIO()
        torch.save(state, buf)
        blob = cupy.asarray(np.frombuffer(buf.getbuffer(), dtype=np.uint8))
        comp = codec.encode(nvcomp.as_array(blob))
        n = comp.buffer_size
        comp_u8 = cupy.asarray(comp).view(cupy.uint8).reshape(-1)[:n]
        _sync(device)  # nvCOMP may run on its own stream; KvikIO must see the finished output
        with kvikio.CuFile(path, "w") as f:
            f.pwrite(comp_u8, n, 0).get()
        _fsync(path)
        save_s = time.perf_counter() - t0
        pickle_bytes = buf.getbuffer().nbytes
        del buf, blob, comp, comp_u8
        drop_page_cache(path)
        t0 = time.perf_counter()
        comp_u8 = cupy.empty(n, dtype=cupy.uint8)
        with kvikio.CuFile(path, "r") as f:
            f.pread(comp_u8, n, 0).get()
        raw = cupy.asarray(codec.decode(nvcomp.as_array(comp_u8))).view(cupy.uint8).reshape(-1)
        _sync(device)
        out = torch.load(io.BytesIO(raw.get().tobytes()), map_location=device, weights_only=True)
        _sync(device)
        load_s = time.perf_counter() - t0
        exact = same_tensors([t for _, t in every_tensor(out)[0]], originals)
        return {"name": "torch.save -> nvCOMP Zstd blob (NVIDIA blog)", "save_s": save_s, "load_s": load_s,
                "stored_bytes": path.stat().st_size, "logical_bytes": placed_bytes(state), "io_path": io_path,
                "notes": f"pickled on the CPU ({pickle_bytes} B), one nvCOMP Zstd call on the whole blob, "
                         f"one KvikIO write ({desc}); bit-exact: {exact}{_fs_note(directory)}"}


BASELINES = {"torch_save": torch_save, "safetensors": safetensors_file, "kvikio_raw": kvikio_raw,
             "nvcomp_zstd_blob": nvcomp_zstd_blob}
