"""GPU tests: nvCOMP codecs, KvikIO I/O, restore into GPU memory. Run on the H100 machine."""

import os
import time

import pytest
import torch

import gdsckpt
from ckpt_tools import flip_chunk_byte
from conftest import all_dtype_tensors, assert_same

pytestmark = pytest.mark.gpu
CODECS = ["ans", "zstd", "bitcomp", "raw"]


def _odd_state(device):
    g = torch.Generator(device="cpu").manual_seed(1)
    big = torch.randn(5_000_000, generator=g)
    return {
        "dtypes": all_dtype_tensors(device),
        "scalar": torch.tensor(3.25, device=device),
        "empty": torch.empty(0, 7, device=device),
        "strided": torch.randn(64, 48, generator=g).to(device).t(),
        "sliced": big.to(device)[1::3],
        "big_bf16": (big * 0.02).to(torch.bfloat16).to(device),
        "tiny": [torch.randn(3, generator=g).to(device) for _ in range(2000)],
        "cpu_step": torch.tensor(150.0),
        "cpu_big": torch.randn(700_000, generator=g),  # above the small-host-tensor upload: copied per segment
        # odd byte lengths: later segments sit 1, 2, 4 or 8 bytes off their chunk's alignment
        "odd_bf16": [torch.randn(n, generator=g).to(torch.bfloat16).to(device) for n in (1, 7, 333, 100_001)],
        "odd_u8": [torch.randint(0, 255, (n,), generator=g, dtype=torch.uint8).to(device) for n in (1, 3, 17, 70_001)],
        "plain": {"lr": 1e-3, "betas": (0.9, 0.95), "name": "adamw", "flag": True, "none": None},
    }


@pytest.mark.parametrize("codec", CODECS)
def test_roundtrip_every_codec_and_dtype(tmp_path, codec):
    state = _odd_state("cuda")
    p = tmp_path / f"{codec}.gdsckpt"
    stats = gdsckpt.save(state, p, codec=codec, chunk_bytes=1 << 20)
    assert stats.backend == "gpu" and stats.io_path in ("gds", "compat")
    out = gdsckpt.load(p)
    assert out["big_bf16"].is_cuda and not out["cpu_step"].is_cuda
    assert_same(out, state)
    assert_same(gdsckpt.load(p, device="cuda")["tiny"], state["tiny"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_another_gpu_are_copied_in(tmp_path):
    """The pipeline runs on the current GPU; tensors on another one (large and small, whole chunks
    and shared chunks) reach it by copies and are stored bit-exact."""
    g = torch.Generator(device="cpu").manual_seed(3)
    state = {"here": torch.randn(3_000_000, generator=g).cuda(0),
             "there_big": torch.randn(3_000_000, generator=g).cuda(1),
             "there_small": [torch.randn(5, generator=g).cuda(1) for _ in range(50)],
             "here_small": [torch.randn(7, generator=g).cuda(0) for _ in range(50)]}
    with torch.cuda.device(0):
        gdsckpt.save(state, tmp_path / "x.gdsckpt", chunk_bytes=1 << 20)
        assert_same(gdsckpt.load(tmp_path / "x.gdsckpt"), state)


def test_a_layout_saved_again_reuses_its_gather_tables_and_stays_exact(tmp_path):
    """A training loop's saves: the same plan at the same addresses gathers through the tables
    the first save uploaded (the small host tensors' new values included); a tensor at another
    address gets new tables. Every file is exact."""
    from gdsckpt.engine.gpu.backend import _resources
    state = _odd_state("cuda")
    res = _resources(torch.cuda.current_device())
    gdsckpt.save(state, tmp_path / "a.gdsckpt", chunk_bytes=1 << 20)
    tables = res.gather_tables
    state["big_bf16"].mul_(3)  # in place: the same addresses, new values
    state["tiny"][5].add_(1)
    state["cpu_step"].fill_(151.0)
    gdsckpt.save(state, tmp_path / "b.gdsckpt", chunk_bytes=1 << 20)
    assert res.gather_tables is tables
    assert_same(gdsckpt.load(tmp_path / "b.gdsckpt"), state)
    state["tiny"][7] = state["tiny"][7] + 1  # a new tensor, at another address
    gdsckpt.save(state, tmp_path / "c.gdsckpt", chunk_bytes=1 << 20)
    assert res.gather_tables is not tables
    assert_same(gdsckpt.load(tmp_path / "c.gdsckpt"), state)


def test_the_pipeline_stream_has_the_highest_priority():
    """Beside training (an overlapped snapshot) the ring's kernels must not queue behind the
    training's for SMs."""
    from gdsckpt.engine.gpu.backend import _resources
    _, highest = torch.cuda.Stream.priority_range()
    assert _resources(torch.cuda.current_device()).torch_stream.priority == highest


def test_ring_memory_stays_within_depth_x_2_x_chunk(tmp_path):
    """Issue 4, target 6: one logical-bytes buffer plus `depth` stored-bytes slots, whatever the state's size."""
    g = torch.Generator(device="cuda").manual_seed(2)
    state = {f"w{i}": torch.randn(4 << 20, generator=g, device="cuda") for i in range(16)}  # 256 MiB
    chunk = 16 << 20
    stats = gdsckpt.save(state, tmp_path / "m.gdsckpt", chunk_bytes=chunk)
    assert stats.memory["ring_gpu_bytes"] <= stats.ring_depth * 2 * chunk, stats.memory
    assert_same(gdsckpt.load(tmp_path / "m.gdsckpt"), state)


def test_default_codec_is_typed_ans_and_shrinks_bf16(tmp_path):
    torch.manual_seed(0)
    w = (torch.randn(4096, 4096, device="cuda") * 0.02).to(torch.bfloat16)
    stats = gdsckpt.save({"w": w}, tmp_path / "w.gdsckpt")
    (s,) = stats.streams
    # codec="auto" on a float stream: typed ANS, or byte-plane ANS where its sample stores smaller
    assert s["codec"] in ("ans", "ans-planes") and s["ratio"] < 0.85, s


def test_load_into_fills_gpu_tensors_in_place(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)).cuda()
    p = tmp_path / "m.gdsckpt"
    gdsckpt.save(model.state_dict(), p)
    target = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)).cuda()
    ptrs = [t.data_ptr() for t in target.state_dict().values()]
    gdsckpt.load_into(p, target.state_dict())
    assert ptrs == [t.data_ptr() for t in target.state_dict().values()]
    assert_same(dict(target.state_dict()), dict(model.state_dict()))


