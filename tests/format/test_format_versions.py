"""Format 1.1 (CRC-64/NVME checksums) and format 1.0 files (the old sum) side by side."""

import json
import struct
from pathlib import Path

import pytest
import torch
from conftest import assert_same

import gdsckpt
from gdsckpt.format import file as fmt
from gdsckpt.format.checksum import crc64nvme, legacy_sum64

V10 = Path(__file__).parents[1] / "data" / "format-1.0.gdsckpt"  # written by gdsckpt 0.1.0 at format 1.0


def _v10_state():
    g = torch.Generator().manual_seed(10)
    return {"model": {"w": torch.randn(3000, generator=g), "b": torch.randn(70, generator=g).to(torch.bfloat16),
                      "ids": torch.arange(1000, dtype=torch.int64)}, "step": 7, "name": "v1.0", "t": (1.5, None)}


def test_format_1_0_files_stay_readable():
    ck = gdsckpt.open(V10)
    assert ck.metadata["format"] == [1, 0] and ck.index.checksum == "sum64"
    assert ck.verify(deep=True)["chunks"] == len(ck.index.records) > 3
    assert_same(gdsckpt.load(V10), _v10_state())


def test_format_1_0_damage_is_still_detected(tmp_path):
    data = bytearray(V10.read_bytes())
    rec = gdsckpt.open(V10).index.records[0]
    data[rec.file_offset + 5] ^= 0x10
    p = tmp_path / "damaged.gdsckpt"
    p.write_bytes(bytes(data))
    with pytest.raises(gdsckpt.ChecksumError, match="chunk 0"):
        gdsckpt.load(p)


def test_new_files_are_1_1_with_crc64nvme(tmp_path):
    p = tmp_path / "new.gdsckpt"
    gdsckpt.save({"w": torch.arange(4096, dtype=torch.float32)}, p, codec="raw")
    raw = p.read_bytes()
    assert struct.unpack("<HH", raw[8:12]) == (1, 1)
    ck = gdsckpt.open(p)
    assert ck.metadata["format"] == [1, 1] and ck.index.checksum == "crc64nvme"
    rec = ck.index.records[0]
    assert rec.checksum == crc64nvme(raw[rec.file_offset:rec.file_offset + rec.stored])
    off, length, index_ck = fmt.read_footer(lambda n, o: raw[o:o + n], len(raw), p)
    assert index_ck == crc64nvme(raw[off:off + length])


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_two_top_bits_no_longer_cancel(tmp_path, codec):
    """Issue 12's repro: the top bit of two 8-byte words flipped in one chunk. The 1.0 sum adds
    2 x 2^63 = 0 and passed it; CRC-64/NVME catches it, on load and in verify."""
    p = tmp_path / "cs.gdsckpt"
    w = torch.arange(1, 1025, dtype=torch.float32)
    gdsckpt.save({"w": w}, p, codec=codec)
    rec = gdsckpt.open(p).index.records[0]
    b = bytearray(p.read_bytes())
    stored = bytes(b[rec.file_offset:rec.file_offset + rec.stored])
    b[rec.file_offset + 7] ^= 0x80
    b[rec.file_offset + 15] ^= 0x80
    damaged = bytes(b[rec.file_offset:rec.file_offset + rec.stored])
    assert legacy_sum64(damaged) == legacy_sum64(stored)  # what made it silent before
    p.write_bytes(bytes(b))
    with pytest.raises(gdsckpt.ChecksumError, match="chunk 0"):
        gdsckpt.load(p)
    with pytest.raises(gdsckpt.ChecksumError):
        gdsckpt.open(p).verify(deep=True)


def test_index_naming_another_checksum_is_refused(tmp_path):
    p = tmp_path / "x.gdsckpt"
    gdsckpt.save({"w": torch.ones(10)}, p)
    raw = p.read_bytes()
    off, length, _ = fmt.read_footer(lambda n, o: raw[o:o + n], len(raw), p)
    doc = json.loads(raw[off:off + length])
    doc["checksum"] = "sum64"
    index = json.dumps(doc, separators=(",", ":")).encode()
    forged = raw[:off] + index + fmt.footer_bytes(off, index)
    with pytest.raises(gdsckpt.CheckpointFormatError, match="checksum algorithm"):
        fmt.parse_index(index, crc64nvme(index), off, "forged")
    p.write_bytes(forged)
    with pytest.raises(gdsckpt.CheckpointFormatError, match="checksum algorithm"):
        gdsckpt.open(p)
