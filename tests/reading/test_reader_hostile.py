"""Hostile files (issue 5): hand-crafted indices with valid checksums and footers, so that what is
tested is the validation itself. Absurd shapes, sizes, counts and offsets, negative numbers,
bools where ints belong, dtypes outside the list, deep trees, a huge index, chunk ranges that
overlap or run past the end, frame lists that lie, a newer format. Each must be refused with a
clear CheckpointFormatError before any large allocation; nothing on the load path unpickles,
evals or imports by name.
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import importlib
import io
import json
import os
import pickle
import re
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

import gdsckpt
from gdsckpt import cli, codecs
from gdsckpt.format import file as fmt
from gdsckpt.format.checksum import checksum
from ckpt_tools import footer, rebuild, set_chunk, split

MIB = 1 << 20
ALLOC_LIMIT = 16 * MIB  # no hostile file may make the reader allocate more than this


def _state():
    return {"a": torch.arange(6000, dtype=torch.float32) / 8, "b": torch.zeros(1000), "c": torch.arange(500),
            "d": {"e": [torch.ones(2, 3, dtype=torch.bfloat16), 5, "x"]}, "one": torch.ones(1, dtype=torch.uint8),
            "empty": torch.empty(0), "noise": torch.randint(0, 256, (5000,), dtype=torch.uint8,
                                                            generator=torch.Generator().manual_seed(0))}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> bytes:
    """Streams float32 (a, b, empty: chunks 0-1, 4 KiB zstd frames), int64 (c: chunk 2),
    bfloat16 (d/e/0: chunk 3, raw), uint8 (one, noise: chunk 4, raw)."""
    p = tmp_path_factory.mktemp("hostile") / "base.gdsckpt"
    old = dict(codecs.ZSTD_FRAME_BYTES)
    codecs.ZSTD_FRAME_BYTES["cpu"] = 4096
    try:
        gdsckpt.save(_state(), p, chunk_bytes=16384)
    finally:
        codecs.ZSTD_FRAME_BYTES.update(old)
    data = p.read_bytes()
    _, doc, _ = split(data)
    assert [len(c.get("frames") or []) for c in doc["chunks"]] == [4, 3, 1, 0, 0]
    assert [t["key"] for t in doc["tensors"]] == ["a", "b", "c", "d/e/0", "one", "empty", "noise"]
    return data


# ---------------------------------------------------------------- the cases

CASES: dict[str, tuple] = {}  # id -> (build(data, doc) -> bytes, stage "open"|"load", message regex)


def case(name, stage="open", match=None):
    def register(fn):
        CASES[name] = (fn, stage, match)
        return fn
    return register


def field(name, path, value, stage="open", match=None):
    """A case that sets doc[path...] = value (or deletes it, for value DELETE) and re-signs the file."""
    def build(data, doc):
        node = doc
        for k in path[:-1]:
            node = node[k]
        if value is DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value() if callable(value) else value
        return rebuild(data, doc)
    CASES[name] = (build, stage, match)


DELETE = object()
T, S, C = "tensors", "streams", "chunks"

# streams
for v in ["float128", "object", "torch.float32", None, [], {"x": 1}, 5, "qint8"]:
    field(f"stream-dtype-{v!r}", (S, 0, "dtype"), v, match="unknown dtype")
for v in [{"name": "lz4"}, "zstd", None, {"name": "zstd"}, {"name": "zstd", "frame_bytes": True},
          {"name": "zstd", "frame_bytes": 0}, {"name": "zstd", "frame_bytes": 1 << 40},
          {"name": "zstd", "frame_bytes": 4096.0}, {"name": "ans", "data_type": "<f4"}, {"name": []}]:
    field(f"stream-codec-{json.dumps(v)}", (S, 0, "codec"), v, match="codec")
for v in [-1, True, 1.5, 2 ** 64, "28000", None, 28001, 27999]:
    field(f"stream-nbytes-{v!r}", (S, 0, "nbytes"), v)
field("streams-not-a-list", (S,), {"0": 1}, match="not a list")
field("streams-missing", (S,), DELETE, match="not a list")
field("stream-not-an-object", (S, 0), "float32", match="unknown dtype")

# tensors
for v in [[-1], [True], [2.0], ["3"], "6000", None, [1] * 65, [6000, -0.0], [3000, 2, True]]:
    field(f"shape-{json.dumps(v)[:30]}", (T, 0, "shape"), v, match="shape")
for v in [[2 ** 70, 0], [2 ** 63, 0], [2 ** 40, 2 ** 40, 0], [0, 2 ** 64]]:  # zero elements, absurd dims
    field(f"empty-shape-{json.dumps(v)}", (T, 5, "shape"), v, match="shape")
field("shape-absurd-inconsistent", (T, 0, "shape"), [1 << 40], match="nbytes")
for v in [24004, -24000, 24000.0, True, None, "24000"]:
    field(f"nbytes-{v!r}", (T, 0, "nbytes"), v, match="nbytes")
field("nbytes-bool-for-1", (T, 4, "nbytes"), True, match="nbytes")
field("nbytes-float-for-1", (T, 4, "nbytes"), 1.0, match="nbytes")
for v in [4, -4, True, 1 << 62, None, 24000.0]:
    field(f"offset-{v!r}", (T, 1, "offset"), v, match="offset|tile|outside")
for v in [99, -1, None, 1.0, "0", 2]:
    field(f"tensor-stream-{v!r}", (T, 0, "stream"), v, match="stream")
field("tensor-stream-bool", (T, 2, "stream"), True, match="stream")
for v in ["float64", "int8", "complex256", None, []]:
    field(f"tensor-dtype-{v!r}", (T, 0, "dtype"), v, match="dtype|stream")
for v in ["meta", "xla:0", "cuda:0x", None, 0]:
    field(f"device-{v!r}", (T, 0, "device"), v, match="device")
for v in [5, None, ["a"]]:
    field(f"key-{v!r}", (T, 0, "key"), v, match="key")
field("key-duplicate", (T, 1, "key"), "a", match="share")
field("tensors-not-a-list", (T,), "a", match="not a list")
field("tensor-not-an-object", (T, 0), ["a"], match="key")

# chunks
field("chunk-overlaps-previous", (C, 1, "file_offset"), 4096, match="overlaps")  # where chunk 0 starts
field("chunk-before-data-area", (C, 0, "file_offset"), 0, match="overlaps")
field("chunk-unaligned", (C, 1, "file_offset"), 16385, match="overlaps")
field("chunk-into-index", (C, 4, "file_offset"), 36864, match="overlaps")
field("chunk-past-end", (C, 4, "stored"), 1 << 40, match="overlaps|stores")
field("chunk-stored-zero", (C, 2, "stored"), 0, match="overlaps")
field("chunk-stored-negative", (C, 2, "stored"), -743, match="stored")
field("chunk-stored-bool", (C, 3, "stored"), True, match="stored")
field("chunk-length-zero", (C, 3, "length"), 0, match="logical range")
field("chunk-length-huge", (C, 1, "length"), (1 << 31) + 1, match="logical range")
field("chunk-length-negative", (C, 1, "length"), -1, match="length")
field("chunk-length-bool", (C, 3, "length"), True, match="length")
field("chunk-logical-gap", (C, 1, "offset"), 16388, match="logical range")
field("chunk-logical-overlap", (C, 1, "offset"), 16380, match="logical range")
field("chunk-stream-missing", (C, 2, "stream"), 9, match="stream")
field("chunk-stream-bool", (C, 2, "stream"), True, match="stream")
field("chunk-stream-null", (C, 2, "stream"), None, match="stream")
field("chunks-not-covering", (C,), lambda: CASES_BASE[C][:4], match="chunks cover")
field("chunks-extra", (C,), lambda: CASES_BASE[C] + [CASES_BASE[C][-1]], match="logical range")
field("chunks-swapped", (C,), lambda: [CASES_BASE[C][1], CASES_BASE[C][0]] + CASES_BASE[C][2:], match="logical range")
field("chunk-raw-string", (C, 3, "raw"), "yes", match="raw")
field("chunk-raw-int", (C, 3, "raw"), 1, match="raw")
field("chunk-raw-false-on-raw-bytes", (C, 3, "raw"), False, match="frame")
field("chunk-raw-length-mismatch", (C, 4, "length"), 5000, match="raw|logical range|cover")
field("chunk-checksum-short", (C, 0, "checksum"), "6730b6b9", match="checksum")
field("chunk-checksum-upper", (C, 0, "checksum"), "6730B6B907001109", match="checksum")
field("chunk-checksum-int", (C, 0, "checksum"), 123, match="checksum")
field("chunk-checksum-nonhex", (C, 0, "checksum"), "6730b6b90700110g", match="checksum")
field("chunk-not-an-object", (C, 0), [0, 0], match="not an object")
field("frames-missing", (C, 0, "frames"), DELETE, match="frame")
field("frames-too-few", (C, 0, "frames"), [4565, 4637], match="frame")
field("frames-too-many", (C, 0, "frames"), [2283, 2279, 2305, 2306, 1], match="frame")
field("frames-wrong-sum", (C, 0, "frames"), [2283, 2279, 2305, 2305], match="frame")
field("frames-zero", (C, 0, "frames"), [0, 4562, 2305, 2306], match="frame")
field("frames-negative", (C, 0, "frames"), [-2283, 6841, 2305, 2306], match="frame")
field("frames-bool", (C, 2, "frames"), [True], match="frame")
field("frames-float", (C, 2, "frames"), [743.0], match="frame")
field("frames-not-a-list", (C, 2, "frames"), 743, match="frame")
field("frames-on-raw-chunk", (C, 3, "frames"), [12], match="frame")
# same count and total, but the wrong split: only the decoder can tell; it must still be a clean error
def _frames_lie(shift):
    def build(data, doc):
        """Chunk 0's frame lengths with `shift` bytes moved from frame 1 to frame 0 (or back)."""
        real = doc[C][0]["frames"]
        doc[C][0]["frames"] = [real[0] + shift, real[1] - shift] + real[2:]
        assert codecs.frame_offsets(doc[C][0]["frames"])[-1] == codecs.frame_offsets(real)[-1]
        return rebuild(data, doc)
    return build


