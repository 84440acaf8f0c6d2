"""The on-disk format (FORMAT.md): header, 4 KiB aligned chunk records, JSON index, footer.

The one owner of the file's layout: `FileWriter` writes the header, places each chunk record
and writes the index and footer; `read_footer` and `parse_index` read them back. Everything
read from a file is validated here before the rest of gdsckpt acts on it, so that a hostile
or damaged file gives a CheckpointFormatError and never a large allocation, a crash or a
wrong tensor.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Callable

from . import checksum as _ck
from gdsckpt.core import collector
from gdsckpt.core import dtypes
from gdsckpt import codecs
from gdsckpt._version import FORMAT_MAJOR as MAJOR, FORMAT_MINOR as MINOR
from gdsckpt.errors import CheckpointFormatError, UnsupportedStateError, VersionError
from .plan import Chunk, Plan, Stream, TensorEntry, segments
from gdsckpt.core.storage import pwrite_all

# The checksum of every chunk record, the index and the footer, by format version (FORMAT.md,
# "Checksum"): 1.0 wrote a position-weighted sum that two flipped top bits cancel; 1.1 writes
# CRC-64/NVME. What this version writes (defined with the algorithms, in checksum.py):
CHECKSUM = _ck.CURRENT


def checksum_algorithm(major: int, minor: int) -> str:
    return "sum64" if (major, minor) == (1, 0) else "crc64nvme"


def _checksum(data, algorithm: str = CHECKSUM) -> int:
    return _ck.ALGORITHMS[algorithm](data)

ALIGN = 4096
HEADER_SIZE = ALIGN
HEADER_MAGIC = b"GDSCKPT\x00"
FOOTER_MAGIC = b"GDSCKIDX"
_FOOTER = struct.Struct("<8sHHIQQQQ8s")  # magic, major, minor, flags, index off/len/checksum, file len, reserved
FOOTER_SIZE = _FOOTER.size + 8  # + checksum of the footer itself
MAX_INDEX_BYTES = 1 << 30
MAX_CHUNK_BYTES = 1 << 31
MAX_NDIM = 64
MAX_DEPTH = 256
MAX_TENSORS = 10_000_000
# Logical bytes one stored byte can expand to, at most, by codec name (each codec declares its
# own: codecs.base.Codec.max_expansion). A chunk claiming more is lying, and would make the
# reader allocate tensors it cannot fill.
MAX_EXPANSION = codecs.MAX_EXPANSION


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def header_bytes() -> bytes:
    return HEADER_MAGIC + struct.pack("<HH", MAJOR, MINOR) + bytes(HEADER_SIZE - 12)


def footer_bytes(index_offset: int, index: bytes) -> bytes:
    file_len = index_offset + len(index) + FOOTER_SIZE
    body = _FOOTER.pack(FOOTER_MAGIC, MAJOR, MINOR, 0, index_offset, len(index), _checksum(index), file_len, bytes(8))
    return body + struct.pack("<Q", _checksum(body))


@dataclass
class ChunkRecord:
    file_offset: int
    stored: int
    raw: bool
    checksum: int
    frames: list[int] | None  # zstd: compressed length of each frame


class FileWriter:
    """The layout of one file being written. The header goes out on creation; `place` gives each
    chunk record its offset, the next 4 KiB boundary; `finish` writes the index and footer after
    the last record (the index is known only then). fd=None places records without writing
    anything: the bench's targets with storage removed."""

    checksum = CHECKSUM  # the algorithm of the chunk checksums this file records

    def __init__(self, fd: int | None, meta: dict, skeleton: dict, devices: list[str], plan: Plan):
        self.fd, self._meta, self._skeleton, self._devices, self._plan = fd, meta, skeleton, devices, plan
        self._next = HEADER_SIZE
        self.file_bytes = 0  # set by finish
        if fd is not None:
            pwrite_all(fd, header_bytes(), 0)

    def place(self, stored: int) -> int:
        offset, self._next = self._next, align_up(self._next + stored)
        return offset

    def finish(self, records: list[ChunkRecord]) -> None:
        offset, tail = self.tail(records)
        if self.fd is not None:
            pwrite_all(self.fd, tail, offset)

    def tail(self, records: list[ChunkRecord]) -> tuple[int, bytes]:
        """(offset, bytes) of the index and footer after the last record, as finish writes them;
        sets file_bytes. For a file written later (save_async's pool: host_snapshot.DeferredLayout)."""
        index = encode_index(self._meta, self._skeleton, self._devices, self._plan, records)
        self.file_bytes = self._next + len(index) + FOOTER_SIZE
        return self._next, index + footer_bytes(self._next, index)


