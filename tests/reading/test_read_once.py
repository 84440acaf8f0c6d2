"""Reads that move each stored byte once (gdsckpt/engine/ring.py: read_verified, then decode_verified):
a memory copy on the CPU checked and decoded where it lies in its mapping (memory_source.SlotView,
a ring.MappedChunkFile), read by KvikIO on the GPU; an atomic GPU read within
defaults.READ_ONCE_GPU_FRACTION of free device memory; beyond it, two passes. Every chunk is
checked before the first byte reaches a target: a damaged chunk leaves every target untouched
and the error names it."""

from __future__ import annotations

import os

import pytest
import torch

import gdsckpt
from gdsckpt.reading import reader
from gdsckpt.engine.backend import make_backend
from gdsckpt.errors import ChecksumError, CheckpointFormatError
from gdsckpt.manager.memory.snapshot import MemoryTarget
from gdsckpt.manager.memory.source import MemorySource, SlotView
from gdsckpt.manager.memory.tier import MemoryTier
from gdsckpt.engine.ring import Timings, decode_verified, in_place, read_room, read_verified
from conftest import assert_same

OPTS = {"chunk_bytes": 64 << 10}
SENTINEL = -12345.0


def _state():
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(60_000, generator=g), "b": torch.randn(5_000, generator=g).to(torch.bfloat16),
            "m": torch.randn(40_000, generator=g), "ids": torch.arange(9_000)}


def _sentinel_like(state):
    return {k: torch.full_like(v, SENTINEL) if v.is_floating_point() else torch.full_like(v, -1)
            for k, v in state.items()}


def _untouched(target) -> bool:
    return all(bool((v == (SENTINEL if v.is_floating_point() else -1)).all()) for v in target.values())


@pytest.fixture
def copy(tmp_path, shm):
    """A committed memory copy of _state() (zstd on the CPU): (tier, its Copy)."""
    tier = MemoryTier(tmp_path)
    try:
        assert gdsckpt.save_async(_state(), tmp_path / "m.gdsckpt", memory=MemoryTarget(tier, 1),
                                  **OPTS).result()
        yield tier, tier.hold(1)
        tier.release(1)
    finally:
        tier.close()


def _source(copy) -> MemorySource:
    return MemorySource(copy.slot, copy.nbytes, f"memory copy ({copy.slot.path})")


def _flip_in_slot(copy, chunk: int, at: int = 100) -> None:
    with gdsckpt.open(_source(copy)) as ck:
        off = ck.index.records[chunk].file_offset + at
    b = os.pread(copy.slot.fd, 1, off)
    os.pwrite(copy.slot.fd, bytes([b[0] ^ 0x10]), off)


def test_a_memory_copy_on_the_cpu_is_checked_and_decoded_where_it_lies(copy):
    _, c = copy
    with gdsckpt.open(_source(c)) as ck:
        with make_backend("cpu") as be:
            assert isinstance(ck.source.open_chunks(be), SlotView)
        target = _sentinel_like(_state())
        st = ck.load_into(target, atomic=True)
        assert_same(target, _state())
        # one pass of checks, then the decodes; no ring read ("read_wait") and no second pass
        assert "atomic_verify" in st.stages and "decompress" in st.stages and "read_wait" not in st.stages
        assert st.backend == "cpu" and st.chunks == len(ck.index.records) > 4
        assert_same(ck.load(), _state())  # a plain load reads it in place too
        assert_same(ck.read(["m"])["m"], _state()["m"])


@pytest.mark.parametrize("atomic", [True, False])
def test_a_damaged_memory_copy_writes_nothing_and_names_the_chunk(copy, atomic):
    """In place, every chunk is checked before the first decode, atomic or not: the last chunk's
    damage (which a streaming read would find after writing all the others) writes nothing."""
    _, c = copy
    with gdsckpt.open(_source(c)) as ck:
        last = len(ck.index.records) - 1
    _flip_in_slot(c, last)
    target = _sentinel_like(_state())
    with pytest.raises(ChecksumError, match=f"chunk {last}") as ei:
        gdsckpt.load_into(_source(c), target, atomic=atomic)
    assert "memory copy" in str(ei.value) and ei.value.overwritten == []
    assert _untouched(target)