CASES["frames-lie-same-total"] = (_frames_lie(16), "load", "decode")
CASES["frames-lie-shifted"] = (_frames_lie(-16), "load", "decode")

# skeleton
for name, v in [("missing", DELETE), ("string", "x"), ("two-keys", {"tensor": 0, "value": 1}),
                ("unknown-kind", {"set": []}), ("value-dict", {"dict": [["a", {"value": {"x": 1}}]]}),
                ("value-list", {"list": [{"value": [1]}]}), ("bool-key", {"dict": [[True, {"value": 1}]]}),
                ("float-key", {"dict": [[1.5, {"value": 1}]]}), ("item-not-pair", {"dict": [["a"]]}),
                ("dict-body-object", {"dict": {"a": {"value": 1}}}), ("list-body-object", {"list": {"a": 1}}),
                ("tensor-out-of-range", {"list": [{"tensor": i} for i in range(6)] + [{"tensor": 7}]}),
                ("tensor-twice", {"list": [{"tensor": i} for i in range(7)] + [{"tensor": 0}]}),
                ("tensor-missing", {"list": [{"tensor": i} for i in range(6)]}),
                ("tensor-bool", {"list": [{"tensor": i} for i in range(1, 7)] + [{"tensor": False}]}),
                ("tensor-negative", {"list": [{"tensor": i} for i in range(7)] + [{"tensor": -1}]})]:
    field(f"skeleton-{name}", ("skeleton",), v, match="skeleton")