def test_lazy_reader_reads_one_tensor(tmp_path):
    state = {f"layer{i}": torch.randn(1 << 18, device="cuda") for i in range(16)}
    p = tmp_path / "lazy.gdsckpt"
    gdsckpt.save(state, p, chunk_bytes=1 << 20)
    with gdsckpt.open(p) as ck:
        assert ck.info("layer3")["shape"] == (1 << 18,)
        t = ck.get_tensor("layer3")
        assert ck.last_stats.chunks == 1
    assert torch.equal(t, state["layer3"])


def test_gpu_zstd_file_reads_on_cpu(tmp_path):
    state = _odd_state("cuda")
    p = tmp_path / "z.gdsckpt"
    gdsckpt.save(state, p, codec="zstd", chunk_bytes=4 << 20)
    out = gdsckpt.load(p, device="cpu", backend="cpu")
    assert_same(out, state)


def test_cpu_zstd_file_reads_on_gpu(tmp_path):
    state = {k: v for k, v in _odd_state("cpu").items()}
    p = tmp_path / "cz.gdsckpt"
    gdsckpt.save(state, p, backend="cpu")
    out = gdsckpt.load(p, device="cuda")
    assert_same(out, state)


def test_ans_file_on_cpu_says_how_to_convert(tmp_path):
    p = tmp_path / "a.gdsckpt"
    gdsckpt.save({"w": torch.randn(1 << 20, device="cuda")}, p, codec="ans")
    with pytest.raises(gdsckpt.CodecUnavailableError, match="gdsckpt convert"):
        gdsckpt.load(p, device="cpu", backend="cpu")


def test_corrupt_chunk_is_caught_before_decoding(tmp_path):
    p = tmp_path / "c.gdsckpt"
    gdsckpt.save({"w": torch.randn(1 << 20, device="cuda")}, p, codec="ans")
    with open(p, "r+b") as f:
        f.seek(4096 + 1000)
        b = f.read(1)
        f.seek(4096 + 1000)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(gdsckpt.ChecksumError, match="chunk 0"):
        gdsckpt.load(p)


def test_explicit_gds_without_gds_is_a_clear_error(tmp_path):
    from gdsckpt.engine.gpu.io import gds_available
    if gds_available():
        pytest.skip("this host has GDS")
    with pytest.raises(gdsckpt.GDSUnavailableError, match="is_gds_available=False"):
        gdsckpt.save({"w": torch.randn(10, device="cuda")}, tmp_path / "g.gdsckpt", io="gds")
    assert not os.listdir(tmp_path)


