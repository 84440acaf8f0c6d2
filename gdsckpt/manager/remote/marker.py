"""The marker that makes an uploaded step count, step_00001000.gdsckpt.uploaded.json beside the
step's objects, and the identity of the files it lists.

The uploader writes the marker only after every object of the step was read back and verified;
a step counts on the store only with a marker that parses against the schema below and objects
of the recorded sizes, and restore refuses an object whose identity is not the recorded one (an
object replaced by another valid checkpoint of the same size, say).

    {"format": "gdsckpt-upload-marker", "version": 2, "step": 1000,
     "uploaded": 1790000000.0, "host": "node7",
     "files": {"step_00001000.gdsckpt": {"size": 123, "index_checksum": "<16 hex>",
                                         "footer_checksum": "<16 hex>"}}}

A gdsckpt file's identity is its size, the index checksum its footer records (read with the
format module's reader) and the CRC-64/NVME of its footer's bytes (which hold the footer's own
checksum); any other file's (DCP's .metadata) is its size and the SHA-256 of its bytes. Under
torch.distributed the files are "step_00001000/<name>", one per rank plus .metadata.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gdsckpt.format import file as fmt
from gdsckpt.format.checksum import crc64nvme
from gdsckpt.errors import RemoteNotFoundError, RemoteTimeoutError
from gdsckpt.manager.steps import parse_step_name
from gdsckpt.core.storage import pread_exact
from gdsckpt.stores import Store

MARKER = ".uploaded.json"
MARKER_FORMAT = "gdsckpt-upload-marker"
MARKER_VERSION = 2
GDSCKPT_SUFFIX = ".gdsckpt"
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class InvalidMarker(ValueError):
    """A marker object that does not parse against the schema: its step does not count."""


@dataclass(frozen=True)
class FileIdentity:
    """What a file is, cheaply checked: size, and either a gdsckpt file's index and footer
    checksums (16 hex digits each) or another file's SHA-256 (64 hex digits)."""

    size: int
    index_checksum: str | None = None
    footer_checksum: str | None = None
    sha256: str | None = None

    def to_json(self) -> dict:
        doc = {"size": self.size}
        if self.sha256 is None:
            doc.update(index_checksum=self.index_checksum, footer_checksum=self.footer_checksum)
        else:
            doc["sha256"] = self.sha256
        return doc

    def differences(self, other: "FileIdentity") -> list[str]:
        """The fields in which `other` differs from this identity ([] if none)."""
        return [f for f in ("size", "index_checksum", "footer_checksum", "sha256")
                if getattr(self, f) != getattr(other, f)]


def gdsckpt_identity(pread, size: int, label) -> FileIdentity:
    """The identity of a gdsckpt file of `size` bytes read through `pread(n, offset)`; raises
    CheckpointFormatError naming `label` when its footer is damaged."""
    _, _, index_checksum = fmt.read_footer(pread, size, label)
    footer = pread(fmt.FOOTER_SIZE, size - fmt.FOOTER_SIZE)
    return FileIdentity(size, f"{index_checksum:016x}", f"{crc64nvme(footer):016x}")


def file_identity(path: Path, name: str) -> FileIdentity:
    """The identity of the local file `path`, to be known as `name` on the store."""
    if not name.endswith(GDSCKPT_SUFFIX):
        data = path.read_bytes()
        return FileIdentity(len(data), sha256=hashlib.sha256(data).hexdigest())
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        return gdsckpt_identity(lambda n, o: pread_exact(fd, n, o), os.fstat(fd).st_size, path)
    finally:
        os.close(fd)


def object_identity(store: Store, name: str) -> FileIdentity:
    """The identity of the object `name` in `store`, by ranged reads."""
    if not name.endswith(GDSCKPT_SUFFIX):
        data = store.get_bytes(name)
        return FileIdentity(len(data), sha256=hashlib.sha256(data).hexdigest())
    return gdsckpt_identity(lambda n, o: store.read(name, o, n), store.size(name), store.url(name))


@dataclass(frozen=True)
class Marker:
    step: int
    files: dict  # name relative to the store's root -> FileIdentity
    uploaded: float = 0.0
    host: str = ""

    def sizes(self) -> dict[str, int]:
        return {name: ident.size for name, ident in self.files.items()}

    def encode(self) -> bytes:
        return json.dumps({"format": MARKER_FORMAT, "version": MARKER_VERSION, "step": self.step,
                           "uploaded": self.uploaded, "host": self.host,
                           "files": {n: i.to_json() for n, i in self.files.items()}}).encode()


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _identity(name: str, doc) -> FileIdentity:
    if not isinstance(doc, dict):
        raise InvalidMarker(f"files[{name!r}] is {type(doc).__name__}, not an object")
    size = doc.get("size")
    if not _is_int(size) or size < 0:
        raise InvalidMarker(f"files[{name!r}].size is {size!r}, not a non-negative int")
    if name.endswith(GDSCKPT_SUFFIX):
        for field in ("index_checksum", "footer_checksum"):
            if not isinstance(doc.get(field), str) or not _HEX16.match(doc[field]):
                raise InvalidMarker(f"files[{name!r}].{field} is {doc.get(field)!r}, not 16 hex digits")
        return FileIdentity(size, doc["index_checksum"], doc["footer_checksum"])
    if not isinstance(doc.get("sha256"), str) or not _HEX64.match(doc["sha256"]):
        raise InvalidMarker(f"files[{name!r}].sha256 is {doc.get('sha256')!r}, not 64 hex digits")
    return FileIdentity(size, sha256=doc["sha256"])