def _nest(depth):
    node = {"list": [{"tensor": i} for i in range(7)]}
    for _ in range(depth):
        node = {"list": [node]}
    return node


field("skeleton-deeper-than-limit", ("skeleton",), lambda: _nest(300), match="deeper")
# a key twice in one dict: a load kept one of the two (a tensor lost, no error; export crashed)
field("skeleton-dict-key-twice", ("skeleton",), {"dict": [["a", {"list": [{"tensor": i} for i in range(7)]}],
                                                          ["a", {"value": 1}]]}, match="key 'a' twice")
field("skeleton-odict-key-twice", ("skeleton",), {"odict": {"items": [[3, {"value": 1}], [3, {"value": 2}]]}},
      match="key 3 twice")

# format version in the index
field("index-format-newer", ("format",), [2, 0], match="newer")
field("index-format-bool", ("format",), [True, 0], match="format")
field("index-format-zero", ("format",), [0, 0], match="format")
field("index-format-string", ("format",), "1.0", match="format")
field("index-format-missing", ("format",), DELETE, match="format")
field("index-writer-not-an-object", ("writer",), ["cpu"], match="writer")
field("index-library-not-a-string", ("library",), {"a": 1}, match="library")

CASES_BASE: dict = {}  # the intact index of the case being built (for cases that reuse its records)