def test_file_reads_ask_kvikio_for_larger_tasks_and_writes_keep_its_own(tmp_path, monkeypatch):
    """With no read-ahead, a checkpoint file is read in KVIKIO_READ_TASK_BYTES tasks and bounce buffers (defaults.py)
    and written with KvikIO's; the settings are back as they were after each; a user's own
    KVIKIO_TASK_SIZE wins."""
    import kvikio

    from gdsckpt.reading import sources
    from gdsckpt.core.defaults import KVIKIO_READ_TASK_BYTES
    from gdsckpt.engine.gpu.io import DeviceFile
    monkeypatch.setattr(sources, "READ_AHEAD_THREADS", 0)  # KvikIO reads each record (as on a GDS host)
    seen = []
    for op in ("pread", "pwrite"):
        def spy(self, *a, _op=op, _orig=getattr(DeviceFile, op)):
            seen.append((_op, kvikio.defaults.get("task_size"), kvikio.defaults.get("bounce_buffer_size")))
            return _orig(self, *a)
        monkeypatch.setattr(DeviceFile, op, spy)
    before = kvikio.defaults.get("task_size"), kvikio.defaults.get("bounce_buffer_size")
    assert before[0] != KVIKIO_READ_TASK_BYTES
    state = {"w": torch.randn(3_000_000, device="cuda")}
    p = tmp_path / "t.gdsckpt"
    gdsckpt.save(state, p, chunk_bytes=4 << 20)
    for atomic in (False, True):
        out = {"w": torch.zeros_like(state["w"])}
        gdsckpt.load_into(p, out, atomic=atomic)
        assert_same(out, state)
    assert {s[1:] for s in seen if s[0] == "pwrite"} == {before}
    assert {s[1:] for s in seen if s[0] == "pread"} == {(KVIKIO_READ_TASK_BYTES, KVIKIO_READ_TASK_BYTES)}
    assert (kvikio.defaults.get("task_size"), kvikio.defaults.get("bounce_buffer_size")) == before
    seen.clear()
    monkeypatch.setenv("KVIKIO_TASK_SIZE", str(before[0]))
    gdsckpt.load_into(p, {"w": torch.zeros_like(state["w"])})
    assert {s[1] for s in seen if s[0] == "pread"} == {before[0]}


def test_a_file_is_read_ahead_into_the_gpu_in_compat_mode_and_exactly(tmp_path, monkeypatch):
    """In compat mode (no GDS), a file's records are read ahead by our O_DIRECT threads and copied
    into the ring's slots (read_ahead.py): load_into with and without atomic, one tensor, and a
    damaged chunk, against KvikIO's own reads of the same file."""
    from gdsckpt.reading import sources
    from gdsckpt.engine.gpu.io import gds_available
    if gds_available():
        pytest.skip("this host has GDS: cuFile reads the file")
    monkeypatch.setattr(sources, "READ_AHEAD_BLOCK_BYTES", 1 << 20)  # records span several blocks
    g = torch.Generator(device="cuda").manual_seed(5)
    state = {f"w{i}": torch.randn(700_000 + 1031 * i, device="cuda", generator=g) for i in range(6)}
    p = tmp_path / "r.gdsckpt"
    gdsckpt.save(state, p, chunk_bytes=4 << 20)
    for atomic in (False, True):
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        stats = gdsckpt.load_into(p, out, atomic=atomic)
        assert stats.io_path == "read-ahead-direct" and stats.chunks > 4
        assert_same(out, state)
    with gdsckpt.open(p) as ck:
        assert torch.equal(ck.get_tensor("w3"), state["w3"])
    monkeypatch.setattr(sources, "READ_AHEAD_THREADS", 0)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    assert gdsckpt.load_into(p, out).io_path == "compat"
    assert_same(out, state)
    monkeypatch.undo()
    flip_chunk_byte(p, 100, 0x40, chunk=2)
    with pytest.raises(gdsckpt.ChecksumError, match="chunk 2"):
        gdsckpt.load(p)