@dataclass
class Index:
    meta: dict  # format, library, nvcomp, writer
    skeleton: dict
    devices: list[str]  # per tensor: where it was saved from
    plan: Plan
    records: list[ChunkRecord]
    checksum: str = CHECKSUM  # the algorithm of its chunk checksums (checksum.ALGORITHMS)
    # Every place the skeleton puts a tensor, by key path ("/"-joined, as tree.flatten builds it) ->
    # tensor index: the tensor's own key, and from format 1.1 the keys of its aliases (tied weights).
    paths: dict = field(default_factory=dict)


def encode_index(meta: dict, skeleton: dict, devices: list[str], plan: Plan, records: list[ChunkRecord]) -> bytes:
    doc = dict(meta)
    doc["format"] = [MAJOR, MINOR]
    doc["checksum"] = CHECKSUM
    doc["skeleton"] = skeleton
    doc["streams"] = [{"dtype": s.dtype, "codec": s.codec, "nbytes": s.nbytes} for s in plan.streams]
    if "tensors" in doc or "chunks" in doc:
        raise ValueError("index metadata may not name 'tensors' or 'chunks'")
    chunks = []
    for c, r in zip(plan.chunks, records):
        rec = {"stream": c.stream, "offset": c.offset, "length": c.length, "file_offset": r.file_offset,
               "stored": r.stored, "checksum": f"{r.checksum:016x}"}
        if r.raw:
            rec["raw"] = True
        if r.frames is not None:
            rec["frames"] = r.frames
        chunks.append(rec)
    # The JSON of {..., "tensors": [...], "chunks": [...]}, the last two keys in that order, joined
    # from parts: compact json.dumps of a dict is its items' encodings joined, so the bytes are
    # those of the whole document encoded at once.
    raw = b"".join((_json(doc)[:-1], b',"tensors":', _tensors_json(plan.tensors, devices),
                    b',"chunks":', _json(chunks), b"}"))
    if len(raw) > MAX_INDEX_BYTES:  # save refuses what load would refuse
        raise UnsupportedStateError(f"the index of this state would be {len(raw)} bytes, over the format's "
                                    f"{MAX_INDEX_BYTES} byte limit: fewer tensors, or larger chunk_bytes")
    return raw


def _json(value) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=True).encode()


_TENSORS_JSON: list[tuple[list, list, bytes]] = []  # (tensors, devices, their JSON): the last few layouts


def _tensors_json(tensors: list[TensorEntry], devices: list[str]) -> bytes:
    """The index's tensor list, encoded once per layout: every save of a training state has the
    same tensors (a NamedTuple of str and int fields each, so == is exact), and building their
    1,172 dicts held the GIL ~2 ms per save_async on the H100 host, on the snapshot thread."""
    for known, where, data in _TENSORS_JSON:
        if known == tensors and where == devices:
            return data
    data = _json([{"key": t.key, "dtype": t.dtype, "shape": list(t.shape), "stream": t.stream,
                   "offset": t.offset, "nbytes": t.nbytes, "device": d} for t, d in zip(tensors, devices)])
    _TENSORS_JSON.append((list(tensors), list(devices), data))
    del _TENSORS_JSON[:-4]
    return data


# ---------------------------------------------------------------- reading


def read_index(pread, file_size: int, path, on_index: Callable[[int], None] | None = None) -> Index:
    """The validated index of a file of `file_size` bytes read through `pread(n, offset)`.
    on_index(index offset): called once the footer is checked and the index read, before the index
    is parsed (the records lie below that offset)."""
    off, length, index_ck, version = _read_footer(pread, file_size, path)
    raw = pread(length, off)
    if on_index is not None:
        on_index(off)
    return parse_index(raw, index_ck, off, path, checksum_algorithm(*version))


def read_footer(pread, file_size: int, path) -> tuple[int, int, int]:
    """(index offset, index length, index checksum), checked against the file's real size."""
    return _read_footer(pread, file_size, path)[:3]