@case("index-not-json", match="JSON")
def _(data, doc):
    return rebuild(data, b"this is not json")


@case("index-empty", match="JSON")
def _(data, doc):
    return rebuild(data, b"")


@case("index-not-utf8", match="JSON")
def _(data, doc):
    return rebuild(data, b'{"format": [1, 0], "x": "\xff\xfe"}')


@case("index-utf32-garbage", match="JSON")
def _(data, doc):
    return rebuild(data, b"\x00\x00\x00{" * 3)


@case("index-array", match="not a JSON object")
def _(data, doc):
    return rebuild(data, b"[1, 2, 3]")


@case("index-huge-int", match="JSON|format")
def _(data, doc):
    return rebuild(data, b'{"format": [' + b"9" * 20000 + b', 0]}')


@case("index-nan-format", match="format")
def _(data, doc):
    return rebuild(data, b'{"format": [NaN, 0]}')


@case("index-100k-nested-lists", match="JSON")
def _(data, doc):
    return rebuild(data, b"[" * 100_000 + b"]" * 100_000)


@case("index-100k-nested-skeleton", match="JSON")
def _(data, doc):
    doc["skeleton"] = "@"
    raw = json.dumps(doc).encode()
    return rebuild(data, raw.replace(b'"@"', b'{"list":[' * 100_000 + b"]}" * 100_000))


@case("index-100k-nested-objects", match="JSON")
def _(data, doc):
    return rebuild(data, b'{"a":' * 100_000 + b"1" + b"}" * 100_000)


@case("footer-newer-major", match="upgrade gdsckpt")
def _(data, doc):
    b = bytearray(rebuild(data, doc, major=2))
    b[8:10] = struct.pack("<H", 2)
    return bytes(b)


@case("footer-major-only-newer", match="upgrade gdsckpt")
def _(data, doc):
    return rebuild(data, doc, major=7)


@case("header-major-only-newer", match="upgrade gdsckpt")
def _(data, doc):
    b = bytearray(data)
    b[8:10] = struct.pack("<H", 3)
    return bytes(b)


@case("header-minor-differs", match="header says")
def _(data, doc):
    b = bytearray(data)
    b[10:12] = struct.pack("<H", fmt.MINOR + 1)
    return bytes(b)


@case("format-major-zero", match="does not exist|format 0")
def _(data, doc):
    b = bytearray(rebuild(data, doc, major=0))
    b[8:10] = struct.pack("<H", 0)
    return bytes(b)


@case("footer-huge-index-length", match="outside the file|exceeds")
def _(data, doc):
    return rebuild(data, doc, index_length=(1 << 64) - 1)


