"""gdsckpt/engine/read_ahead.py: records read ahead of the ring by several threads, in aligned blocks,
into a bounded window of host memory, and copied out in the order the ring asks for them. Run
here with host buffers as the ring's (the copy is the CPU backend's); the GPU tests read a
checkpoint through it into device memory (tests/engine/test_gpu.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

import gdsckpt
from ckpt_tools import flip_chunk_byte
from gdsckpt.engine.backend import make_backend
from gdsckpt.errors import GdsckptError
from gdsckpt.engine.read_ahead import ReadAheadFile
from gdsckpt.reading.reader import open as open_checkpoint
from gdsckpt.core.storage import open_direct
from gdsckpt.engine.ring import ReadsAhead, Timings, read_chunks, read_verified
from gdsckpt.stats import outer_seconds

DATA = os.urandom(300_000)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("ra") / "data.bin"
    p.write_bytes(DATA)
    return p


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def _read(f: ReadAheadFile, ranges) -> list[bytes]:
    bufs = [torch.empty(n, dtype=torch.uint8) for _, n in ranges]
    futures = [f.pread(b, n, off) for b, (off, n) in zip(bufs, ranges)]
    return [bytes(b[:fut.get()].numpy()) for b, fut in zip(bufs, futures)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 30_000)), min_size=1, max_size=12),
       st.integers(1, 4), st.sampled_from([4096, 8192, 65536]))
def test_planned_records_come_back_exact_whatever_the_blocks_and_threads(data_file, layout, threads, block):
    ranges, at = [], 0
    for gap_pages, n in layout:  # increasing, 4 KiB aligned starts: a checkpoint's records
        off = at + gap_pages * 4096
        ranges.append((off, n))
        at = -(-(off + n) // 4096) * 4096
    f = ReadAheadFile(data_file, _copy, threads=threads, block=block)
    way = f.io_path
    try:
        f.will_read(ranges)
        got = _read(f, ranges)
    finally:
        f.close()
    assert got == [DATA[off:off + n] for off, n in ranges]  # fewer bytes only where the file ends
    assert f.io_path == way  # an O_DIRECT read that meets the file's end is not a refusal of O_DIRECT


def test_a_record_outside_the_plan_is_read_on_its_own_and_the_plan_goes_on(data_file):
    f = ReadAheadFile(data_file, _copy, threads=2, block=8192)
    try:
        f.will_read([(0, 10_000), (12_288, 20_000)])
        assert _read(f, [(0, 10_000), (4096, 50), (12_288, 20_000)]) == [DATA[:10_000], DATA[4096:4146],
                                                                         DATA[12_288:32_288]]
        assert _read(f, [(100, 7)]) == [DATA[100:107]]  # no plan left: unaligned is fine too
    finally:
        f.close()


def test_records_waited_for_out_of_order_are_refused(data_file):
    f = ReadAheadFile(data_file, _copy, threads=2, block=8192)
    try:
        f.will_read([(0, 100), (8192, 100)])
        a, b = torch.empty(100, dtype=torch.uint8), torch.empty(100, dtype=torch.uint8)
        fa, fb = f.pread(a, 100, 0), f.pread(b, 100, 8192)
        with pytest.raises(GdsckptError, match="record 1 waited for before record 0"):
            fb.get()
        assert fa.get() == 100 and bytes(a.numpy()) == DATA[:100]
    finally:
        f.close()


def test_a_block_nobody_waits_for_cannot_overwrite_a_later_block(tmp_path):
    """Blocks smaller than the gaps read through: the blocks between two records hold no record,
    and no take waits for them. Their buffers are reused only once their reads are done, else a
    slow one lands in the buffer after the later block's read and the record gets its bytes."""
    data = os.urandom(8 * 4096)
    path = tmp_path / "gap.bin"
    path.write_bytes(data)

    class SlowGap(ReadAheadFile):
        def _read_into(self, into, offset):
            if offset == 4096:  # the gap's first block, read slowly into the buffer block 5 reuses
                time.sleep(0.3)
            return super()._read_into(into, offset)

    f = SlowGap(path, _copy, threads=3, block=4096)
    ranges = [(0, 100), (5 * 4096, 100)]
    try:
        f.will_read(ranges)
        bufs = [torch.empty(n, dtype=torch.uint8) for _, n in ranges]
        futures = [f.pread(b, n, off) for b, (off, n) in zip(bufs, ranges)]
        got = [futures[0].get()]
        time.sleep(0.6)  # the slow read has landed by now
        got.append(futures[1].get())
    finally:
        f.close()
    assert [bytes(b[:n].numpy()) for b, n in zip(bufs, got)] == [data[off:off + n] for off, n in ranges]


