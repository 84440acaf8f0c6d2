"""`gdsckpt convert` and `gdsckpt export`: another codec, or another format, one tensor at a time.

Nothing here holds the whole state in memory: each stored tensor is read from the checkpoint
(`Checkpoint.read`, on the CPU), written where it goes, and dropped before the next.

- export --to safetensors: the header (every key's dtype, shape and offsets, known from the
  index) is written first, then each tensor's bytes at its offset.
- export --to torch: torch_export.py (torch.save's own format, filled one tensor at a time).
- convert: the save pipeline compresses from tensors in memory, so the tensors are first written
  one by one, uncompressed, to a scratch file beside the destination (named as a temporary, so
  `gdsckpt clean` finds it if the process is killed) and saved from a memory map of it: the page
  cache holds what is in use, and it can drop it. The scratch needs free space for the logical
  bytes; it is removed at the end. The new file keeps the source's skeleton (values, aliases,
  NumPy and bytes placements) and the device each tensor was saved from.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from .. import api, codecs
from gdsckpt.engine.backend import choose, gpu_status
from gdsckpt.core.dtypes import BY_NAME
from ..errors import CodecUnavailableError, UnsupportedStateError
from gdsckpt.format.file import Index
from gdsckpt.writing.save import NewFile, SaveOptions, save_flat
from gdsckpt.core.storage import AtomicFile, export_target, pwrite_all, save_target, temp_path_for, user_path
from gdsckpt.format.tree import Leaf
from gdsckpt.core.units import format_bytes
from .exitcodes import ExitCode
from .output import emit_json, progress
from .paths import CHECKPOINT, expect_path
from .torch_export import export_torch

__all__ = ["convert", "export_safetensors", "cmd_convert", "cmd_export", "SAFETENSORS_DTYPES"]

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
    expect_path(args.src, CHECKPOINT)
    if args.codec != "auto" and not codecs.lookup(args.codec).cpu_encodes:
        usable, why = gpu_status()
        if not usable:  # convert() would say it in the API's words (codec=, CUDA tensors)
            raise CodecUnavailableError(
                f"--codec {args.codec} compresses with nvCOMP on a GPU, and none is usable here ({why}). "
                f"Convert with --codec zstd (any CPU reads it) or --codec auto, or run this command on a "
                f"machine with a GPU and gdsckpt[cu12] or [cu13] installed")
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
        if "__metadata__" in infos:
            raise UnsupportedStateError("tensor '__metadata__': safetensors reserves that key for its header's "
                                        "metadata; export it --to torch")
        for k, i in infos.items():
            if i["dtype"] not in SAFETENSORS_DTYPES:
                raise UnsupportedStateError(f"tensor {k!r} is {i['dtype']}, which safetensors cannot hold; "
                                            "export it --to torch")
            try:  # safetensors' header is UTF-8 JSON: a lone surrogate there makes a file nothing opens
                k.encode("utf-8")
            except UnicodeEncodeError:
                raise UnsupportedStateError(f"tensor key {k!r} is not valid Unicode (a lone surrogate), which a "
                                            "safetensors header cannot hold; export it --to torch") from None
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
        f = AtomicFile(export_target(src, dst, "export"))
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


# ---------------------------------------------------------------- the command


EXPORTERS = {"safetensors": export_safetensors, "torch": export_torch}


def cmd_export(args) -> int:
    expect_path(args.src, CHECKPOINT)
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