@case("footer-index-length-past-end", match="outside the file")
def _(data, doc):
    raw = json.dumps(doc).encode()
    return rebuild(data, raw, index_length=len(raw) + 1)


@case("footer-index-offset-unaligned", match="outside the file")
def _(data, doc):
    head, _, off = split(data)
    raw = json.dumps(doc).encode()
    return head[:-1] + raw + footer(off - 1, raw)


@case("footer-index-offset-in-header", match="outside the file")
def _(data, doc):
    raw = b" " * 4096 + json.dumps(doc).encode()
    return fmt.header_bytes() + raw + footer(0, raw, file_len=4096 + len(raw) + 64)


@case("footer-file-length-lies", match="footer records")
def _(data, doc):
    return rebuild(data, doc, file_len=1 << 40)


@case("footer-index-checksum-lies", match="index checksum")
def _(data, doc):
    return rebuild(data, doc, index_checksum=12345)


@case("footer-bad-magic", match="no gdsckpt footer")
def _(data, doc):
    return rebuild(data, doc, magic=b"GDSCKIDY")


@case("header-bad-magic", match="header magic")
def _(data, doc):
    return b"PK\x03\x04" + data[4:]


@case("empty-file", match="too short")
def _(data, doc):
    return b""


@case("tensor-count-limit", match="exceed the limit")
def _(data, doc):
    doc["tensors"] = doc["tensors"] * 3  # with MAX_TENSORS lowered below (see test)
    return rebuild(data, doc)


@case("index-size-limit", match="exceeds")
def _(data, doc):
    return rebuild(data, doc)  # with MAX_INDEX_BYTES lowered below (see test)


def _absurd(codec: dict, tensor_bytes: int, stored: bytes, frames) -> bytes:
    """One float32 tensor of `tensor_bytes` bytes, in chunks of 2 GiB each stored as `stored`
    (each in its own 4 KiB record): self-consistent except for the impossible compression ratio."""
    n = tensor_bytes // (1 << 31)
    chunks = [{"stream": 0, "offset": k << 31, "length": 1 << 31, "file_offset": 4096 * (k + 1),
               "stored": len(stored), "checksum": f"{checksum(stored):016x}", **({"frames": frames} if frames else {})}
              for k in range(n)]
    doc = {"format": [1, 0], "skeleton": {"tensor": 0},
           "streams": [{"dtype": "float32", "codec": codec, "nbytes": tensor_bytes}],
           "tensors": [{"key": "w", "dtype": "float32", "shape": [tensor_bytes // 4], "stream": 0, "offset": 0,
                        "nbytes": tensor_bytes, "device": "cpu"}], "chunks": chunks}
    area = bytearray(fmt.header_bytes() + bytes(4096 * n))
    for c in chunks:
        area[c["file_offset"]:c["file_offset"] + len(stored)] = stored
    raw = json.dumps(doc).encode()
    return bytes(area) + raw + footer(len(area), raw)


@case("absurd-shape-1TiB-zstd-16-byte-chunks", match="more than|ratio")
def _(data, doc):
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 64)
    return _absurd({"name": "zstd", "level": 3, "frame_bytes": 1 << 31}, 1 << 40, frame, [len(frame)])


@case("absurd-shape-64GiB-bitcomp-16-byte-chunks", match="more than|ratio")
def _(data, doc):
    return _absurd({"name": "bitcomp", "data_type": "<f4", "nvcomp": "5.0.0"}, 64 << 30, b"\1" * 16, None)


@case("absurd-shape-4GiB-raw", match="overlaps|raw")
def _(data, doc):
    return _absurd({"name": "raw"}, 4 << 30, b"\1" * 16, None)


@case("chunk-claims-raw-codec-but-compressed", match="raw")
def _(data, doc):
    doc["streams"][2]["codec"] = {"name": "raw"}
    del doc["chunks"][3]["raw"]
    return rebuild(data, doc)


