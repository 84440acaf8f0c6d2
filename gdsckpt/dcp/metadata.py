"""A DCP checkpoint's `.metadata`, its commit point: DCP's Metadata object, pickled as DCP's
FileSystemWriter pickles it (so that FileSystemReader and DCP's tools read it too), then a
16-byte trailer that pickle readers never reach: b"GDSCKMD1" and the CRC-64/NVME of the pickle.

Reading never runs code from the file: the pickle is read by an unpickler that builds only
DCP's metadata classes and the torch values they hold (an allowlist, below), so a payload that
asks for anything else (os.system, eval, torch.load, ...) is refused before it is built. The
trailer's checksum finds damage the pickle itself would accept (a flipped byte in a key, a size
or a file name). Either way, and for a file truncated or empty, the error is a
CheckpointFormatError naming the file: the checkpoint manager then falls back to an older step.
A `.metadata` with no trailer (written by gdsckpt before it had one, or by FileSystemWriter) is
read through the same allowlist, with no checksum to check.

Writing pickles a Metadata of a tensor or more per write item, which holds the GIL on DCP's
background thread for milliseconds per thousand tensors, and DCP hands every save of one
layout the same Metadata object (its plan cache): `metadata_pickle` pickles it once per
layout, with stand-in ids, and then patches each save's checkpoint_id and save_id into the
bytes, which are then exactly what pickle.dumps makes. After the commit DCP broadcasts the
coordinator's Metadata to every rank, pickled again: CachedSavePlanner hands DCP a
`PreparedMetadata`, whose pickle is that same prepared one.
"""

from __future__ import annotations

import contextlib
import copy
import io
import pickle
import struct
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from gdsckpt.format.checksum import crc64nvme
from ..errors import CheckpointFormatError
from gdsckpt.core.storage import atomic_file, pwrite_all

__all__ = ["write_metadata", "read_metadata", "metadata_pickle", "PreparedMetadata", "TRAILER_MAGIC",
           "MAX_METADATA_BYTES"]

TRAILER_MAGIC = b"GDSCKMD1"
_TRAILER = struct.Struct("<8sQ")  # magic, CRC-64/NVME of the pickle before it
MAX_METADATA_BYTES = 1 << 30  # as format.MAX_INDEX_BYTES: a reader allocates no more for it

