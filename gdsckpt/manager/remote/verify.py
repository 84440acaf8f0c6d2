"""An object in a store checked against gdsckpt's own checksums: the footer and the index
(validated as any reader validates them), then every chunk record, by ranged reads in parallel.
An upload counts only once this has passed: the upload call's own success is not trusted (a torn
or mangled object fails here, and the caller keeps its local copy). And an uploaded step checked
as restore checks it, and then in full (check_uploaded): remote retention's and the CLI's checks."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from gdsckpt.format import file as fmt
from gdsckpt.format.checksum import ALGORITHMS
from gdsckpt.errors import CheckpointFormatError
from gdsckpt.engine.ring import verify_chunk
from gdsckpt.manager.steps import SUFFIX
from gdsckpt.stores import Store
from .marker import FileIdentity, Marker, object_identity


def verify_object(store: Store, name: str, *, expected_size: int | None = None) -> dict:
    """Raises CheckpointFormatError / ChecksumError naming the object's URL, the key and the chunk,
    or RemoteStoreError. `store.concurrency` chunk records are read (and held in memory) at once."""
    url = store.url(name)
    size = store.size(name)
    if expected_size is not None and size != expected_size:
        raise CheckpointFormatError(f"the object is {size} bytes but the local file is {expected_size}: "
                                    "a torn or partial upload", path=url)
    t = time.perf_counter()
    index = fmt.read_index(lambda n, o: store.read(name, o, n), size, url)
    algorithm = ALGORITHMS[index.checksum]
    plan, records = index.plan, index.records

    def check(i):
        rec, chunk = records[i], plan.chunks[i]
        data = store.read(name, rec.file_offset, rec.stored)
        key = plan.tensors[chunk.segments[0].tensor].key if chunk.segments else None
        verify_chunk(len(data), algorithm(data) if len(data) == rec.stored else 0, rec, url, key, i)
        return rec.stored

    checked = 0
    with ThreadPoolExecutor(store.concurrency, thread_name_prefix="gdsckpt-store-verify") as pool:
        pending = []
        for i in range(len(records)):
            pending.append(pool.submit(check, i))
            if len(pending) >= store.concurrency:
                checked += pending.pop(0).result()
        for f in pending:
            checked += f.result()
    return {"url": url, "bytes": size, "chunks": len(records), "stored_bytes": checked,
            "seconds": time.perf_counter() - t}


# What an object no longer the file its marker records is called (restore's and the CLI's checks).
REPLACED = "the object is not the file uploaded as step {step} (replaced since?)"


def check_identity(want: FileIdentity, got: FileIdentity, where: str, what: str) -> None:
    """CheckpointFormatError naming `where` if `got` is not the identity the marker recorded."""
    differ = want.differences(got)
    if differ:
        raise CheckpointFormatError(f"{what}: its {', '.join(differ)} differ from the upload marker's", path=where)


def check_uploaded(store: Store, marker: Marker, verified: dict | None = None) -> None:
    """CheckpointFormatError (a ChecksumError for a chunk) naming the object, unless the marker's
    step can be restored from `store`: every object it lists still the file uploaded (its
    identity, as restore checks it) and every chunk of its gdsckpt objects passing its checksum.
    A chunk damaged since the upload leaves the footer and index, hence the identity, as they
    were: only the full read finds it. verified: {(object, identity): None if read in full and
    intact, else the damage found}, so that each is read once (it is filled in)."""
    verified = {} if verified is None else verified
    what = REPLACED.format(step=marker.step)
    for rel, want in marker.files.items():
        check_identity(want, object_identity(store, rel), store.url(rel), what)
        if not rel.endswith(SUFFIX):
            continue  # its identity is the SHA-256 of all its bytes
        if (rel, want) not in verified:
            try:
                verify_object(store, rel, expected_size=want.size)
                verified[rel, want] = None
            except CheckpointFormatError as e:
                verified[rel, want] = e
        if verified[rel, want] is not None:
            raise verified[rel, want]
