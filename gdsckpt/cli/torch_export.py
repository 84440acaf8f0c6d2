"""`gdsckpt export --to torch`: a file torch.load reads, written one tensor at a time.

torch.save's zip holds one pickle of the whole object, then one record per storage; the pickle
needs every tensor's shape and dtype but none of its bytes. So torch.save itself writes the
pickle and empty records, of FakeTensors (torch.serialization.skip_data, made for this), and the
records are then filled one tensor at a time through a shared memory map of the new file: the
file is mapped by torch.load(mmap=True, weights_only=True) of the descriptor this process
created (/proc/self/fd: the very file it just wrote, not whatever the path names meanwhile),
which is how torch itself finds a record's place. Finally each record's CRC-32, which skip_data
leaves 0, is written where the zip keeps it, so that any zip reader accepts the file.

Not on the load path (tests/test_hostile.py lists it as such): it reads gdsckpt files through
gdsckpt.open like every command, and the only pickle it reads is the one it has just written.
"""

from __future__ import annotations

import mmap
import os
import struct
import zipfile
import zlib
from pathlib import Path

import torch

from .. import api
from gdsckpt.core.dtypes import BY_NAME
from gdsckpt.core.storage import AtomicFile, export_target
from gdsckpt.format.tree import TYPED, unflatten

__all__ = ["export_torch"]


def _stored(ck) -> list:
    """The stored tensors (plan order): (index, key, dtype name, shape, nbytes)."""
    return [(i, t.key, t.dtype, tuple(t.shape), t.nbytes) for i, t in enumerate(ck.index.plan.tensors)]


def _typed_as_tensors(node: dict) -> dict:
    """The skeleton with NumPy and bytes placements as plain tensors: the export then loads with
    torch.load(weights_only=True), which refuses NumPy objects."""
    (kind, body), = node.items()
    if kind in TYPED:
        return {"tensor": body}
    if kind == "dict":
        return {"dict": [[k, _typed_as_tensors(v)] for k, v in body]}
    if kind == "odict":
        return {"odict": {**body, "items": [[k, _typed_as_tensors(v)] for k, v in body["items"]]}}
    if kind in ("list", "tuple"):
        return {kind: [_typed_as_tensors(v) for v in body]}
    return node


def export_torch(src, dst, *, bar=None) -> dict:
    """`src` as torch.save would write what gdsckpt.load returns (NumPy arrays and bytes as
    tensors; on the CPU), written one tensor at a time (module docstring); {"tensors", "bytes"}."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with api.open(src) as ck:
        tensors = _stored(ck)
        with FakeTensorMode():
            fakes = [torch.empty(shape, dtype=BY_NAME[dtype]) for _, _, dtype, shape, _ in tensors]
        obj = unflatten(_typed_as_tensors(ck.index.skeleton), fakes)
        f = AtomicFile(export_target(src, dst, "export"))
        f.create()
        f.adopt_mode()
        try:
            with torch.serialization.skip_data(materialize_fake_tensors=True):
                torch.save(obj, f.tmp)
            del obj, fakes
            mine = Path(f"/proc/self/fd/{f.fd}")  # the file this process created, whatever f.tmp names now
            with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
                mapped = torch.load(mine if mine.exists() else f.tmp, mmap=True, weights_only=True)
            placed = _placed_tensors(mapped, _typed_as_tensors(ck.index.skeleton), {})
            for i, key, *_, nbytes in tensors:
                placed[i].copy_(ck.read([key], "cpu")[key])
                if bar is not None:
                    bar.update(nbytes)
            del mapped, placed  # unmapped: the bytes are in the file's page cache
            _write_crcs(f.tmp)
            f.commit()
        except BaseException:
            f.abort()
            raise
    return {"tensors": len(tensors), "bytes": os.stat(dst).st_size}


def _placed_tensors(obj, node: dict, out: dict) -> dict:
    """{tensor index: the tensor that the loaded object `obj` holds where skeleton `node` places it},
    walking both together (dict keys as they are: str or int)."""
    (kind, body), = node.items()
    if kind == "tensor":
        out.setdefault(body, obj)
    elif kind in ("dict", "odict"):
        for k, v in (body["items"] if kind == "odict" else body):
            _placed_tensors(obj[k], v, out)
    elif kind in ("list", "tuple"):
        for i, v in enumerate(body):
            _placed_tensors(obj[i], v, out)
    return out


def _write_crcs(path: Path) -> None:
    """Each record's CRC-32, which skip_data left 0, where the zip keeps it: the local header, the
    data descriptor after the data (torch's writer adds one) and the central directory."""
    with open(path, "r+b") as fh:
        z = zipfile.ZipFile(fh)
        entries = [(i, _data_offset(fh, i)) for i in z.infolist() if i.CRC == 0 and i.file_size]
        cd_entries = _central_entries(fh, z)
        for info, data_at in entries:
            crc, left, at = 0, info.file_size, data_at
            while left:
                chunk = os.pread(fh.fileno(), min(left, 64 << 20), at)
                crc, left, at = zlib.crc32(chunk, crc), left - len(chunk), at + len(chunk)
            packed = struct.pack("<I", crc)
            os.pwrite(fh.fileno(), packed, info.header_offset + 14)
            after = data_at + info.file_size
            if os.pread(fh.fileno(), 4, after) == b"PK\x07\x08":
                os.pwrite(fh.fileno(), packed, after + 4)
            os.pwrite(fh.fileno(), packed, cd_entries[info.filename] + 16)


def _data_offset(fh, info: zipfile.ZipInfo) -> int:
    name_len, extra_len = struct.unpack("<HH", os.pread(fh.fileno(), 4, info.header_offset + 26))
    return info.header_offset + 30 + name_len + extra_len


def _central_entries(fh, z: zipfile.ZipFile) -> dict:
    """Each member's central directory entry offset, by name."""
    out, at = {}, z.start_dir
    for _ in z.infolist():
        head = os.pread(fh.fileno(), 46, at)
        name_len, extra_len, comment_len = struct.unpack("<HHH", head[28:34])
        out[os.pread(fh.fileno(), name_len, at + 46).decode()] = at
        at += 46 + name_len + extra_len + comment_len
    return out