def test_a_new_plan_replaces_one_half_read_and_close_stops_the_reads(data_file):
    f = ReadAheadFile(data_file, _copy, threads=3, block=4096)
    f.will_read([(o, 4096) for o in range(0, 290_000, 4096)])
    assert _read(f, [(0, 4096)]) == [DATA[:4096]]
    f.will_read([(8192, 100)])
    assert _read(f, [(8192, 100)]) == [DATA[8192:8292]]
    f.will_read([(o, 4096) for o in range(0, 290_000, 4096)])
    f.close()
    assert f.fd == -1


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs a tmpfs at /dev/shm")
def test_a_file_on_tmpfs_is_read_as_its_file_system_allows():
    """tmpfs refused O_DIRECT until Linux 6.6; either way the bytes come back, and io_path says how."""
    p = Path("/dev/shm") / f"gdsckpt-ra-{os.getpid()}"
    p.write_bytes(DATA)
    try:
        f = ReadAheadFile(p, _copy, threads=2, block=8192)
        try:
            f.will_read([(0, 5000), (8192, 9000)])
            assert _read(f, [(0, 5000), (8192, 9000)]) == [DATA[:5000], DATA[8192:17_192]]
            fd = open_direct(p, os.O_RDONLY)
            assert f.io_path == ("read-ahead-direct" if fd >= 0 else "read-ahead-buffered")
            if fd >= 0:
                os.close(fd)
        finally:
            f.close()
    finally:
        p.unlink()


def _saved(tmp_path) -> tuple[Path, dict]:
    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(20_000 + 777 * i, generator=g) for i in range(12)}
    p = tmp_path / "s.gdsckpt"
    gdsckpt.save(state, p, chunk_bytes=64 << 10)
    return p, state


@pytest.mark.parametrize("atomic", [False, True])
def test_the_ring_reads_a_checkpoint_through_it_exactly(tmp_path, atomic):
    p, state = _saved(tmp_path)
    with open_checkpoint(p) as ck, make_backend("cpu") as be:
        index = ck.index
        ids = [c.index for c in index.plan.chunks]
        out = {t.key: torch.empty(state[t.key].shape) for t in index.plan.tensors}
        views = [out[t.key].view(torch.uint8) for t in index.plan.tensors]
        f = ReadAheadFile(p, be.copy, threads=3, block=16 << 10)
        assert isinstance(f, ReadsAhead)
        try:
            if atomic:  # every record at once, then checked: the plan covers them all
                stored = read_verified(index, ids, be, f, Timings(), p)
                assert [bytes(s.numpy()) for s in stored] == [
                    p.read_bytes()[r.file_offset:r.file_offset + r.stored] for r in index.records]
            else:
                read_chunks(index, ids, views, be, f, 2, Timings(), p)
                assert all(torch.equal(out[k], state[k]) for k in state)
        finally:
            f.close()


def test_a_damaged_record_read_ahead_fails_its_checksum_naming_the_chunk(tmp_path):
    p, state = _saved(tmp_path)
    flip_chunk_byte(p, 10, 1, chunk=3)
    with open_checkpoint(p) as ck, make_backend("cpu") as be:
        ids = [c.index for c in ck.index.plan.chunks]
        views = [torch.empty(t.shape).view(torch.uint8).reshape(-1) for t in ck.index.plan.tensors]
        f = ReadAheadFile(p, be.copy, threads=2, block=16 << 10)
        try:
            with pytest.raises(gdsckpt.ChecksumError, match="chunk 3"):
                read_chunks(ck.index, ids, views, be, f, 2, Timings(), p)
        finally:
            f.close()


def test_a_verify_counting_its_bytes_keeps_the_read_ahead_plan(tmp_path):
    """`gdsckpt verify` counts bytes through a wrapper of the source's ChunkFile: a file that reads
    ahead stays one (the ring's plan reaches it, its stages and io_path reach the Stats)."""
    from gdsckpt.cli.files import _Counted
    from gdsckpt.reading.sources import LocalFile

    class AheadSource(LocalFile):  # a GPU's compat reads, on the CPU backend
        def open_chunks(self, backend):
            return ReadAheadFile(self.label, backend.copy, threads=2, block=16 << 10)

    p, state = _saved(tmp_path)
    counted: list[int] = []
    with open_checkpoint(p) as ck:
        ck.source = _Counted(AheadSource(p), counted.append)
        out = ck.load(device="cpu")
        stats = ck.last_stats
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert stats.io_path.startswith("read-ahead-") and stats.stages["read_ahead_copy"] > 0
    assert outer_seconds(stats.stages) <= stats.seconds  # the read-ahead's stages are inside read_wait
    assert sum(counted) == sum(r.stored for r in ck.index.records)


