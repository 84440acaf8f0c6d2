"""gdsckpt/reading/sources.py: where a checkpoint's bytes come from when it is read. A local file held
open (reads go to the file opened, even after a save renames another over its path), and an
object in a store read by ranged GETs (against a real S3 server, tests/s3_server.py)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import gdsckpt
from gdsckpt.reading import sources
from gdsckpt.engine.backend import make_backend
from gdsckpt.stores import open_store


def _save(p, value: float, n: int = 5000):
    gdsckpt.save({"w": torch.full((n,), value)}, p, codec="raw")
    return p.read_bytes()


def _read_chunk(source, be, nbytes: int, offset: int) -> bytes:
    """`nbytes` at `offset` through the ring's ChunkFile of `source` on the CPU backend `be`."""
    buf = be.empty(nbytes)
    file = source.open_chunks(be)
    try:
        got = file.pread(buf, nbytes, offset).get()
    finally:
        file.close()
    return bytes(buf.numpy()[:got])


def test_open_source_picks_a_local_file_or_a_store_object(tmp_path):
    p = tmp_path / "a.gdsckpt"
    data = _save(p, 1.0)
    src = sources.open_source(sources.locate(str(p)))
    try:
        assert isinstance(src, sources.LocalFile) and src.label == p and src.size == len(data)
        assert src.pread(16, 0) == data[:16] and src.pread(64, len(data) - 10) == data[-10:]  # fewer past the end
    finally:
        src.close()
    with pytest.raises(TypeError, match="path must be a str or os.PathLike"):
        sources.locate(None)
    assert sources.locate("s3://bucket/run/x.gdsckpt") == "s3://bucket/run/x.gdsckpt"


def test_trusted_false_refuses_a_store_object_before_asking_the_store(monkeypatch):
    # no endpoint, no credentials: any request would fail with a RemoteStoreError, not this
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="trusted=False reads local files only"):
        sources.open_source("s3://no-such-bucket-here/x.gdsckpt", trusted=False)


def test_a_local_file_reads_the_file_it_opened_after_a_save_replaced_the_path(tmp_path):
    p = tmp_path / "a.gdsckpt"
    old = _save(p, 1.0)
    src = sources.LocalFile(p)
    try:
        new = _save(p, 2.0)  # renamed over the path: another inode
        assert new != old and os.stat(p).st_ino != src.identity[1]
        assert src.pread(len(old), 0) == old
        with make_backend("cpu") as be:
            assert _read_chunk(src, be, len(old), 0) == old  # the ring's file: /proc/self/fd, the same inode
        child = src.child_file()
        assert child.path == f"/proc/self/fd/{child.fd}" and child.identity == src.identity
        assert os.stat(child.path).st_ino == src.identity[1]
    finally:
        src.close()


def test_a_closed_local_file_reads_by_path_and_refuses_a_replaced_file(tmp_path):
    p = tmp_path / "a.gdsckpt"
    old = _save(p, 1.0)
    src = sources.LocalFile(p)
    src.close()
    src.close()  # twice: a no-op
    assert src.pread(32, 0) == old[:32]  # the same file, by its path
    child = src.child_file()
    assert child.fd is None and child.path == str(p)
    _save(p, 2.0)
    with pytest.raises(gdsckpt.CheckpointFormatError, match="replaced since it was opened") as ei:
        src.pread(32, 0)
    assert str(p) in str(ei.value)
    with make_backend("cpu") as be, pytest.raises(gdsckpt.CheckpointFormatError, match="replaced since it was opened"):
        src.open_chunks(be)


def test_a_local_file_closes_its_descriptor_when_collected(tmp_path):
    p = tmp_path / "a.gdsckpt"
    _save(p, 1.0)
    before = len(os.listdir("/proc/self/fd"))
    src = sources.LocalFile(p)
    assert len(os.listdir("/proc/self/fd")) == before + 1
    del src
    assert len(os.listdir("/proc/self/fd")) == before


def test_not_a_regular_file_is_refused_without_hanging(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    result = []
    t = threading.Thread(target=lambda: result.append(_refusal(fifo)), daemon=True)
    t.start()
    t.join(10)
    assert result and "not a regular file" in result[0]
    assert "not a regular file" in _refusal(tmp_path)


def _refusal(path) -> str:
    try:
        sources.LocalFile(path)
    except gdsckpt.CheckpointFormatError as e:
        return str(e)
    return "opened"


def _upload(tmp_path, s3_server) -> tuple[str, bytes]:
    p = tmp_path / "x.gdsckpt"
    data = _save(p, 3.0, n=40_000)
    bucket = s3_server.new_bucket("sources")
    open_store(f"s3://{bucket}/run").put_file(p, "x.gdsckpt")
    return f"s3://{bucket}/run/x.gdsckpt", data


def test_a_store_object_reads_ranges_of_the_object(tmp_path, s3_server, s3_env):
    url, data = _upload(tmp_path, s3_server)
    src = sources.open_source(sources.locate(url))
    assert isinstance(src, sources.StoreObject) and src.label == url and src.size == len(data)
    assert src.pread(100, 4096) == data[4096:4196]
    with make_backend("cpu") as be:  # the CPU's ChunkFile: ranged GETs into host buffers
        assert _read_chunk(src, be, 50_000, 4096) == data[4096:54_096]
        assert _read_chunk(src, be, 64, len(data) - 8) == data[-8:]
        file = src.open_chunks(be)
        try:
            with pytest.raises(gdsckpt.GdsckptError, match="opened for reading"):
                file.pwrite(be.empty(8), 8, 0)
            assert file.fd is None
        finally:
            file.close()
    with pytest.raises(ValueError, match="local files only"):
        src.child_file()
    src.close()


@pytest.mark.parametrize("tail", ["run//x.gdsckpt", "run/./x.gdsckpt", "run/x.gdsckpt/.", "/run/x.gdsckpt"])
def test_a_store_object_url_with_an_empty_or_dot_segment_is_refused(tmp_path, s3_server, s3_env, tail):
    """S3 keys are not paths: "run//x.gdsckpt" is not the object "run/x.gdsckpt" (which exists
    here), so it is refused as open_store refuses such a prefix, never read as the other one."""
    url, _ = _upload(tmp_path, s3_server)
    bucket = url.split("/")[2]
    with pytest.raises(ValueError, match="empty|'.'|not an object"):
        sources.StoreObject(f"s3://{bucket}/{tail}")
    with pytest.raises(ValueError, match="empty"):
        gdsckpt.open(f"s3://{bucket}/run//x.gdsckpt")
    assert sources.StoreObject(url).size > 0