def _zstd_frame_claiming(content_size: int, payload=b"") -> bytes:
    """A zstd frame whose header claims `content_size` bytes: magic, descriptor with an 8-byte
    content size field and single-segment flag, then one last raw block of `payload`."""
    fhd = 0b11100000  # FCS field 8 bytes, single segment, no checksum, no dict id
    block = struct.pack("<I", (len(payload) << 3) | 1)[:3]  # last block, raw
    return b"\x28\xb5\x2f\xfd" + bytes([fhd]) + struct.pack("<Q", content_size) + block + payload


def _hostile_chunk(data, doc, stored):
    """Chunk 2 (int64 stream, 4000 bytes, one zstd frame) replaced by `stored`, checksum recomputed."""
    area, doc = set_chunk(data, doc, 2, stored, frames=[len(stored)])
    return rebuild(data, doc, data_area=area)


@case("zstd-frame-claims-1TiB", stage="load", match="claims")
def _(data, doc):
    return _hostile_chunk(data, doc, _zstd_frame_claiming(1 << 40, b"\0" * 16))


@case("zstd-frame-claims-more-than-its-share", stage="load", match="decode")
def _(data, doc):
    return _hostile_chunk(data, doc, _zstd_frame_claiming(4001, b"\0" * 16))


@case("zstd-frame-decodes-short", stage="load", match="decode")
def _(data, doc):
    frame = zstandard.ZstdCompressor().compress(b"\0" * 3999)
    return _hostile_chunk(data, doc, frame)


@case("zstd-frame-decodes-long-no-size", stage="load", match="decode")
def _(data, doc):
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 8000)
    return _hostile_chunk(data, doc, frame)


@case("zstd-garbage-with-valid-checksum", stage="load", match="decode")
def _(data, doc):
    return _hostile_chunk(data, doc, bytes(range(256)) * 2)


@case("zstd-two-frames-in-one", stage="load", match="decode")
def _(data, doc):
    c = zstandard.ZstdCompressor()
    stored = c.compress(b"\0" * 2000) + c.compress(b"\0" * 2000)
    return _hostile_chunk(data, doc, stored)


# ---------------------------------------------------------------- the tests


@pytest.fixture
def alloc_meter(monkeypatch):
    """The largest torch.empty the reader asks for (tracemalloc does not see torch's allocator)."""
    largest = [0]
    real_empty = torch.empty

    def empty(*size, **kw):
        t = real_empty(*size, **kw) if not _too_big(size, kw) else None
        if t is None:
            raise AssertionError(f"torch.empty{size} would allocate over {ALLOC_LIMIT} bytes")
        largest[0] = max(largest[0], t.nbytes)
        return t

    def _too_big(size, kw):
        shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        n = 1
        for d in shape:
            n *= int(d)
        return n * (kw.get("dtype") or torch.float32).itemsize > ALLOC_LIMIT

    monkeypatch.setattr(torch, "empty", empty)
    return largest


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_index(name, base, tmp_path, monkeypatch, alloc_meter):
    build, stage, match = CASES[name]
    _, doc, _ = split(base)
    CASES_BASE.clear()
    CASES_BASE.update(copy.deepcopy(doc))
    data = build(base, doc)
    p = tmp_path / "hostile.gdsckpt"
    p.write_bytes(data)
    if name == "tensor-count-limit":
        monkeypatch.setattr(fmt, "MAX_TENSORS", 10)
    if name == "index-size-limit":
        monkeypatch.setattr(fmt, "MAX_INDEX_BYTES", 1000)
    tracemalloc.start()
    try:
        with pytest.raises(gdsckpt.CheckpointFormatError) as ei:
            ck = gdsckpt.open(p)
            assert stage == "load", f"{name}: open accepted the file"
            ck.load()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    e = ei.value
    assert peak < ALLOC_LIMIT + 4 * len(data), f"{name}: the reader's Python heap peaked at {peak} bytes"
    assert str(p) in str(e) and e.path is not None, f"{name}: the error does not name the file: {e}"
    if match:
        assert re.search(match, str(e)), f"{name}: {e}"
    for cmd in (["inspect", str(p)], ["verify", str(p)], ["verify", "--deep", str(p)]):
        rc, text = _cli(*cmd)
        if stage == "open" or cmd[-2] == "--deep":
            said = "DAMAGED" if cmd[0] == "verify" else "error"  # verify's report names a damaged file, once
            assert rc == 1 and said in text and "Traceback" not in text, f"{name}: {cmd}: {text}"  # 1: damaged