def _counting_reads(monkeypatch) -> list[int]:
    """The bytes of every read the read-ahead's threads make, as they make them."""
    from gdsckpt.engine import read_ahead
    got: list[int] = []
    preadv = os.preadv

    def counted(fd, bufs, offset):
        n = preadv(fd, bufs, offset)
        got.append(n)
        return n
    monkeypatch.setattr(read_ahead.os, "preadv", counted)
    return got


@pytest.mark.parametrize("atomic", [False, True])
def test_a_whole_read_expected_at_open_keeps_the_reads_begun_before_its_plan(tmp_path, monkeypatch, atomic):
    """`expect` starts reading a file's records before the plan is made (a whole restore, while its
    index is parsed); the ring's plan of every record then takes those reads over: each byte is
    read once, and the records come back exact."""
    from gdsckpt.format.file import HEADER_SIZE
    p, state = _saved(tmp_path)
    with open_checkpoint(p) as ck, make_backend("cpu") as be:
        index = ck.index
        ids = [c.index for c in index.plan.chunks]
        end = max(r.file_offset + r.stored for r in index.records)
        reads = _counting_reads(monkeypatch)
        f = ReadAheadFile(p, threads=3, block=16 << 10)
        try:
            f.expect(HEADER_SIZE, -(-end // 4096) * 4096, widest=max(r.stored for r in index.records))
            time.sleep(0.05)  # the window's reads run before the plan comes
            assert sum(reads) > 0
            f.copy = be.copy
            if atomic:
                stored = read_verified(index, ids, be, f, Timings(), p)
                assert [bytes(s.numpy()) for s in stored] == [
                    p.read_bytes()[r.file_offset:r.file_offset + r.stored] for r in index.records]
            else:
                out = {t.key: torch.empty(state[t.key].shape) for t in index.plan.tensors}
                read_chunks(index, ids, [out[t.key].view(torch.uint8) for t in index.plan.tensors], be, f, 2,
                            Timings(), p)
                assert all(torch.equal(out[k], state[k]) for k in state)
        finally:
            f.close()
    assert sum(reads) == -(-end // 4096) * 4096 - HEADER_SIZE  # every block once: none read again
    assert f.stages["read_ahead_before_plan"] >= 0.05  # the reads ran from `expect` until the plan came


@pytest.mark.parametrize("case", ["some records", "wider records than expected"])
def test_a_plan_unlike_the_expected_one_replaces_it_and_reads_exactly(tmp_path, case):
    from gdsckpt.format.file import HEADER_SIZE
    p, state = _saved(tmp_path)
    with open_checkpoint(p) as ck, make_backend("cpu") as be:
        index = ck.index
        ids = [c.index for c in index.plan.chunks][::2] if case == "some records" else [
            c.index for c in index.plan.chunks]
        end = max(r.file_offset + r.stored for r in index.records)
        f = ReadAheadFile(p, be.copy, threads=2, block=8 << 10)
        try:
            # "wider": a window sized for records of 4 KiB cannot hold the plan's widest record beside
            # its threads' reads; the plan starts its own
            f.expect(HEADER_SIZE, -(-end // 4096) * 4096, widest=4096 if case != "some records" else 64 << 10)
            stored = read_verified(index, ids, be, f, Timings(), p)
        finally:
            f.close()
        assert "read_ahead_before_plan" not in f.stages
        whole = p.read_bytes()
        assert [bytes(s.numpy()) for s in stored] == [
            whole[index.records[i].file_offset:index.records[i].file_offset + index.records[i].stored] for i in ids]


def test_a_whole_restore_whose_ring_reads_otherwise_drops_the_reads_begun_at_open(tmp_path, monkeypatch):
    """load_into starts reading a local file at open where the ring will read it ahead into a GPU;
    here the ring runs on the CPU backend (a file of zstd chunks into host tensors), so those reads
    are dropped and their threads stopped, and the restore reads exactly through the backend's own
    file. (Where the GPU reads it, tests/engine/test_gpu.py.)"""
    import threading
    from gdsckpt.reading import sources
    p, state = _saved(tmp_path)
    monkeypatch.setattr(sources, "gpu_io_path", lambda io: "compat")  # as on a GPU host without GDS
    before = {t.ident for t in threading.enumerate()}
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    stats = gdsckpt.load_into(p, target, atomic=True)
    assert all(torch.equal(target[k], state[k]) for k in state)
    assert stats.io_path == "cpu"
    assert not [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("gdsckpt-read-ahead")]
