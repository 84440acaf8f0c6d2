"""Test helpers: take a checkpoint file apart and put it back together.

`rebuild` writes a file around a modified JSON index with a correct index checksum and
footer, so that what a hostile-index test exercises is the index validation itself and not
the checksums in front of it.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import sys

from gdsckpt.format import file as fmt
from gdsckpt.format.checksum import checksum


def split(data: bytes) -> tuple[bytes, dict, int]:
    """(bytes before the index, parsed index, index offset) of an intact file."""
    body = data[-fmt.FOOTER_SIZE:-8]
    _, _, _, _, off, length, _, _, _ = fmt._FOOTER.unpack(body)
    return data[:off], json.loads(data[off:off + length]), off


def footer(index_offset: int, index: bytes, *, major=fmt.MAJOR, minor=fmt.MINOR, flags=0, index_length=None,
           index_checksum=None, file_len=None, reserved=bytes(8), magic=fmt.FOOTER_MAGIC) -> bytes:
    """A footer with a valid footer checksum around whatever fields it is given."""
    body = fmt._FOOTER.pack(
        magic, major, minor, flags, index_offset, len(index) if index_length is None else index_length,
        checksum(index) if index_checksum is None else index_checksum,
        index_offset + len(index) + fmt.FOOTER_SIZE if file_len is None else file_len, reserved)
    return body + struct.pack("<Q", checksum(body))


def rebuild(data: bytes, index, *, data_area: bytes | None = None, **footer_fields) -> bytes:
    """A checkpoint with the data area of `data` (or `data_area`), the index `index` (a dict,
    dumped as the writer does, or raw bytes) and a valid footer (fields overridable)."""
    head, _, off = split(data)
    if data_area is not None:
        head = data_area
        off = fmt.align_up(len(head))
        head = head + bytes(off - len(head))
    raw = index if isinstance(index, bytes) else json.dumps(index, separators=(",", ":")).encode()
    return head + raw + footer(off, raw, **footer_fields)


def covered_ranges(data: bytes) -> list[tuple[int, int]]:
    """The byte ranges [start, end) a reader reads (and checks) in an intact file: the header's
    magic and version, every chunk record's stored bytes, the index and the footer. Everything
    else is zero padding that nothing reads."""
    _, doc, off = split(data)
    out = [(0, 12)]
    out += [(c["file_offset"], c["file_offset"] + c["stored"]) for c in doc["chunks"]]
    out.append((off, len(data)))
    return out


def set_chunk(data: bytes, doc: dict, i: int, stored: bytes, **fields) -> tuple[bytes, dict]:
    """Replace chunk i's stored bytes in place (same record, recomputed checksum): a hostile
    chunk that passes its checksum. Returns the new data area and index."""
    head, _, _ = split(data)
    rec = doc["chunks"][i]
    assert len(stored) <= fmt.align_up(rec["file_offset"] + rec["stored"]) - rec["file_offset"] or \
        i == len(doc["chunks"]) - 1
    area = bytearray(head)
    end = rec["file_offset"] + len(stored)
    if end > len(area):
        area += bytes(end - len(area))
    area[rec["file_offset"]:rec["file_offset"] + rec["stored"]] = bytes(rec["stored"])
    area[rec["file_offset"]:end] = stored
    rec.update(stored=len(stored), checksum=f"{checksum(stored):016x}", **fields)
    return bytes(area), doc


def make_state(k: int, mb: float = 2.0) -> dict:
    """A deterministic training-like state of about `mb` MB, told apart by its "id" k (the same
    bytes in every process: subprocess tests rebuild it to compare)."""
    import torch

    g = torch.Generator().manual_seed(1000 + k)
    n = int(mb * (1 << 20)) // 10  # float32 weights + bf16 copy + float32 moment ~ 10 bytes per element
    w = torch.randn(n, generator=g)
    return {
        "id": k,
        "model": {"w": w, "w_bf16": (w * 0.02).to(torch.bfloat16), "bias": torch.full((1000,), float(k))},
        "optim": {"exp_avg": w * 0.1, "step": torch.tensor(k, dtype=torch.int64)},
        "meta": {"step": k, "lr": 1e-3 * (k + 1), "tag": f"state {k}"},
    }


def flip_chunk_byte(path, at: int, mask: int, chunk: int = 0) -> None:
    """XOR byte `at` of chunk record `chunk` in a checkpoint file with `mask`, in place."""
    import gdsckpt
    with gdsckpt.open(path) as ck:
        off = ck.index.records[chunk].file_offset + at
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ mask]))


def file_declaring(spec: dict, tmp_path) -> tuple:
    """(path, stream): a file whose float32 stream is declared `spec`, its chunk records otherwise
    intact (zstd-compressed: a reader refuses or decodes them by what the spec says)."""
    import torch

    import gdsckpt
    p = tmp_path / "base.gdsckpt"
    gdsckpt.save({"w": torch.randn(100_000), "i": torch.arange(1000)}, p, codec="zstd", chunk_bytes=64 << 10)
    data = p.read_bytes()
    _, doc, _ = split(data)
    s = next(i for i, st in enumerate(doc["streams"]) if st["dtype"] == "float32")
    doc["streams"][s]["codec"] = spec
    for c in doc["chunks"]:
        if c["stream"] == s and not spec.get("frame_bytes"):
            c.pop("frames", None)
    out = tmp_path / "declared.gdsckpt"
    out.write_bytes(rebuild(data, doc))
    return out, s


# Torch and torch.distributed, imported once per session by the server that forks the ranks
# (multiprocessing's "forkserver"): a spawned rank imports them afresh, 4-5 s of CPU per rank on
# the 2-core host, and the suite starts about a hundred ranks (24 in test_peer_replicas alone).
RANK_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.device_mesh",
                "torch.distributed.checkpoint"]


def start_ranks(fn, args: tuple = (), nprocs: int = 2, join: bool = True):
    """torch.multiprocessing.start_processes(fn, args, nprocs, join), each rank a real process of its
    own: forked from a server that imported only RANK_PRELOAD (no pytest, no threads, nothing of
    the test's), not spawned. A rank runs with the caller's environment and working directory as
    they are at this call, as a spawned one would (the server's are those of its start)."""
    import multiprocessing
    import torch.multiprocessing as mp
    multiprocessing.set_forkserver_preload(RANK_PRELOAD)  # read when the server starts (first call)
    return mp.start_processes(_rank_as_spawned, args=(fn, dict(os.environ), os.getcwd(), *args), nprocs=nprocs,
                              join=join, start_method="forkserver")


def join_ranks(ctx, what: str, timeout: float) -> None:
    """Join the ranks of start_ranks(join=False); a rank's error is raised here, and ranks still
    running after `timeout` seconds (a collective one rank never joins) are killed and fail the test."""
    import time
    import pytest
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{what}: the ranks hung for {timeout}s")


def _rank_as_spawned(rank: int, fn, env: dict, cwd: str, *args) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fn(rank, *args)


def end_rank() -> None:
    """A spawned rank's last call, once its work passed and destroy_process_group returned: exit
    now, without the interpreter's finalization. At a normal exit torch's ProcessGroupGloo
    worker thread (runLoop) may still be destroying its last AsyncAllgatherWork, whose tensors
    Python made; its decref takes the GIL while Py_FinalizeEx runs, Python ends the thread
    (pthread_exit), and the forced unwind through a noexcept destructor calls std::terminate:
    SIGABRT after the rank's assertions passed (a core dump's backtrace, 2026-11-24;
    pytorch/pytorch#179291, destroy the groups at exit, was abandoned). Without finalization
    the race is gone: 40 runs of the 2-rank memory-tier test under load on the 2-core VM,
    0 aborts, against 2 in 40 with a normal exit (2026-11-24). A rank that raised exits
    normally, and torch.multiprocessing reports its error."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def logged(name: str = "gdsckpt", level: int = logging.NOTSET) -> list[str]:
    """The messages logged under `name` at `level` or above in this process from now on (a child
    rank's, which pytest's caplog does not reach)."""
    said: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger(name).addHandler(handler)
    return said