def test_a_forged_zstd_header_in_a_memory_copy_is_refused_before_any_write(copy):
    """A chunk whose checksum is right but whose zstd frame header lies: refused in the checking
    pass (the decoder's own first check, made before any chunk is decoded)."""
    from gdsckpt.format.checksum import checksum
    _, c = copy
    with gdsckpt.open(_source(c)) as ck:
        i = max(k for k, r in enumerate(ck.index.records) if not r.raw)
        rec = ck.index.records[i]
        data = bytearray(os.pread(c.slot.fd, rec.stored, rec.file_offset))
        data[0] ^= 0xFF  # the zstd magic
        os.pwrite(c.slot.fd, bytes(data), rec.file_offset)
        rec.checksum = checksum(bytes(data))  # the index vouches for the forged bytes
        target = _sentinel_like(_state())
        with pytest.raises(CheckpointFormatError, match=f"chunk {i}") as ei:
            ck.load_into(target, atomic=True)
    assert "zstd" in str(ei.value) and ei.value.overwritten == [] and _untouched(target)


def test_a_record_past_the_mapping_is_a_short_read_before_any_write(copy):
    """A record the slot's mapping does not hold whole (a segment cut short under a stale index)
    is refused as a short read in the checking pass."""
    _, c = copy
    with gdsckpt.open(_source(c)) as ck:
        ck.index.records[-1].file_offset = c.slot.mapped - 1
        target = _sentinel_like(_state())
        with pytest.raises(CheckpointFormatError, match=f"short read: 1 of .* chunk {len(ck.index.records) - 1}") as ei:
            ck.load_into(target, atomic=True)
    assert ei.value.overwritten == [] and _untouched(target)


# ---------------------------------------------------------------- the ring's two passes, on a file


def _ring_read(p, target_key="w", flip_chunk=None):
    """read_verified + decode_verified over the CPU backend's own ChunkFile on file `p` (read into
    one buffer: a file is not in place)."""
    with gdsckpt.open(p) as ck, make_backend("cpu") as be:
        ids = list(range(len(ck.index.records)))
        target = torch.full((60_000,), SENTINEL)
        views = [target.view(torch.uint8) if t.key == target_key else None for t in ck.index.plan.tensors]
        ids = [i for i in ids if any(views[s.tensor] is not None for s in ck.index.plan.chunks[i].segments)]
        file = ck.source.open_chunks(be)
        try:
            assert not in_place(file)
            timings, reached = Timings(), []
            try:
                held = read_verified(ck.index, ids, be, file, timings, p)
            except ChecksumError:
                assert reached == [] and bool((target == SENTINEL).all())
                raise
            assert sum(h.numel() for h in held) == sum(ck.index.records[i].stored for i in ids)
            assert held[0].data_ptr() + read_room(ck.index, ids[:1]) == held[1].data_ptr()  # one buffer, 4 KiB apart
            decode_verified(ck.index, ids, held, views, be, timings, p, reached=reached)
            assert reached == ids and {"atomic_read", "atomic_verify", "decompress"} <= set(timings.stages)
        finally:
            file.close()
    return target


def test_the_rings_read_once_passes_on_a_file(tmp_path):
    from ckpt_tools import flip_chunk_byte
    p = tmp_path / "c.gdsckpt"
    gdsckpt.save(_state(), p, **OPTS)
    assert torch.equal(_ring_read(p), _state()["w"])
    with gdsckpt.open(p) as ck:
        seg = next(c.index for c in ck.index.plan.chunks if any(ck.index.plan.tensors[s.tensor].key == "w"
                                                                 for s in c.segments))
    flip_chunk_byte(p, at=50, mask=2, chunk=seg + 1)
    with pytest.raises(ChecksumError, match=f"chunk {seg + 1}"):
        _ring_read(p)


def test_the_cpu_checks_a_file_in_a_separate_pass(tmp_path):
    """A file on the CPU backend is checked, then read again to be decoded (its page cache holds
    it for the second read): reads once only where the backend would hold the bytes for free."""
    p = tmp_path / "c.gdsckpt"
    gdsckpt.save(_state(), p, **OPTS)
    target = _sentinel_like(_state())
    st = gdsckpt.load_into(p, target, atomic=True)
    assert_same(target, _state())
    assert "atomic_verify" in st.stages and "read_wait" in st.stages and "atomic_read" not in st.stages


# ---------------------------------------------------------------- on the GPU