def _read_footer(pread, file_size: int, path) -> tuple[int, int, int, tuple[int, int]]:
    def bad(msg):
        return CheckpointFormatError(msg, path=path)

    if file_size < HEADER_SIZE + FOOTER_SIZE:
        raise bad(f"file is {file_size} bytes, too short to be a gdsckpt checkpoint (torn or not a checkpoint)")
    head = pread(12, 0)
    if head[:8] != HEADER_MAGIC:
        raise bad("not a gdsckpt checkpoint (bad header magic)")
    raw = pread(FOOTER_SIZE, file_size - FOOTER_SIZE)
    if len(head) != 12 or len(raw) != FOOTER_SIZE:
        raise bad("the file shrank while being opened (truncated in place?)")
    body, (stored_ck,) = raw[:-8], struct.unpack("<Q", raw[-8:])
    magic, major, minor, _flags, off, length, index_ck, file_len, _ = _FOOTER.unpack(body)
    if magic != FOOTER_MAGIC:
        raise bad("no gdsckpt footer at the end of the file: the file is torn, truncated or has bytes appended")
    hmajor, hminor = struct.unpack("<HH", head[8:12])
    if major > MAJOR or hmajor > MAJOR:  # before the checksum: a newer format's algorithm is unknown here
        raise VersionError(f"written in format {max(major, hmajor)}.{minor}; this gdsckpt reads format {MAJOR}.x "
                           "and older: upgrade gdsckpt to read it", path=path)
    if _checksum(body, checksum_algorithm(major, minor)) != stored_ck:
        raise bad("footer checksum mismatch: the footer is corrupt")
    if (major, minor) != (hmajor, hminor):
        raise bad(f"header says format {hmajor}.{hminor}, footer says {major}.{minor}: the header is corrupt")
    if major < 1:
        raise bad(f"format {major}.{minor} does not exist")
    if file_len != file_size:
        raise bad(f"footer records {file_len} bytes but the file has {file_size}: truncated or bytes appended")
    if not (HEADER_SIZE <= off and off % ALIGN == 0 and off + length + FOOTER_SIZE == file_size):
        raise bad(f"footer locates the index at {off}+{length}, outside the file")
    if length > MAX_INDEX_BYTES:
        raise bad(f"index of {length} bytes exceeds the {MAX_INDEX_BYTES} byte limit")
    return off, length, index_ck, (major, minor)


