"""Object stores: where checkpoint files go beyond the local disk, chosen by the URL's scheme.

    store = open_store("s3://bucket/run7", timeout=30)
    store.put_file("/ckpt/step_00001000.gdsckpt", "step_00001000.gdsckpt")
    data = store.read("step_00001000.gdsckpt", offset, length)

A store is a root (a bucket and a key prefix); objects are named relative to it. Each scheme has
a factory, `factory(url, **options) -> Store`; "s3" (obstore, gdsckpt/stores/s3.py) is built in.
obstore's GCS and Azure stores fit the same shape: a module that builds the obstore client the way
s3.py does, on top of ObstoreStore, and one `register` line.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable, Protocol


@dataclass
class UploadResult:
    key: str
    bytes: int
    seconds: float
    parts: int

    @property
    def mbps(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds else 0.0


class Store(Protocol):
    """The operations the checkpoint manager and the reader need from an object store. Every call
    is bounded in time (the store's `timeout` option) and fails with a RemoteStoreError subclass
    (gdsckpt/errors.py) that names the bucket and key and never a credential."""

    bucket: str       # the bucket (or container) the root lives in, named in errors
    concurrency: int  # requests a caller may keep in flight at once (parts, ranged reads)
    timeout: float    # seconds within which every request ends, its retries included

    def url(self, name: str = "") -> str:
        """The URL of `name` under the root (of the root itself when name is empty)."""

    def put_file(self, path: str | os.PathLike, name: str) -> UploadResult:
        """The local file at `name`; the object appears only once complete."""

    def put_bytes(self, name: str, data: bytes) -> None: ...

    def get_bytes(self, name: str) -> bytes: ...

    def read(self, name: str, offset: int, length: int) -> bytes:
        """`length` bytes at `offset`; fewer only past the end of the object."""

    def size(self, name: str) -> int: ...

    def list(self, under: str = "") -> dict[str, int]:
        """{name relative to the root: size} of every object under the root (or root/under)."""

    def delete(self, name: str) -> None:
        """Remove the object; no error if it is already gone."""

    def download(self, name: str, path: str | os.PathLike) -> int:
        """The object into the local file `path`, atomically (nothing at `path` on failure); its size."""


StoreFactory = Callable[..., Store]  # factory(url, **options) -> Store

_SCHEME = re.compile(r"^([a-z][a-z0-9+.\-]*)://")
_factories: dict[str, StoreFactory] = {}


def register(scheme: str, factory: StoreFactory) -> None:
    """Open URLs "scheme://..." with `factory(url, **options)`; replaces an earlier registration."""
    if not isinstance(scheme, str) or not re.fullmatch(r"[a-z][a-z0-9+.\-]*", scheme):
        raise ValueError(f"a URL scheme is lower-case letters, digits, '+', '.' or '-', not {scheme!r}")
    _factories[scheme] = factory


def scheme_of(url) -> str | None:
    """"s3" for "s3://bucket/x"; None for anything that is not a "scheme://" string."""
    m = _SCHEME.match(url) if isinstance(url, str) else None
    return m.group(1) if m else None


def is_remote(path) -> bool:
    """Whether `path` is a URL of a registered object store (and not a local path)."""
    return scheme_of(path) in _factories


def open_store(url: str, **options) -> Store:
    """The store rooted at `url` ("s3://bucket/prefix"); options go to the scheme's factory."""
    scheme = scheme_of(url)
    if scheme not in _factories:
        known = ", ".join(f"{s}://" for s in sorted(_factories))
        raise ValueError(f"{url!r} is not an object-store URL (known schemes: {known})")
    return _factories[scheme](url, **options)


def _open_s3(url: str, **options) -> Store:
    from .s3 import S3Store  # obstore is an extra: imported only where an s3:// URL is opened
    return S3Store(url, **options)


register("s3", _open_s3)