# What a pickled Metadata refers to, found by pickling real ones (tensors of every dtype,
# DTensor shards, byte items, an optimizer's state; torch 2.11-2.13): DCP's metadata classes,
# and torch's dtypes, sizes, layouts (by name, through torch.serialization._get_layout) and
# memory formats (through the _MEM_FORMAT_ENCODING enum). Nothing else is ever built.
_DCP_CLASSES = frozenset({"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                          "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"})
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


def write_metadata(path: Path, metadata: Metadata) -> None:
    """`metadata` to `path`, atomically and durably (storage.atomic_file), with its trailer."""
    data = metadata_pickle(metadata)
    with atomic_file(path) as f:
        pwrite_all(f.fd, data + _TRAILER.pack(TRAILER_MAGIC, crc64nvme(data)), 0)


class PreparedMetadata(Metadata):
    """DCP's Metadata, pickled as `metadata_pickle` pickles it (prepared once per layout): its
    pickle unpickles, without gdsckpt, as the plain Metadata the `.metadata` file holds."""

    def __reduce_ex__(self, protocol):
        return pickle.loads, (metadata_pickle(self),)

    @classmethod
    def of(cls, metadata: Metadata) -> "PreparedMetadata":
        """`metadata` as a PreparedMetadata holding the same objects (itself if it is one)."""
        if isinstance(metadata, cls):
            return metadata
        prepared = cls.__new__(cls)
        prepared.__dict__.update(vars(metadata))
        return prepared


def _plain(metadata: Metadata) -> Metadata:
    """A PreparedMetadata as the plain Metadata it stands for (the same objects); any other as it is."""
    if not isinstance(metadata, PreparedMetadata):
        return metadata
    plain = Metadata.__new__(Metadata)
    plain.__dict__.update(vars(metadata))
    return plain


_IDS = ("checkpoint_id", "save_id")  # StorageMeta's per-save strings, patched into a prepared pickle


@dataclass(eq=False)
class _PreparedPickle:
    rest: tuple  # (name, value) of the metadata's other attributes (held: compared by identity)
    meta_rest: tuple  # (name, value) of storage_meta's other attributes (compared by value)
    id_lengths: tuple  # the UTF-8 lengths of the ids
    data: bytes  # the pickle, with stand-in ids
    at: tuple  # where each id's bytes start in data, in order


_PREPARED: list[_PreparedPickle] = []  # the last few, newest last
_PREPARED_MAX = 4
_LOCK = threading.Lock()


def metadata_pickle(metadata: Metadata) -> bytes:
    """pickle.dumps(metadata), from a pickle prepared once per layout where it can be: the
    same objects in every attribute of `metadata` but storage_meta, and in storage_meta the
    same values but string ids of the same lengths. A PreparedMetadata is pickled as the plain
    Metadata it stands for."""
    meta = metadata.storage_meta
    if type(meta) is not StorageMeta or not all(isinstance(getattr(meta, k, None), str) for k in _IDS):
        return pickle.dumps(_plain(metadata))
    ids = tuple(getattr(meta, k).encode("utf-8", "surrogatepass") for k in _IDS)  # as pickle encodes str
    rest = tuple((k, v) for k, v in vars(metadata).items() if k != "storage_meta")
    meta_rest = tuple((k, v) for k, v in vars(meta).items() if k not in _IDS)
    lengths = tuple(len(b) for b in ids)
    with _LOCK:
        prepared = next((p for p in reversed(_PREPARED) if p.id_lengths == lengths and p.meta_rest == meta_rest
                         and len(p.rest) == len(rest)
                         and all(a == b and v is w for (a, v), (b, w) in zip(p.rest, rest))), None)
    if prepared is None:
        prepared = _prepare(metadata, lengths, rest, meta_rest)
        if prepared is None:
            return pickle.dumps(_plain(metadata))
        with _LOCK:
            _PREPARED.append(prepared)
            del _PREPARED[:-_PREPARED_MAX]
    parts, last = [], 0
    for at, value in zip(prepared.at, ids):
        parts += [prepared.data[last:at], value]
        last = at + len(value)
    parts.append(prepared.data[last:])
    return b"".join(parts)


def _prepare(metadata: Metadata, lengths: tuple, rest: tuple, meta_rest: tuple) -> _PreparedPickle | None:
    """The pickle of `metadata` with ASCII stand-ins of the ids' lengths, and where they are;
    None where a stand-in is not found exactly once (short ids can match other bytes)."""
    stand_ins = [(uuid.uuid4().hex * (n // 32 + 1))[:n].encode() for n in lengths]
    shown = Metadata.__new__(Metadata)  # a plain one: a PreparedMetadata's pickle is this one's
    shown.__dict__.update(vars(metadata))
    shown.storage_meta = copy.copy(metadata.storage_meta)
    for k, value in zip(_IDS, stand_ins):
        setattr(shown.storage_meta, k, value.decode())
    data = pickle.dumps(shown)
    at = tuple(data.find(v) for v in stand_ins)
    if any(data.count(v) != 1 for v in stand_ins) or list(at) != sorted(at) or \
            any(a + len(v) > b for a, v, b in zip(at, stand_ins, at[1:])):
        return None
    return _PreparedPickle(rest, meta_rest, lengths, data, at)


def read_metadata(path: Path) -> Metadata:
    """The Metadata in `path`, checked; CheckpointFormatError naming `path` if it is damaged,
    empty or not DCP metadata, or refers to anything outside the allowlist. OSError (a missing
    file) is raised as it is."""
    with open(path, "rb") as f:
        data = f.read(MAX_METADATA_BYTES + 1)
    if len(data) > MAX_METADATA_BYTES:
        raise CheckpointFormatError(f"the DCP metadata is larger than {MAX_METADATA_BYTES} bytes", path=path)
    if len(data) >= _TRAILER.size and data[-_TRAILER.size:-8] == TRAILER_MAGIC:
        data, (_, checksum) = data[:-_TRAILER.size], _TRAILER.unpack(data[-_TRAILER.size:])
        if crc64nvme(data) != checksum:
            raise CheckpointFormatError("the DCP metadata does not match its checksum: the file is damaged", path=path)
    stream = io.BytesIO(data)
    try:
        with _classes_kept(path):
            metadata = _AllowlistUnpickler(stream, path).load()
    except CheckpointFormatError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a damaged pickle makes the unpickler raise
        raise CheckpointFormatError(f"the DCP metadata cannot be read ({type(e).__name__}: {e}); the file is "
                                    "damaged or truncated", path=path) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointFormatError(f"the file holds a {type(metadata).__name__}, not DCP metadata", path=path)
    if stream.tell() != len(data):
        raise CheckpointFormatError("bytes follow the DCP metadata: the file is damaged", path=path)
    return metadata


class _AllowlistUnpickler(pickle.Unpickler):
    """pickle.Unpickler that builds DCP's metadata classes and torch's dtype, Size, layout and
    memory-format values only: every callable a pickle can call comes through find_class."""

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if module == dcp_metadata.__name__ and name in _DCP_CLASSES:
            return getattr(dcp_metadata, name)
        if module == "torch":
            if name == "Size":
                return torch.Size
            value = getattr(torch, name, None) if name.isidentifier() else None
            if isinstance(value, _TORCH_VALUES):
                return value
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout
        if module.startswith("torch.distributed.checkpoint.") and name.lstrip("_")[:1].isupper():
            # a class of DCP's that only another StorageWriter pickles (FileSystemWriter's _StorageInfo)
            raise CheckpointFormatError(
                f"this checkpoint was not written by GdsckptWriter (its metadata holds {module}.{name}, which only "
                "another StorageWriter writes); read it with the StorageReader that wrote it, e.g. "
                "FileSystemReader", path=self.path)
        raise CheckpointFormatError(f"the DCP metadata asks for {module}.{name}, which DCP metadata never holds: "
                                    "refused, nothing of it was run", path=self.path)

    def persistent_load(self, pid):
        raise CheckpointFormatError("the DCP metadata holds a persistent id, which DCP metadata never does",
                                    path=self.path)


@contextlib.contextmanager
def _classes_kept(path: Path):
    """A pickle's BUILD can set attributes on any object it holds, classes included: the
    allowlisted classes must leave the unpickling as they entered it (else they are restored,
    and the file refused)."""
    classes = [getattr(dcp_metadata, name) for name in sorted(_DCP_CLASSES)]
    before = [dict(vars(c)) for c in classes]
    try:
        yield
    finally:
        changed = []
        for cls, attrs in zip(classes, before):
            now = vars(cls)
            if now.keys() != attrs.keys() or any(now[k] is not v for k, v in attrs.items()):
                changed.append(cls.__name__)
                for k in set(now) - set(attrs):
                    delattr(cls, k)
                for k, v in attrs.items():
                    if now.get(k) is not v:
                        setattr(cls, k, v)
        if changed:
            raise CheckpointFormatError(f"the DCP metadata sets attributes of {', '.join(changed)}, which DCP "
                                        "metadata never does: refused", path=path)


def _layout(name: str) -> torch.layout:
    """torch.serialization._get_layout, for names of torch layouts only."""
    try:
        return _LAYOUTS[name]
    except (KeyError, TypeError):
        raise ValueError(f"{name!r} is not a torch layout") from None