def _belongs(name, step_name: str) -> bool:
    """Whether `name` is the step's own object: the step's file, or a file directly in its directory."""
    if not isinstance(name, str):
        return False
    if name == step_name:
        return True
    rest = name[len(step_name) + 1:] if name.startswith(step_name + "/") else ""
    return bool(rest) and "/" not in rest and rest not in (".", "..")


def parse_marker(raw: bytes, step: int, step_name: str) -> Marker:
    """The marker of `step` (whose objects are named after `step_name`), validated; InvalidMarker
    says what is wrong. Every file must be one of the step's own objects: a marker never makes
    retention delete, or restore read, anything else. A value the checks below let through but
    that does not convert (an "uploaded" of 10**400: float() overflows) is InvalidMarker too:
    whatever a marker holds, its step only stops counting."""
    try:
        return _parse_marker(raw, step, step_name)
    except InvalidMarker:
        raise
    except (ArithmeticError, ValueError, TypeError) as e:
        raise InvalidMarker(f"a value does not convert ({type(e).__name__}: {e})"[:300]) from None


def _parse_marker(raw: bytes, step: int, step_name: str) -> Marker:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise InvalidMarker("not JSON") from None
    if not isinstance(doc, dict):
        raise InvalidMarker(f"a JSON {type(doc).__name__}, not an object")
    if doc.get("format") != MARKER_FORMAT or doc.get("version") != MARKER_VERSION:
        raise InvalidMarker(f"not a version-{MARKER_VERSION} gdsckpt upload marker (format {doc.get('format')!r}, "
                            f"version {doc.get('version')!r}; an older gdsckpt's markers record no file identity)")
    if doc.get("step") != step or not _is_int(doc.get("step")):
        raise InvalidMarker(f"step is {doc.get('step')!r}, not {step}")
    files = doc.get("files")
    if not isinstance(files, dict) or not files:
        raise InvalidMarker(f"files is {files!r}"[:200] + ", not a non-empty object")
    for name in files:
        if not _belongs(name, step_name):
            raise InvalidMarker(f"files lists {name!r}, which is not an object of {step_name}")
    uploaded, host = doc.get("uploaded", 0.0), doc.get("host", "")
    if isinstance(uploaded, bool) or not isinstance(uploaded, (int, float)) or not isinstance(host, str):
        raise InvalidMarker("uploaded must be a number and host a string")
    return Marker(step, {n: _identity(n, d) for n, d in files.items()}, float(uploaded), host)


def marker_step(name: str) -> tuple[int, bool] | None:
    """(step, distributed) of a marker's object name; None for any other name."""
    return parse_step_name(name[:-len(MARKER)]) if name.endswith(MARKER) else None


def load_marker(store: Store, name: str) -> Marker:
    """The marker object `name`, parsed (InvalidMarker if it does not parse; RemoteStoreError)."""
    parsed = marker_step(name)
    if parsed is None:
        raise InvalidMarker(f"{name!r} is not a marker's name")
    return parse_marker(store.get_bytes(name), parsed[0], name[:-len(MARKER)])


def read_markers(store: Store, distributed: bool, warn: Callable[[str, str], None]) -> dict[int, Marker]:
    """{step: marker} of the steps of that layout (DCP directories or files) uploaded, verified
    and still complete on `store` (every file the marker names listed at its size). A marker that
    does not parse is skipped, `warn(name, why)` told. The listing and the markers' reads together
    end within the store's timeout (RemoteTimeoutError); a marker gone meanwhile is skipped, any
    other failure to read one raised: its step is not known to be gone, and a restore must not
    take an older step without a word."""
    deadline = time.monotonic() + store.timeout
    listing = store.list()
    names = {}
    for name in listing:
        parsed = marker_step(name)
        if parsed and parsed[1] == distributed:
            names[name] = parsed[0]
    if not names:
        return {}
    pool = ThreadPoolExecutor(min(len(names), store.concurrency), thread_name_prefix="gdsckpt-markers")
    try:
        reads = {pool.submit(load_marker, store, name): name for name in names}
        _, late = wait(reads, timeout=max(0.0, deadline - time.monotonic()))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a late read ends within its own bound
    if late:
        raise RemoteTimeoutError(f"reading {len(names)} upload markers: the store did not answer within "
                                 f"{store.timeout:g} s (the store's `timeout` option)",
                                 bucket=store.bucket, code="Timeout")
    out = {}
    for fut, name in reads.items():
        step = names[name]
        try:
            marker = fut.result()
        except RemoteNotFoundError:
            continue  # removed meanwhile
        except InvalidMarker as e:
            warn(name, f"the marker {store.url(name)} is not valid ({e}): step {step} does not count on the store")
            continue
        if all(listing.get(f) == size for f, size in marker.sizes().items()):
            out[step] = marker
    return out
