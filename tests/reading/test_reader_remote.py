"""gdsckpt.open("s3://...") against a real S3 server (SeaweedFS, tests/s3_server.py): the footer
and index by ranged GETs, then only the chunk records of the tensors asked for."""

from __future__ import annotations

import pytest
import torch

import gdsckpt
from gdsckpt.reading.sources import StoreObject
from gdsckpt.stores import open_store
from conftest import assert_same


def _state():
    g = torch.Generator().manual_seed(3)
    return {"model": {"a": torch.randn(200_000, generator=g), "b": torch.randn(70_000, generator=g).to(torch.bfloat16),
                      "ids": torch.arange(50_000)}, "step": 12, "note": "remote"}


def _put(tmp_path, s3_server, state, **save_kw) -> str:
    bucket = s3_server.new_bucket("open")
    p = tmp_path / "x.gdsckpt"
    gdsckpt.save(state, p, chunk_bytes=64 << 10, **save_kw)
    open_store(f"s3://{bucket}/run").put_file(p, "x.gdsckpt")
    return f"s3://{bucket}/run/x.gdsckpt"


def test_open_s3_lists_keys_and_reads_one_tensor_by_ranged_reads(tmp_path, s3_server, s3_env, monkeypatch):
    state = _state()
    url = _put(tmp_path, s3_server, state)
    reads = []
    real = StoreObject.pread
    monkeypatch.setattr(StoreObject, "pread", lambda self, n, o: reads.append((o, n)) or real(self, n, o))
    with gdsckpt.open(url) as ck:
        assert set(ck.keys()) == {"model/a", "model/b", "model/ids"}
        n_index_reads = len(reads)
        ids = ck.get_tensor("model/ids")
        assert torch.equal(ids, state["model"]["ids"])
        chunk_reads = reads[n_index_reads:]
        wanted = [r for c, r in zip(ck.index.plan.chunks, ck.index.records)
                  if any(ck.index.plan.tensors[s.tensor].key == "model/ids" for s in c.segments)]
        assert sorted(chunk_reads) == sorted((r.file_offset, r.stored) for r in wanted)  # those chunks only
        assert ck.verify()["chunks"] == len(ck.index.records)
    assert_same(gdsckpt.load(url), state)


def test_open_s3_detects_a_damaged_object(tmp_path, s3_server, s3_env):
    state = _state()
    url = _put(tmp_path, s3_server, state, codec="raw")
    ck = gdsckpt.open(url)
    rec = ck.index.records[1]
    p = tmp_path / "x.gdsckpt"
    data = bytearray(p.read_bytes())
    data[rec.file_offset + 100] ^= 0x04
    p.write_bytes(bytes(data))
    bucket = url[len("s3://"):].split("/")[0]
    open_store(f"s3://{bucket}/run").put_file(p, "x.gdsckpt")
    with pytest.raises(gdsckpt.ChecksumError, match="chunk 1"):
        gdsckpt.load(url)
    with pytest.raises(ValueError, match="trusted=False"):
        gdsckpt.open(url, trusted=False)
