"""The GPU subset of issue 5: randomized damage to ANS, zstd and bitcomp files written on the GPU
(gdsckpt.save of CUDA tensors), read back through the GPU pipeline (KvikIO, device checksum,
nvCOMP). Every damage that touches a byte the reader reads must be a CheckpointFormatError naming
the file (and the key and chunk, for chunk damage) raised before the chunk reaches nvCOMP; never a
wrong tensor. Run on the H100 host: `pytest -m gpu tests/reading/test_gpu_reader_corruption.py -s` (the -s shows
the counts and the all-zero expansion ratios). GDSCKPT_GPU_DAMAGES sets damages per codec.

test_damage_loop_on_the_cpu runs the same loop on a CPU file here, so that the loop itself is
exercised where there is no GPU.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

import gdsckpt
from gdsckpt.format import file as fmt
from gdsckpt.format.checksum import checksum
from conftest import assert_same
from ckpt_tools import rebuild, set_chunk, split
from test_reader_corruption import _cli, _damage, _first_damaged_chunk, _touches_read_bytes

N_DAMAGES = int(os.environ.get("GDSCKPT_GPU_DAMAGES", "100"))
CHUNK = 1536 << 10  # GPU zstd frames are 1 MiB: two frames per chunk
GPU_CODECS = ["ans", "zstd", "bitcomp", "ans-planes"]


def _state(device: str) -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "w_bf16": (torch.randn(1 << 20, generator=g) * 0.02).to(torch.bfloat16).to(device),
        "w32": torch.randn(300_000, generator=g).to(device),
        "zeros": torch.zeros(200_000, device=device),
        "ids": torch.arange(100_000, device=device),
        "bytes": torch.randint(0, 256, (150_000,), dtype=torch.uint8, generator=g).to(device),
        "half": torch.randn(20_000, generator=g).half().to(device),
        "scalar": torch.tensor(3.0, device=device),
        "empty": torch.empty(0, 4, device=device),
        "cpu_step": torch.tensor(5),
        "plain": {"lr": 3e-4, "name": "adamw", "betas": (0.9, 0.95)},
    }


def _guard(monkeypatch, backend_cls, good: set):
    """Wrap the backend's decoder: record any stored bytes that reach it with a checksum the
    intact file does not have (damaged bytes that got past verification)."""
    violations, calls = [], [0]
    real = backend_cls.decode

    def guarded(self, spec, stored, out, frames):
        calls[0] += 1
        if checksum(stored.detach().cpu().numpy()) not in good:
            violations.append(stored.numel())
        return real(self, spec, stored, out, frames)

    monkeypatch.setattr(backend_cls, "decode", guarded)
    return violations, calls


def _damage_loop(intact_path, state, n, monkeypatch, backend_cls, tmp_path, seed, cpu_loads_too=False) -> dict:
    data = intact_path.read_bytes()
    _, doc, _ = split(data)
    violations, calls = _guard(monkeypatch, backend_cls, {int(c["checksum"], 16) for c in doc["chunks"]})
    rng = random.Random(seed)
    p = tmp_path / "damaged.gdsckpt"
    counts = {"raised": 0, "loaded": 0, "chunk errors": 0}
    for k in range(n):
        what, damaged = _damage(rng, data)
        where = f"damage {k}: {what}"
        p.write_bytes(damaged)
        must_raise = _touches_read_bytes(data, damaged)
        chunk = _first_damaged_chunk(data, damaged)
        options = [{}] + ([{"backend": "cpu", "device": "cpu"}] if cpu_loads_too and k % 3 == 0 else [])
        for opt in options:
            try:
                out = gdsckpt.load(p, **opt)
            except gdsckpt.CheckpointFormatError as e:
                assert must_raise, f"{where} {opt}: raised {e!r} though only unread padding changed"
                assert str(p) in str(e), f"{where}: the error does not name the file: {e}"
                if chunk is not None:
                    assert isinstance(e, gdsckpt.ChecksumError) and e.chunk == chunk and e.key, f"{where}: {e!r}"
                    counts["chunk errors"] += not opt
                counts["raised"] += not opt
            else:
                assert not must_raise, f"{where} {opt}: damaged read bytes loaded without an error"
                assert_same(out, state)
                counts["loaded"] += not opt
        rc, text = _cli("verify", str(p))
        assert rc == (1 if must_raise else 0), f"{where}: verify returned {rc}: {text}"  # 1: damaged
        assert not violations, f"{where}: damaged bytes reached the decoder"
    counts["decoder calls"] = calls[0]
    return counts


def test_damage_loop_on_the_cpu(tmp_path, monkeypatch):
    """The loop below, on a CPU zstd file: checks the test code itself on any machine."""
    from gdsckpt.engine.backend import CpuBackend
    state = _state("cpu")
    p = tmp_path / "cpu.gdsckpt"
    gdsckpt.save(state, p, codec="zstd", chunk_bytes=256 << 10)
    counts = _damage_loop(p, state, 40, monkeypatch, CpuBackend, tmp_path, seed=1)
    assert counts["raised"] >= 30 and counts["decoder calls"] > 0, counts


@pytest.mark.gpu
@pytest.mark.parametrize("codec", GPU_CODECS)
def test_gpu_randomized_damage(codec, tmp_path, monkeypatch):
    from gdsckpt.engine.gpu.backend import GpuBackend
    state = _state("cuda")
    p = tmp_path / f"{codec}.gdsckpt"
    stats = gdsckpt.save(state, p, codec=codec, chunk_bytes=CHUNK)
    assert stats.backend == "gpu"
    ck = gdsckpt.open(p)
    assert sum(not r.raw for r in ck.index.records) >= 3, "too few compressed chunks to damage"
    if codec == "zstd":
        assert any(r.frames and len(r.frames) > 1 for r in ck.index.records)
    counts = _damage_loop(p, state, N_DAMAGES, monkeypatch, GpuBackend, tmp_path, seed=GPU_CODECS.index(codec),
                          cpu_loads_too=codec == "zstd")
    print(f"\n{codec}: {N_DAMAGES} damages, {counts}")
    assert counts["decoder calls"] > 0 and counts["chunk errors"] > 0.15 * N_DAMAGES, counts


@pytest.mark.gpu
@pytest.mark.parametrize("codec", GPU_CODECS)
def test_gpu_all_zero_tensors_stay_within_the_expansion_bound(codec, tmp_path):
    """format.MAX_EXPANSION refuses chunks that claim more logical bytes per stored byte than the
    codec can produce. All-zero tensors in 128 MiB chunks (the GPU default) are the densest real
    case: they must open, load, and show the margin."""
    state = {"u8": torch.zeros(160 << 20, dtype=torch.uint8, device="cuda"),
             "f32": torch.zeros(40 << 20, device="cuda"), "bf16": torch.zeros(80 << 20, dtype=torch.bfloat16, device="cuda")}
    p = tmp_path / f"zeros-{codec}.gdsckpt"
    gdsckpt.save(state, p, codec=codec)
    ck = gdsckpt.open(p)  # raises if any chunk claims more than MAX_EXPANSION
    ratios = [c.length / r.stored for c, r in zip(ck.index.plan.chunks, ck.index.records) if not r.raw]
    print(f"\n{codec}: all-zero chunks expand {min(ratios):.0f}x to {max(ratios):.0f}x "
          f"(bound {fmt.MAX_EXPANSION[codec]}x)")
    assert max(ratios) <= fmt.MAX_EXPANSION[codec]
    out = ck.load()
    assert all(not t.any() for t in out.values())


@pytest.mark.gpu
# zstd with trusted=True first: the one case decoded in this process without a child (zstd frames get
# a header check); then every codec with trusted=False, where no forged chunk reaches nvCOMP here
# before a child process has decoded it (gdsckpt/reading/isolated.py). Before trusted=False, nvCOMP's
# Bitcomp decoder and its ANS decoder on a truncated stream faulted the CUDA context (illegal
# address) on these chunks (H100, nvCOMP 6.0.0, 2026-11-22): known failures, now a clean error.
@pytest.mark.parametrize("codec,trusted", [("zstd", True), ("zstd", False), ("ans", False), ("bitcomp", False),
                                           ("ans-planes", False)])
def test_gpu_decoder_on_garbage_with_valid_checksums(codec, trusted, tmp_path, monkeypatch):
    """A hostile chunk whose checksum is right but whose bytes are not what nvCOMP wrote: a clean
    CheckpointFormatError (or, since the bytes are well-formed garbage, a load), never a crash, a
    hang or a CUDA error that poisons the process. With trusted=False a chunk the child could not
    decode never reaches this process's decoder. Kept last: if nvCOMP faulted here, it would."""
    from gdsckpt.engine.gpu.backend import GpuBackend
    state = _state("cuda")
    p = tmp_path / "base.gdsckpt"
    gdsckpt.save(state, p, codec=codec, chunk_bytes=CHUNK)
    data = p.read_bytes()
    _, doc, _ = split(data)
    i = next(i for i, c in enumerate(doc["chunks"]) if not c.get("raw"))
    rec = doc["chunks"][i]
    rng = random.Random(3)
    variants = {
        "random": rng.randbytes(rec["stored"]),
        "zeros": bytes(rec["stored"]),
        "shuffled-halves": None,
        "truncated": None,
    }
    orig = data[rec["file_offset"]:rec["file_offset"] + rec["stored"]]
    variants["shuffled-halves"] = orig[len(orig) // 2:] + orig[:len(orig) // 2]
    if codec != "zstd":  # zstd would need its frame list rewritten: covered on the CPU by test_reader_hostile
        variants["truncated"] = orig[:len(orig) // 2]
    decoded_here = []  # checksums of the stored bytes this process's nvCOMP was given
    real = GpuBackend.decode

    def spy(self, spec, stored, out, frames):
        decoded_here.append(checksum(stored.detach().cpu().numpy()))
        return real(self, spec, stored, out, frames)

    monkeypatch.setattr(GpuBackend, "decode", spy)
    results = {}
    for name, stored in variants.items():
        if stored is None:
            continue
        import copy
        d = copy.deepcopy(doc)
        fields = {}
        if codec == "zstd":
            fields["frames"] = d["chunks"][i]["frames"]
        area, d = set_chunk(data, d, i, stored, **fields)
        q = tmp_path / f"{name}.gdsckpt"
        q.write_bytes(rebuild(data, d, data_area=area))
        try:
            gdsckpt.load(q, trusted=trusted)
            results[name] = "loaded"
        except gdsckpt.CheckpointFormatError as e:
            assert str(q) in str(e)
            results[name] = type(e).__name__ + (" (in the child)" if "isolated child" in str(e) else "")
            if not trusted and "isolated child" in str(e):
                assert e.chunk == i and checksum(stored) not in decoded_here, f"{name}: reached nvCOMP here"
        torch.cuda.synchronize()  # a fault from nvCOMP would surface here
    print(f"\n{codec} trusted={trusted}: garbage chunks with valid checksums: {results}")
    if not trusted:
        assert not decoded_here, "trusted=False: this process's nvCOMP decoded a chunk of an untrusted file"
    t = torch.arange(1000, device="cuda")
    gdsckpt.save({"t": t}, tmp_path / "after.gdsckpt", codec=codec)
    assert torch.equal(gdsckpt.load(tmp_path / "after.gdsckpt")["t"], t), "the process is poisoned"


@pytest.mark.gpu
def test_gpu_trusted_false_cost(tmp_path):
    """What trusted=False costs on the GPU (printed with -s): a 256 MiB ANS state loaded with and
    without the child process that decodes first. Warm page cache (the point is the child)."""
    import time
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {f"w{i}": (torch.randn(1 << 22, generator=g, device="cuda") * 0.02) for i in range(16)}
    p = tmp_path / "cost.gdsckpt"
    gdsckpt.save(state, p, codec="ans")
    gdsckpt.load(p)
    rows = {}
    for trusted in (True, False, True, False):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = gdsckpt.load(p, trusted=trusted)
        torch.cuda.synchronize()
        rows.setdefault(trusted, []).append(time.perf_counter() - t)
    assert_same(out, state)
    print(f"\ntrusted=False cost, 256 MiB ANS on {torch.cuda.get_device_name()}: "
          f"trusted {min(rows[True]):.3f} s, trusted=False {min(rows[False]):.3f} s")
