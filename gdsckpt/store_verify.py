"""An object in a store checked against gdsckpt's own checksums: the footer and the index
(validated as any reader validates them), then every chunk record, by ranged reads in parallel.
An upload counts only once this has passed: the upload call's own success is not trusted (a torn
or mangled object fails here, and the caller keeps its local copy)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from . import format as fmt
from .checksum import ALGORITHMS
from .errors import CheckpointFormatError
from .ring import verify_chunk
from .stores import Store


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