@collector.paused()  # its JSON document is ~10 objects a tensor, all alive until it returns
def parse_index(raw: bytes, expected_checksum: int, index_offset: int, path, checksum: str = CHECKSUM) -> Index:
    """The index, validated; `checksum` is the algorithm of the file's version (checksum_algorithm)."""
    def bad(msg, **kw):
        return CheckpointFormatError(f"invalid index: {msg}", path=path, **kw)

    if _checksum(raw, checksum) != expected_checksum:
        raise CheckpointFormatError("index checksum mismatch: the index is corrupt", path=path)
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise bad(f"not valid JSON ({type(e).__name__})") from None
    if not isinstance(doc, dict):
        raise bad("not a JSON object")
    fmt = doc.get("format")
    if not (isinstance(fmt, list) and len(fmt) == 2 and all(_is_int(v) for v in fmt)):
        raise bad("missing format version")
    if fmt[0] > MAJOR:
        raise VersionError(f"index format {fmt[0]}.{fmt[1]} is newer than this gdsckpt's {MAJOR}.{MINOR}: "
                           "upgrade gdsckpt to read it", path=path)
    if fmt[0] < 1:
        raise bad(f"format {fmt[0]}.{fmt[1]} does not exist")
    for k in ("library", "nvcomp", "created"):
        if not (doc.get(k) is None or isinstance(doc[k], str)):
            raise bad(f"{k!r} is not a string")
    if not (doc.get("writer") is None or isinstance(doc["writer"], dict)):
        raise bad("'writer' is not an object")

    streams = []
    for i, s in enumerate(_list(doc, "streams", bad)):
        if not isinstance(s, dict) or not _is_dtype(s.get("dtype")):
            raise bad(f"stream {i}: unknown dtype {s.get('dtype') if isinstance(s, dict) else s!r}")
        _uint(s.get("nbytes"), f"stream {i} nbytes", bad)
        streams.append(Stream(s["dtype"], _codec(s.get("codec"), i, bad), s["nbytes"]))

    tensor_docs = _list(doc, "tensors", bad)
    if len(tensor_docs) > MAX_TENSORS:
        raise bad(f"{len(tensor_docs)} tensors exceed the limit of {MAX_TENSORS}")
    tensors, devices, keys = [], [], set()
    for i, t in enumerate(tensor_docs):
        if not isinstance(t, dict) or not isinstance(t.get("key"), str):
            raise bad(f"tensor {i}: missing key")
        key = t["key"]
        if key in keys:
            raise bad("two tensors share this key", key=key)
        keys.add(key)
        if not _is_dtype(t.get("dtype")):
            raise bad(f"dtype {t.get('dtype')!r} is not one gdsckpt stores", key=key)
        shape = t.get("shape")
        if not (isinstance(shape, list) and len(shape) <= MAX_NDIM and all(_is_int(d) and d >= 0 for d in shape)):
            raise bad(f"shape {shape!r} is not a list of at most {MAX_NDIM} non-negative ints", key=key)
        if shape_problem(shape):
            raise bad(shape_problem(shape), key=key)
        stream = t.get("stream")
        if not (_is_int(stream) and 0 <= stream < len(streams)) or streams[stream].dtype != t["dtype"]:
            raise bad(f"stream {stream!r} does not exist or holds another dtype", key=key)
        nbytes = math.prod(shape) * dtypes.ITEMSIZE[t["dtype"]]
        if not _is_int(t.get("nbytes")) or t["nbytes"] != nbytes:
            raise bad(f"nbytes {t.get('nbytes')!r} does not match shape {shape} of {t['dtype']}", key=key)
        offset = _uint(t.get("offset"), "offset", bad)
        if offset + nbytes > streams[stream].nbytes:
            raise bad("byte range lies outside its stream", key=key)
        if t.get("device") not in ("cpu", "cuda"):
            raise bad(f"device {t.get('device')!r} is neither cpu nor cuda", key=key)
        tensors.append(TensorEntry(key, t["dtype"], tuple(shape), stream, offset, nbytes))
        streams[stream].tensors.append(i)
        devices.append(t["device"])
    for i, s in enumerate(streams):
        pos = 0
        for ti in s.tensors:  # tensors tile their stream in order, as the writer lays them out
            if tensors[ti].offset != pos:
                raise bad(f"tensors of stream {i} do not tile it", key=tensors[ti].key)
            pos += tensors[ti].nbytes
        if pos != s.nbytes:
            raise bad(f"stream {i} is {s.nbytes} bytes but its tensors cover {pos}")

    chunks, records = [], []
    next_offset = [0] * len(streams)
    members = [[ti for ti in s.tensors if tensors[ti].nbytes] for s in streams]
    cursor = [0] * len(streams)
    file_end = HEADER_SIZE
    for i, c in enumerate(_list(doc, "chunks", bad)):
        if not isinstance(c, dict):
            raise bad("chunk record is not an object", chunk=i)
        s = c.get("stream")
        if not (_is_int(s) and 0 <= s < len(streams)):
            raise bad(f"stream {s!r} does not exist", chunk=i)
        off, length = _uint(c.get("offset"), "offset", bad), _uint(c.get("length"), "length", bad)
        if off != next_offset[s] or not 0 < length <= MAX_CHUNK_BYTES or off + length > streams[s].nbytes:
            raise bad(f"logical range {off}+{length} does not continue stream {s}", chunk=i)
        next_offset[s] = off + length
        spec = streams[s].codec
        codec = codecs.of(spec)
        fo, stored = _uint(c.get("file_offset"), "file_offset", bad), _uint(c.get("stored"), "stored", bad)
        if fo % ALIGN or fo < file_end or fo + stored > index_offset or stored == 0:
            raise bad(f"record {fo}+{stored} overlaps another or lies outside the data area", chunk=i)
        file_end = align_up(fo + stored)
        raw_flag = c.get("raw", False)
        if raw_flag is not True and raw_flag is not False:
            raise bad("raw flag is not a bool", chunk=i)
        if raw_flag and stored != length:
            raise bad(f"raw chunk stores {stored} bytes for {length} logical", chunk=i)
        if not raw_flag and codec.always_raw:
            raise bad(f"chunk of a {codec.name} stream is not marked raw", chunk=i)
        if not raw_flag and stored > codec.max_stored(length):
            raise bad(f"stores {stored} bytes for {length} logical, more than any codec emits", chunk=i)
        if not raw_flag and length > stored * codec.max_expansion:
            raise bad(f"stores {stored} bytes for {length} logical, more than {codec.name} can expand to", chunk=i)
        ck = c.get("checksum")
        if not (isinstance(ck, str) and len(ck) == 16 and all(ch in "0123456789abcdef" for ch in ck)):
            raise bad("checksum is not 16 hex digits", chunk=i)
        frames = c.get("frames")
        if codec.framed and not raw_flag:
            problem = codec.frames_problem(spec, length, stored, frames)
            if problem:
                raise bad(problem, chunk=i)
        elif frames is not None:
            raise bad("frame lengths on a chunk that has no frames", chunk=i)
        segs, cursor[s] = segments(tensors, members[s], cursor[s], off, length)
        chunks.append(Chunk(i, s, off, length, segs))
        records.append(ChunkRecord(fo, stored, raw_flag, int(ck, 16), frames))
    for s, stream in enumerate(streams):
        if next_offset[s] != stream.nbytes:
            raise bad(f"chunks cover {next_offset[s]} of stream {s}'s {stream.nbytes} bytes")

    skeleton = doc.get("skeleton")
    paths = _check_skeleton(skeleton, tensors, (fmt[0], fmt[1]), bad)
    meta = {k: doc.get(k) for k in ("format", "library", "nvcomp", "writer", "created")}
    if "checksum" in doc and doc["checksum"] != checksum:
        raise bad(f"checksum algorithm {doc.get('checksum')!r} is not the one format {fmt[0]}.{fmt[1]} uses")
    return Index(meta, skeleton, devices, Plan(tensors, streams, chunks), records, checksum, paths)


