"""`gdsckpt convert` and `gdsckpt export`: another codec, or another format, one tensor at a time.

Nothing here holds the whole state in memory: each stored tensor is read from the checkpoint
(`Checkpoint.read`, on the CPU), written where it goes, and dropped before the next.

- export --to safetensors: the header (every key's dtype, shape and offsets, known from the
  index) is written first, then each tensor's bytes at its offset.
- export --to torch: torch.save's zip holds one pickle of the whole object, then one record per
  storage; the pickle needs every tensor's shape and dtype but none of its bytes. So the pickle
  and empty records are written by torch.save itself, of FakeTensors (torch.serialization.skip_data,
  made for this), and the records are then filled one tensor at a time through a shared memory
  map of the file (torch.load(mmap=True)); finally each record's CRC-32 is written where the zip
  keeps it, so that any zip reader accepts the file.
- convert: the save pipeline compresses from tensors in memory, so the tensors are first written
  one by one, uncompressed, to a scratch file beside the destination (named as a temporary, so
  `gdsckpt clean` finds it if the process is killed) and saved from a memory map of it: the page
  cache holds what is in use, and it can drop it. The scratch needs free space for the logical
  bytes; it is removed at the end. The new file keeps the source's skeleton (values, aliases,
  NumPy and bytes placements) and the device each tensor was saved from.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import zipfile
import zlib
from pathlib import Path

import torch

from .. import api, codecs
from ..backend import choose
from ..dtypes import BY_NAME
from ..errors import UnsupportedStateError
from ..format import Index
from ..save import NewFile, SaveOptions, save_flat
from ..storage import AtomicFile, pwrite_all, save_target, temp_path_for, user_path
from ..tree import TYPED, Leaf, unflatten
from ..units import format_bytes
from .exitcodes import ExitCode
from .output import emit_json, progress

__all__ = ["convert", "export_safetensors", "export_torch", "cmd_convert", "cmd_export", "SAFETENSORS_DTYPES"]

ALIGN = 64  # where each tensor starts in the scratch file and in the safetensors data (any dtype's alignment)

# gdsckpt's dtype names -> the safetensors format's (the dtypes both have)
SAFETENSORS_DTYPES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64",
    "uint16": "U16", "uint32": "U32", "uint64": "U64", "float16": "F16", "bfloat16": "BF16", "float32": "F32",
    "float64": "F64", "complex64": "C64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
}


def _bytes_of(t: torch.Tensor):
    """A CPU tensor's bytes, without a copy where it is contiguous."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _stored(ck) -> list:
    """The stored tensors (plan order): (index, key, dtype name, shape, nbytes)."""
    return [(i, t.key, t.dtype, tuple(t.shape), t.nbytes) for i, t in enumerate(ck.index.plan.tensors)]


# ---------------------------------------------------------------- convert


class _KeepDevices:
    """save.NewFile that records the source's devices (where each tensor was saved from) rather
    than the scratch mapping's, which is host memory."""

    def __init__(self, destination: NewFile, devices: list[str]):
        self._destination, self._devices = destination, devices
        self.label = destination.label

    def open(self, be):
        return self._destination.open(be)

    def layout(self, fd, meta, skeleton, devices, plan):
        return self._destination.layout(fd, meta, skeleton, self._devices, plan)

    def commit(self, file) -> None:
        self._destination.commit(file)

    def abort(self, file, error) -> None:
        self._destination.abort(file, error)