def test_newer_major_is_a_version_error(base, tmp_path):
    _, doc, _ = split(base)
    p = tmp_path / "v2.gdsckpt"
    b = bytearray(rebuild(base, doc, major=2, minor=3))
    b[8:12] = struct.pack("<HH", 2, 3)
    p.write_bytes(bytes(b))
    with pytest.raises(gdsckpt.VersionError, match=r"format 2\.3.*upgrade gdsckpt") as ei:
        gdsckpt.open(p)
    assert str(p) in str(ei.value)
    doc["format"] = [2, 0]
    p.write_bytes(rebuild(base, doc))
    with pytest.raises(gdsckpt.VersionError, match="newer.*upgrade gdsckpt"):
        gdsckpt.open(p)


def test_newer_minor_with_unknown_fields_loads(base, tmp_path):
    """Minor versions add optional fields only: a reader ignores what it does not know."""
    _, doc, _ = split(base)
    doc["format"] = [1, 7]
    doc["future"] = {"anything": [1, 2, 3]}
    doc["tensors"][0]["future"] = True
    doc["chunks"][0]["future"] = "x"
    p = tmp_path / "minor.gdsckpt"
    b = bytearray(rebuild(base, doc, minor=7))
    b[8:12] = struct.pack("<HH", 1, 7)
    p.write_bytes(bytes(b))
    out = gdsckpt.load(p)
    assert torch.equal(out["a"], _state()["a"])


def test_nvcomp_chunks_on_a_cpu_host_say_how_to_convert(base, tmp_path):
    """Not a format error: a valid ANS file on a host with no GPU. A clear, typed refusal."""
    if gdsckpt.engine.backend.gpu_status()[0]:
        pytest.skip("this host has a GPU")
    _, doc, _ = split(base)
    doc["streams"][1]["codec"] = {"name": "ans", "data_type": "|u1", "nvcomp": "5.0.0"}
    del doc["chunks"][2]["frames"]
    p = tmp_path / "ans.gdsckpt"
    p.write_bytes(rebuild(base, doc))
    with pytest.raises(gdsckpt.CodecUnavailableError, match="convert"):
        gdsckpt.load(p)


def test_rebuilt_intact_index_loads(base, tmp_path):
    """The helper itself: re-signing an unmodified index gives a file that loads."""
    _, doc, _ = split(base)
    p = tmp_path / "same.gdsckpt"
    p.write_bytes(rebuild(base, doc))
    from conftest import assert_same
    assert_same(gdsckpt.load(p), _state())


def test_hostile_case_count():
    assert len(CASES) >= 150, len(CASES)


# ---------------------------------------------------------------- nothing executes the file

# cli/torch_export.py is not: it writes torch.save files (and maps the one it has just written)
LOAD_PATH_MODULES = ["__init__", "__main__", "api", "engine/backend", "format/checksum", "cli/__init__", "cli/exitcodes",
                     "cli/export", "cli/files", "cli/output", "cli/paths", "cli/views", "core/dtypes", "errors",
                     "format/file", "format/plan", "reading/reader", "reading/interfaces", "engine/ring",
                     "engine/interfaces", "reading/sources", "stats", "core/storage", "format/tree",
                     "engine/gpu/__init__", "engine/gpu/backend", "engine/gpu/codecs", "engine/gpu/io", "engine/gpu/kernels"]
LOAD_PATH_PACKAGES = ["codecs"]  # every module in them