def shape_problem(shape) -> str | None:
    """Why a reader refuses a tensor of this shape, or None. The one definition: parse_index refuses
    such a shape in a file, and tree.flatten refuses it at save time, so that save never writes a
    file that load refuses."""
    if len(shape) > MAX_NDIM:
        return f"shape {list(shape)} has more than {MAX_NDIM} dimensions"
    if math.prod(max(d, 1) for d in shape) >= 1 << 62:  # even with no elements: torch overflows
        return f"shape {list(shape)} is absurdly large (its dimensions, zeros counted as 1, multiply to 2^62 or more)"
    return None


def metadata_problem(meta) -> str | None:
    """Why an OrderedDict's `_metadata` cannot be stored, or None: it must map str to a mapping of
    str to plain values, as torch's Module.state_dict writes it ({prefix: {"version": n}})."""
    if not isinstance(meta, dict):
        return f"_metadata is a {type(meta).__name__}, not a mapping"
    for prefix, entry in meta.items():
        if not isinstance(prefix, str) or not isinstance(entry, dict):
            return f"_metadata entry {prefix!r} is not a str mapped to a mapping"
        for k, v in entry.items():
            if not isinstance(k, str) or not (v is None or isinstance(v, (bool, int, float, str))):
                return f"_metadata[{prefix!r}][{k!r}] is not a str mapped to a plain value"
            if isinstance(v, int) and not -INT_LIMIT < v < INT_LIMIT:
                return f"_metadata[{prefix!r}][{k!r}] has more digits than a reader accepts"
    return None


INT_LIMIT = 10 ** 4300  # Python's JSON reader refuses longer ints (sys.get_int_max_str_digits)
SHARED_TENSORS = ODICT = (1, 1)  # the first format version with aliases and {"odict": ...} nodes
# Tensor placements that load as a NumPy array, a NumPy scalar or bytes (1.1, FORMAT.md): what the
# placed tensor must be for that to come back exactly.
TYPED_PLACEMENTS = {
    "ndarray": lambda t: t.dtype in dtypes.NUMPY_NAMES,
    "npscalar": lambda t: t.dtype in dtypes.NUMPY_NAMES and t.shape == (),
    "bytes": lambda t: t.dtype == "uint8" and len(t.shape) == 1,
}