def convert(src, dst, *, codec: str = "zstd", bar=None):
    """Rewrite checkpoint `src` as `dst` with `codec`, tensor by tensor (module docstring). The
    GPU backend writes where the codec needs nvCOMP (ans, bitcomp), or for "auto" where the
    source was saved from a GPU and one is usable here. Returns the save's Stats."""
    options = SaveOptions(codec=codec)  # a bad codec: a ValueError before anything is read
    destination = NewFile(save_target(user_path(dst, "convert")))
    with api.open(src) as ck:
        index: Index = ck.index
        tensors = _stored(ck)
        offsets, end = [], 0
        for *_, nbytes in tensors:
            offsets.append(end)
            end += -(-nbytes // ALIGN) * ALIGN
        needs_gpu = codec != "auto" and not codecs.lookup(codec).cpu_encodes
        wants_gpu = needs_gpu or (codec == "auto" and "cuda" in index.devices)
        options = SaveOptions(codec=codec, backend=choose(wants_gpu, None))
        scratch = temp_path_for(destination.path)
        fd = os.open(scratch, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            os.ftruncate(fd, end)
            for (i, key, _, _, nbytes), offset in zip(tensors, offsets):
                t = ck.read([key], "cpu")[key]
                pwrite_all(fd, _bytes_of(t), offset)
                del t
                if bar is not None:
                    bar.update(nbytes)
            mapped = torch.from_file(str(scratch), shared=True, size=end, dtype=torch.uint8) if end \
                else torch.empty(0, dtype=torch.uint8)
            leaves = [Leaf(key, mapped[offset:offset + nbytes].view(BY_NAME[dtype]).reshape(shape))
                      for (_, key, dtype, shape, nbytes), offset in zip(tensors, offsets)]
            return save_flat(index.skeleton, leaves, _KeepDevices(destination, list(index.devices)), options)
        finally:
            os.close(fd)
            scratch.unlink(missing_ok=True)


def cmd_convert(args) -> int:
    with api.open(args.src) as ck:
        total, count = ck.index.plan.logical_bytes, len(ck.index.plan.tensors)
    bar = progress(total, f"convert {Path(args.src).name}")
    try:
        stats = convert(args.src, args.dst, codec=args.codec, bar=bar)
    finally:
        bar.close()
    if args.json:
        emit_json({"src": args.src, "dst": args.dst, "codec": args.codec, "tensors": count, "streams": stats.streams,
                   "logical_bytes": stats.logical_bytes, "stored_bytes": stats.stored_bytes,
                   "file_bytes": stats.file_bytes, "ratio": stats.ratio, "seconds": stats.seconds,
                   "backend": stats.backend})
    else:
        print(f"{args.src} -> {args.dst}: codec {args.codec}, {format_bytes(stats.logical_bytes)} logical, "
              f"{format_bytes(stats.stored_bytes)} stored ({1 - stats.ratio:.1%} saved)")
    return ExitCode.OK


# ---------------------------------------------------------------- export --to safetensors


def export_safetensors(src, dst, *, bar=None) -> dict:
    """Every key of `src` (an alias, such as a tied weight, as a copy under its own key) as a
    safetensors file at `dst`; {"tensors", "bytes", "values_left_out"}. Plain values (a step
    count, a learning rate) have no place in safetensors and are left out (counted)."""
    with api.open(src) as ck:
        keys = ck.keys()
        infos = {k: ck.info(k) for k in keys}
        for k, i in infos.items():
            if i["dtype"] not in SAFETENSORS_DTYPES:
                raise UnsupportedStateError(f"tensor {k!r} is {i['dtype']}, which safetensors cannot hold; "
                                            "export it --to torch")
        # by alignment, then name, as safetensors' own writer orders them: every offset stays aligned
        order = sorted(keys, key=lambda k: (-torch.empty(0, dtype=BY_NAME[infos[k]["dtype"]]).element_size(), k))
        header, offset = {}, 0
        for k in order:
            n = infos[k]["nbytes"]
            header[k] = {"dtype": SAFETENSORS_DTYPES[infos[k]["dtype"]], "shape": list(infos[k]["shape"]),
                         "data_offsets": [offset, offset + n]}
            offset += n
        header["__metadata__"] = {"format": "pt", "gdsckpt_source": str(src)}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-(8 + len(text)) % 8)  # data starts 8-byte aligned, as safetensors pads it
        start = 8 + len(text)
        f = AtomicFile(save_target(user_path(dst, "export")))
        f.create()
        f.adopt_mode()
        try:
            pwrite_all(f.fd, struct.pack("<Q", len(text)) + text, 0)
            for k in order:
                t = ck.read([k], "cpu")[k]
                pwrite_all(f.fd, _bytes_of(t), start + header[k]["data_offsets"][0])
                del t
                if bar is not None:
                    bar.update(infos[k]["nbytes"])
            f.commit()
        except BaseException:
            f.abort()
            raise
        values = _plain_values(ck.index.skeleton)
    return {"tensors": len(order), "bytes": start + offset, "values_left_out": values}


def _plain_values(node: dict) -> int:
    """How many plain values (not tensors) the skeleton `node` holds."""
    (kind, body), = node.items()
    if kind == "value":
        return 1
    if kind in ("dict", "odict"):
        return sum(_plain_values(v) for _, v in (body["items"] if kind == "odict" else body))
    if kind in ("list", "tuple"):
        return sum(_plain_values(v) for v in body)
    return 0


# ---------------------------------------------------------------- export --to torch


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
        f = AtomicFile(save_target(user_path(dst, "export")))
        f.create()
        f.adopt_mode()
        try:
            with torch.serialization.skip_data(materialize_fake_tensors=True):
                torch.save(obj, f.tmp)
            del obj, fakes
            with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
                mapped = torch.load(f.tmp, mmap=True, weights_only=True)
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


# ---------------------------------------------------------------- the command


EXPORTERS = {"safetensors": export_safetensors, "torch": export_torch}


def cmd_export(args) -> int:
    with api.open(args.src) as ck:
        total = sum(ck.info(k)["nbytes"] for k in ck.keys()) if args.to == "safetensors" \
            else ck.index.plan.logical_bytes
    bar = progress(total, f"export {Path(args.src).name}")
    try:
        result = EXPORTERS[args.to](args.src, args.dst, bar=bar)
    finally:
        bar.close()
    if args.json:
        emit_json({"src": args.src, "dst": args.dst, "to": args.to, **result})
    else:
        left = result.get("values_left_out")
        print(f"{args.src} -> {args.dst}: {args.to}, {result['tensors']} tensors, {format_bytes(result['bytes'])}"
              + (f" ({left} plain values left out: safetensors holds tensors only)" if left else ""))
    return ExitCode.OK