def test_a_whole_restore_reads_ahead_from_its_open_each_byte_once(tmp_path, monkeypatch):
    """load_into and load start reading a local file's records into the read-ahead's window as soon
    as the index is read (Checkpoint(read_all=True)), beside the index's parse and the plan;
    the ring's plan takes those reads over, so each block is read once, and the state is exact."""
    from gdsckpt.engine import read_ahead
    from gdsckpt.reading import sources
    from gdsckpt.format.file import HEADER_SIZE
    from gdsckpt.engine.gpu.io import gds_available
    from gdsckpt.reading.reader import Checkpoint
    from gdsckpt.stats import outer_seconds
    if gds_available():
        pytest.skip("this host has GDS: cuFile reads the file")
    monkeypatch.setattr(sources, "READ_AHEAD_BLOCK_BYTES", 1 << 20)
    g = torch.Generator(device="cuda").manual_seed(6)
    state = {f"w{i}": torch.randn(900_000 + 4093 * i, device="cuda", generator=g) for i in range(6)}
    p = tmp_path / "w.gdsckpt"
    gdsckpt.save(state, p, chunk_bytes=4 << 20)
    with Checkpoint(p, read_all=True) as ck:
        records_end = -(-max(r.file_offset + r.stored for r in ck.index.records) // 4096) * 4096
        assert isinstance(ck.source._ahead, read_ahead.ReadAheadFile)  # reading since the index was read
    with Checkpoint(p) as ck:
        assert ck.source._ahead is None  # an open that may read a few tensors reads nothing ahead
    reads: list[int] = []
    preadv = os.preadv

    def counted(fd, bufs, offset):
        reads.append(preadv(fd, bufs, offset))
        return reads[-1]
    monkeypatch.setattr(read_ahead.os, "preadv", counted)
    for atomic in (False, True):
        reads.clear()
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        stats = gdsckpt.load_into(p, out, atomic=atomic)
        assert stats.io_path == "read-ahead-direct" and stats.stages["read_ahead_before_plan"] > 0
        assert outer_seconds(stats.stages) <= stats.seconds
        assert_same(out, state)
        assert sum(reads) == records_end - HEADER_SIZE  # every block once: the plan kept the early reads
    reads.clear()
    assert_same(gdsckpt.load(p), state)
    assert sum(reads) == records_end - HEADER_SIZE


@pytest.mark.parametrize("where", ["file", "memory copy"])
def test_check_runs_on_the_gpu_for_nvcomp_chunks_and_names_a_damaged_one(tmp_path, where):
    """Checkpoint.check on typed-ANS chunks: read as a restore reads them, into the GPU, each
    checked by the GPU's CRC kernel (the memory tier's check before a distributed restore: a
    4 GB copy took ~4.5 s at one core's CRC rate), nothing decoded; a damaged chunk is named."""
    from ckpt_tools import flip_chunk_byte
    from gdsckpt.manager.memory.slot import Slot
    from gdsckpt.manager.memory.source import MemorySource
    g = torch.Generator(device="cuda").manual_seed(8)
    state = {f"w{i}": torch.randn(600_000, device="cuda", generator=g) for i in range(4)}
    p = tmp_path / "k.gdsckpt"
    gdsckpt.save(state, p, chunk_bytes=1 << 20)

    def opened(k: int):
        if where == "file":
            return gdsckpt.open(p)
        data = p.read_bytes()
        slot = Slot(tmp_path / f"seg{k}", len(data))
        slot.write(data, 0)
        return gdsckpt.open(MemorySource(slot, len(data), "memory copy"))
    with opened(0) as ck:
        last = len(ck.index.records) - 1
        ck.check()
    flip_chunk_byte(p, at=100, mask=1, chunk=last)
    with opened(1) as ck, pytest.raises(gdsckpt.ChecksumError, match=f"chunk {last}"):
        ck.check()


def test_gpt2_small_adamw_state_roundtrips_and_compresses(tmp_path, capsys):
    """Issue 2's bar: GPT-2-small AdamW state bit-exact on the GPU; typed ANS saves >= 15% overall
    and >= 30% on the bf16 weights; `inspect` shows the per-stream ratios."""
    from gdsckpt.bench.workload import make_state
    from gdsckpt.cli import main
    state = make_state("gpt2-small", device="cuda")
    p = tmp_path / "gpt2.gdsckpt"
    stats = gdsckpt.save(state, p)
    assert_same(gdsckpt.load(p), state)
    by = {s["dtype"]: s for s in stats.streams}
    print({k: round(1 - v["ratio"], 4) for k, v in by.items()}, "overall", round(1 - stats.ratio, 4))
    assert 1 - stats.ratio >= 0.15
    assert 1 - by["bfloat16"]["ratio"] >= 0.30
    assert main(["inspect", "--summary", str(p)]) == 0
    out = capsys.readouterr().out
    assert "bfloat16" in out and "float32" in out and "ans" in out


def test_atomic_load_into_verifies_on_the_gpu_and_leaves_targets_untouched_on_damage(tmp_path):
    """load_into(atomic=True) on the GPU: the pass before any write checks every chunk with the
    GPU's checksum kernel (the ring, nothing decoded); a damaged chunk stops it before a byte
    reaches a target."""
    from ckpt_tools import flip_chunk_byte
    g = torch.Generator(device="cuda").manual_seed(7)
    state = {"w": torch.randn(3_000_000, device="cuda", generator=g),
             "h": torch.randn(2_000_000, device="cuda", generator=g).to(torch.bfloat16)}
    p = tmp_path / "a.gdsckpt"
    gdsckpt.save(state, p, chunk_bytes=4 << 20)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    st = gdsckpt.load_into(p, target, atomic=True)
    assert_same(target, state) and "atomic_verify" in st.stages
    n = len(gdsckpt.open(p).index.records)
    flip_chunk_byte(p, at=1000, mask=4, chunk=n - 1)
    fresh = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(gdsckpt.ChecksumError):
        gdsckpt.load_into(p, fresh, atomic=True)
    assert not any(t.any() for t in fresh.values())  # nothing written


def test_chunk_sizes_read_from_the_bitstream_header_are_nvcomps():
    """Every native-bitstream codec, on data that shrinks, does not, and is all zeros: the stored
    length the ring takes from the header is nvCOMP's own, compared after the fact as a save does,
    with every chunk written into one output buffer (each overwriting the last one's bitstream)."""
    import cupy

    from gdsckpt import codecs
    from gdsckpt.engine.gpu.codecs import NvcompCodecs, nvcomp_version
    c = NvcompCodecs(cupy.cuda.Stream(non_blocking=True), torch.cuda.current_device())
    g = torch.Generator(device="cuda").manual_seed(5)
    n = 8 << 20
    datas = [(torch.randn(n // 4, device="cuda", generator=g) * 1e-3).view(torch.uint8),
             (torch.randn(n // 2, device="cuda", generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8),
             torch.randint(0, 256, (n,), device="cuda", dtype=torch.uint8, generator=g),
             torch.zeros(n, dtype=torch.uint8, device="cuda"),
             torch.randn(n // 4, device="cuda", generator=g).view(torch.uint8)[:n - 4 * 1001]]
    specs = [codecs.spec_for(name, dtype, nvcomp_version(), side="gpu")
             for name, dtype in (("ans", "float32"), ("ans-planes", "float32"), ("ans", "bfloat16"), ("bitcomp", "float32"))]
    out = cupy.empty(max(c.max_stored(s, n) for s in specs), dtype=cupy.uint8)
    scratch = cupy.empty(n, dtype=cupy.uint8)
    results = []
    for data in datas:
        for spec in specs:
            stored, _ = c.encode(spec, cupy.asarray(data).copy(), out, scratch)
            result, header = c.unverified[-1]
            assert stored == (header if header < data.numel() else -1)
            results.append((result, header))
    assert len(c.unverified) == len(datas) * len(specs)
    c.verify_sizes()
    assert c.unverified == [] and all(r.buffer_sizes[0] == h for r, h in results)


def test_a_header_nvcomp_disagrees_with_fails_the_save_and_keeps_the_old_file(tmp_path, monkeypatch):
    from gdsckpt.errors import GdsckptError
    from gdsckpt.engine.gpu import kernels
    p = tmp_path / "x.gdsckpt"
    state = {"w": torch.randn(1 << 20, device="cuda")}
    gdsckpt.save(state, p)
    before = p.read_bytes()
    real = kernels.NativeSize.__call__
    monkeypatch.setattr(kernels.NativeSize, "__call__", lambda self, out: real(self, out) + 16)
    for save in (lambda: gdsckpt.save({"w": state["w"] * 2}, p),
                 lambda: gdsckpt.save_async({"w": state["w"] * 2}, p).result()):
        with pytest.raises(GdsckptError, match="header gives"):
            save()
        deadline = time.time() + 10  # save_async's writer removes its temporary on its own thread
        while len(list(tmp_path.iterdir())) > 1 and time.time() < deadline:
            time.sleep(0.05)
        assert p.read_bytes() == before and [f.name for f in tmp_path.iterdir()] == ["x.gdsckpt"]