def _check_skeleton(node, tensors: list, version: tuple[int, int], bad) -> dict[str, int]:
    """Validate the skeleton; return every tensor placement's key path -> tensor index.

    Key paths are built as tree.flatten builds them: a container's children are "k" at the root,
    "parent/k" below it. From format 1.1 a tensor may be placed more than once (tensors that
    shared memory when saved, stored once); its first placement, in tree order, carries the key
    of its index entry. Paths are built only where a tensor is placed, from a parent chain, and
    the alias paths' total length is bounded, so a deep or wide hostile tree costs time and
    memory in proportion to the index, never more."""
    n_tensors = len(tensors)
    shared = version >= SHARED_TENSORS
    seen = [False] * n_tensors
    paths: dict[str, int] = {}
    alias_chars = 0
    stack = [(node, 0, None, 0)]  # node, depth, path chain (parent chain, segment), path length
    while stack:
        node, depth, chain, length = stack.pop()
        if depth > MAX_DEPTH:
            raise bad(f"skeleton nested deeper than {MAX_DEPTH}")
        if not (isinstance(node, dict) and len(node) == 1):
            raise bad("skeleton node is not a one-key object")
        (kind, body), = node.items()
        if kind == "tensor" or kind in TYPED_PLACEMENTS:
            if not (_is_int(body) and 0 <= body < n_tensors) or (seen[body] and not shared):
                raise bad(f"skeleton refers to tensor {body!r} twice or out of range")
            if kind != "tensor":
                if not shared:
                    raise bad(f"unknown skeleton node kind {kind!r} (format 1.1 and later)")
                if not TYPED_PLACEMENTS[kind](tensors[body]):
                    raise bad(f"skeleton places tensor {body} as {kind}, which a "
                              f"{tensors[body].dtype}{list(tensors[body].shape)} tensor cannot be")
            if not shared:
                seen[body] = True
                continue
            if not seen[body]:
                seen[body] = True
                key = tensors[body].key
                if len(key) != length or _join(chain) != key:
                    raise bad(f"skeleton places tensor {body} first at another path than its key", key=key)
            else:
                alias_chars += length
                if alias_chars > MAX_INDEX_BYTES:
                    raise bad("skeleton's shared-tensor key paths are too long")
                key = _join(chain)
            if key in paths:
                raise bad("two tensor placements share this key path", key=key)
            paths[key] = body
        elif kind == "value":
            if not (body is None or isinstance(body, (bool, int, float, str))):
                raise bad("skeleton value is not a plain value")
        elif kind in ("dict", "odict"):
            if kind == "odict":
                if version < ODICT:
                    raise bad(f"unknown skeleton node kind {kind!r} (format 1.1 and later)")
                if not (isinstance(body, dict) and set(body) <= {"items", "metadata"} and "items" in body):
                    raise bad("skeleton odict body is not an object with items (and metadata)")
                if "metadata" in body and metadata_problem(body["metadata"]):
                    raise bad(f"skeleton odict: {metadata_problem(body['metadata'])}")
                body = body["items"]
            if not isinstance(body, list):
                raise bad(f"skeleton {kind} body is not a list")
            keys = set()  # a dict's keys are distinct: a repeated one would lose the other's value on load
            for item in reversed(body):  # reversed onto the stack: popped in tree order
                if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, int))
                        and not isinstance(item[0], bool)):
                    raise bad(f"skeleton {kind} item is not a [key, node] pair")
                if (type(item[0]), item[0]) in keys:
                    raise bad(f"skeleton {kind} has the key {item[0]!r} twice")
                keys.add((type(item[0]), item[0]))
                seg = str(item[0])
                stack.append((item[1], depth + 1, (chain, seg, depth > 0),
                              length + len(seg) + (depth > 0)))
        elif kind in ("list", "tuple"):
            if not isinstance(body, list):
                raise bad(f"skeleton {kind} body is not a list")
            for i in range(len(body) - 1, -1, -1):
                seg = str(i)
                stack.append((body[i], depth + 1, (chain, seg, depth > 0), length + len(seg) + (depth > 0)))
        else:
            raise bad(f"unknown skeleton node kind {kind!r}")
    if not all(seen):
        raise bad("skeleton does not place every tensor")
    return paths if shared else {t.key: i for i, t in enumerate(tensors)}


def _join(chain) -> str:
    """The key path of a parent chain ((parent chain, segment, needs a "/"), or None at the root)."""
    parts = []
    while chain is not None:
        chain, seg, slash = chain
        parts.append(seg)
        if slash:
            parts.append("/")
    return "".join(reversed(parts))


def _codec(spec, stream: int, bad) -> dict:
    """A stream's codec spec, as its codec validates it (codecs.base.Codec.spec_problem)."""
    codec = codecs.lookup(spec.get("name")) if isinstance(spec, dict) else None
    if codec is None:
        raise bad(f"stream {stream}: unknown codec {spec!r}")
    problem = codec.spec_problem(spec)
    if problem:
        raise bad(f"stream {stream}: {problem}")
    return spec


def _list(doc, name, bad) -> list:
    v = doc.get(name)
    if not isinstance(v, list):
        raise bad(f"{name!r} is not a list")
    return v


def _is_dtype(v) -> bool:
    return isinstance(v, str) and v in dtypes.BY_NAME


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _uint(v, what, bad) -> int:
    if not _is_int(v) or v < 0 or v >= 1 << 62:
        raise bad(f"{what} {v!r} is not a non-negative int")
    return v