def _gpu_state():
    g = torch.Generator(device="cuda").manual_seed(7)
    return {"w": torch.randn(3_000_000, device="cuda", generator=g),
            "h": torch.randn(2_000_000, device="cuda", generator=g).to(torch.bfloat16)}


@pytest.mark.gpu
@pytest.mark.parametrize("fraction", [reader.READ_ONCE_GPU_FRACTION, 0.0])
def test_gpu_atomic_reads_once_within_the_budget_else_twice(tmp_path, monkeypatch, fraction):
    """Within READ_ONCE_GPU_FRACTION of free device memory the stored bytes are read once into
    the GPU, checked there, decoded from there ("atomic_read"); with no room (fraction 0) two
    passes through the ring. Both bit-exact; a damaged last chunk writes nothing in either."""
    from ckpt_tools import flip_chunk_byte
    monkeypatch.setattr(reader, "READ_ONCE_GPU_FRACTION", fraction)
    state = _gpu_state()
    p = tmp_path / "a.gdsckpt"
    gdsckpt.save(state, p, chunk_bytes=4 << 20)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    st = gdsckpt.load_into(p, target, atomic=True)
    assert_same(target, state) and "atomic_verify" in st.stages
    assert ("atomic_read" in st.stages) == (fraction > 0)
    assert ("read_wait" in st.stages) == (fraction == 0)
    n = len(gdsckpt.open(p).index.records)
    flip_chunk_byte(p, at=1000, mask=4, chunk=n - 1)
    fresh = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(ChecksumError, match=f"chunk {n - 1}") as ei:
        gdsckpt.load_into(p, fresh, atomic=True)
    assert ei.value.overwritten == [] and not any(t.any() for t in fresh.values())


@pytest.mark.gpu
def test_gpu_read_once_buffer_goes_back_to_the_device(tmp_path):
    """The buffer of every stored byte is not left reserved in torch's cache after the restore
    (a Checkpointer.restore of a large state would otherwise keep its stored size there, out of
    reach of NCCL or anything sizing itself by the free memory): the device's free memory is
    back where it was, torch's reservation grew by at most the ring's staging."""
    state = {"w": torch.randn(48 << 20, device="cuda")}  # 192 MiB, ~180 MiB stored
    p = tmp_path / "big.gdsckpt"
    gdsckpt.save(state, p, chunk_bytes=8 << 20)
    target = {"w": torch.zeros_like(state["w"])}
    with gdsckpt.open(p) as ck:
        room = read_room(ck.index, list(range(len(ck.index.records))))
    torch.cuda.synchronize()
    reserved, free = torch.cuda.memory_reserved(), torch.cuda.mem_get_info()[0]
    st = gdsckpt.load_into(p, target, atomic=True)
    assert "atomic_read" in st.stages and torch.equal(target["w"], state["w"])
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() - reserved < room // 4
    assert free - torch.cuda.mem_get_info()[0] < room // 4


@pytest.mark.gpu
def test_gpu_reads_a_memory_copy_through_kvikio_once(tmp_path, shm):
    """A memory copy into GPU tensors: the segment file read by KvikIO (not the pageable
    mapping) once, checked on the GPU, bit-exact; a damaged chunk writes nothing."""
    from gdsckpt.engine.gpu.io import DeviceFile
    state = _gpu_state()
    tier = MemoryTier(tmp_path)
    try:
        assert gdsckpt.save_async(state, tmp_path / "m.gdsckpt", memory=MemoryTarget(tier, 1),
                                  chunk_bytes=4 << 20).result()
        c = tier.hold(1)
        with make_backend("gpu") as be:
            file = _source(c).open_chunks(be)
            assert isinstance(file, DeviceFile) and not in_place(file)
            file.close()
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        st = gdsckpt.load_into(_source(c), target, atomic=True)
        assert_same(target, state) and st.backend == "gpu" and "atomic_read" in st.stages
        with gdsckpt.open(_source(c)) as ck:
            last = len(ck.index.records) - 1
        _flip_in_slot(c, last)
        fresh = {k: torch.zeros_like(v) for k, v in state.items()}
        with pytest.raises(ChecksumError, match=f"chunk {last}") as ei:
            gdsckpt.load_into(_source(c), fresh, atomic=True)
        assert ei.value.overwritten == [] and not any(t.any() for t in fresh.values())
        tier.release(1)
    finally:
        tier.close()