def test_no_pickle_eval_or_import_by_name_in_the_source():
    root = Path(gdsckpt.__file__).parent
    bad = re.compile(r"\bpickle\b|\bcPickle\b|\bmarshal\b|\bshelve\b|\beval\s*\(|\bexec\s*\(|__import__|"
                     r"\bimportlib\b|\bimport_module\b|torch\.load\b|\byaml\b|getattr\(\s*torch\s*,(?!\s*n\))")
    found = []
    files = [root / f"{m}.py" for m in LOAD_PATH_MODULES]
    files += [f for p in LOAD_PATH_PACKAGES for f in sorted((root / p).glob("*.py"))]
    for f in files:
        assert f.exists(), f"{f} is listed as on the load path but does not exist: update LOAD_PATH_MODULES"
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if bad.search(line):
                found.append(f"{f.name}:{i}: {line.strip()}")
    assert not found, found


def test_load_never_unpickles_evals_or_imports(base, tmp_path, monkeypatch):
    p = tmp_path / "ok.gdsckpt"
    p.write_bytes(base)
    gdsckpt.load(p)  # warm: any import gdsckpt does lazily happens here, not under the trap

    def trap(what):
        def f(*a, **k):
            raise AssertionError(f"{what} called on the load path")
        return f

    for mod, name in [(pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (torch, "load"),
                      (builtins, "eval"), (builtins, "exec"), (importlib, "import_module"), (np, "load")]:
        monkeypatch.setattr(mod, name, trap(f"{mod.__name__}.{name}"))
    real_import = builtins.__import__
    imported = []

    def spy(name, *a, **k):
        imported.append(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", spy)
    ck = gdsckpt.open(p)
    out = ck.load()
    ck.verify(deep=True)
    monkeypatch.undo()
    assert torch.equal(out["a"], _state()["a"])
    names = {n.split(".")[0] for n in imported}
    assert not names - {"gdsckpt", "torch", "numpy", "zstandard", "", "errors", "format"}, imported


def _cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(list(argv))
        except BaseException as e:  # noqa: BLE001 - report it as the test failure it is
            import traceback
            return 99, "Traceback\n" + "".join(traceback.format_exception(e))
    return rc, out.getvalue() + err.getvalue()


def test_all_zero_state_is_within_the_expansion_bound(tmp_path):
    """The densest real chunks (zeros: zstd's RLE blocks, 4 bytes per 128 KiB) still open: the
    expansion bound refuses only what no encoder can produce."""
    state = {"z": torch.zeros(48 << 20, dtype=torch.uint8), "f": torch.zeros(4 << 20)}
    p = tmp_path / "zeros.gdsckpt"
    gdsckpt.save(state, p)
    ck = gdsckpt.open(p)
    worst = max(c.length / r.stored for c, r in zip(ck.index.plan.chunks, ck.index.records))
    assert 20_000 < worst <= fmt.MAX_EXPANSION["zstd"], worst
    out = ck.load()
    assert not out["z"].any() and not out["f"].any()


def test_not_a_regular_file(tmp_path):
    """A directory, a FIFO (which must not hang the open) or a device: refused as not a checkpoint."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for p in (tmp_path, fifo, Path("/dev/zero")):
        with pytest.raises(gdsckpt.CheckpointFormatError, match="not a regular file"):
            gdsckpt.open(p)
        rc, text = _cli("verify", str(p))
        assert rc == 1 and "not a regular file" in text  # 1: not a checkpoint (damaged)


def test_file_shrinking_while_opened(base):
    """The footer reader copes with a file truncated between its size check and its reads."""
    with pytest.raises(gdsckpt.CheckpointFormatError, match="shrank"):
        fmt.read_footer(lambda n, o: base[o:o + n] if o == 0 else base[o:o + 5], len(base), "shrinking")
    with pytest.raises(gdsckpt.CheckpointFormatError, match="shrank"):
        fmt.read_footer(lambda n, o: base[:10] if o == 0 else base[o:o + n], len(base), "shrinking")
