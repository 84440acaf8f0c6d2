"""Byte-plane ANS on the GPU (H100): the shuffle kernels against the CPU reference, bit-exact round
trips through every path a chunk takes (compressed straight from its tensor or gathered, stored raw,
decoded into its destination tensor or through staging), codec="auto"'s per-stream choice in the
index, and the ratio that makes it worth choosing, on real AdamW moments."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import gdsckpt
from gdsckpt.codecs.zstd_cpu import shuffle_bytes
from conftest import all_dtype_tensors, assert_same

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("w", [2, 4, 8])
def test_the_kernels_compute_the_cpu_shuffle(w):
    import cupy
    from gdsckpt.engine.gpu import kernels
    stream = cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(w)
    with stream:
        for n in (1, w - 1, w + 1, 4099, (1 << 20) + 3, 3 << 20):
            data = rng.integers(0, 256, n + 32, dtype=np.uint8)
            for so, do in ((0, 0), (1, 5), (16, 8)):  # aligned, off alignment (byte path), other offsets
                ref = shuffle_bytes(data[so:so + n], w, np.empty(n, np.uint8))
                src = cupy.asarray(data)
                dst = cupy.full(n + 32, 0xAB, dtype=cupy.uint8)
                kernels.shuffle_bytes(stream, src[so:so + n], dst[do:do + n], w)
                got = dst.get(stream=stream)
                stream.synchronize()
                assert np.array_equal(got[do:do + n], ref), (n, so, do)
                assert (got[:do] == 0xAB).all() and (got[do + n:] == 0xAB).all()  # nothing outside
                back = cupy.full(n + 32, 0xCD, dtype=cupy.uint8)
                kernels.unshuffle_bytes(stream, dst[do:do + n], back[so:so + n], w)
                got = back.get(stream=stream)
                stream.synchronize()
                assert np.array_equal(got[so:so + n], data[so:so + n]), (n, so, do)
                assert (got[:so] == 0xCD).all() and (got[so + n:] == 0xCD).all()


@pytest.mark.parametrize("w", [2, 4, 8])
def test_the_gather_into_planes_is_the_gather_then_the_shuffle(w):
    """One pass from the tensors to the planes (gpu/kernels.py), for tiles of every alignment: a
    source, chunk offset or length off the element width, a chunk with tail bytes after its planes
    and a tile across that edge; nothing written outside the chunk."""
    import cupy
    from gdsckpt.engine.gpu import kernels
    stream = cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(10 + w)
    with stream:
        data = cupy.asarray(rng.integers(0, 256, 8 << 20, dtype=np.uint8))
        for lengths, src_skew in (([w * 1000, w * 70_001, w * 3], 0),  # whole elements: the word path
                                  ([w * 4096, w * 1001, w * 3191], 0),  # 16-byte groups per plane, heads
                                  ([w * 5, 3, w * 1000 + 1, w * 2 + 1], 0),  # offsets and lengths off w
                                  ([w * 64, w * 4096], 1),  # sources off w: byte by byte
                                  ([1 << 20, (1 << 20) + w - 1], 0)):  # the last tile ends in the tail
            starts = rng.integers(0, (8 << 20) - max(lengths) - 16, len(lengths)) // 16 * 16 + src_skew
            offsets = np.cumsum([0] + lengths[:-1])
            length = int(sum(lengths))
            tiles = kernels.gather_tiles(data.data.ptr + starts.astype(np.int64), offsets.astype(np.int64),
                                         np.asarray(lengths, dtype=np.int64))
            host = data.get(stream=stream)
            stream.synchronize()
            logical = np.concatenate([host[a:a + n] for a, n in zip(starts, lengths)])
            want = shuffle_bytes(logical, w, np.empty(length, np.uint8))
            out = cupy.full(length + 64, 0xAB, dtype=cupy.uint8)
            kernels.gather(stream, cupy.asarray(tiles), out.data.ptr + 32, length, w)
            got = out.get(stream=stream)
            stream.synchronize()
            assert np.array_equal(got[32:32 + length], want), (lengths, src_skew)
            assert (got[:32] == 0xAB).all() and (got[32 + length:] == 0xAB).all()


def _state(device="cuda") -> dict:
    g = torch.Generator().manual_seed(7)
    big = torch.randn(3_000_001, generator=g) * 1e-3
    return {
        # 1 MiB chunks inside one tensor: compressed straight from it, decoded straight into it
        "big": big.to(device),
        "big_bf16": (big[:2_000_003] * 10).bfloat16().to(device),
        # chunks across many tensors: gathered into the ring's staging, which the shuffle then reuses
        "small": [torch.randn(n, generator=g).to(device) for n in (1, 3, 1001, 70_001, 300_007)],
        # incompressible gathered chunks: stored raw, from staging given back its logical bytes
        "noise": [torch.randint(0, 256, (400_012,), dtype=torch.uint8, generator=g).view(torch.float32).to(device)
                  for _ in range(8)],
        "every_dtype": all_dtype_tensors(device, n=20_001, seed=2),  # 8, 4, 2 planes and one
        "host": torch.randn(700_000, generator=g),
    }


def test_round_trip_every_path_bit_exact(tmp_path):
    state = _state()
    p = tmp_path / "planes.gdsckpt"
    stats = gdsckpt.save(state, p, codec="ans-planes", chunk_bytes=1 << 20)
    assert stats.backend == "gpu" and "codec_choice" not in stats.stages
    with gdsckpt.open(p) as ck:
        plan, records = ck.index.plan, ck.index.records
    widths = {s.dtype: s.codec.get("shuffle") for s in plan.streams}
    assert {s.codec["name"] for s in plan.streams} == {"ans-planes"}
    assert widths["float32"] == 4 and widths["bfloat16"] == 2 and widths["float64"] == 8 and widths["uint8"] is None
    f32 = [r for c, r in zip(plan.chunks, records) if plan.streams[c.stream].dtype == "float32"]
    assert any(r.raw for r in f32) and sum(not r.raw for r in f32) > 10
    assert_same(gdsckpt.load(p), state)  # onto the GPU: decoded into the new tensors where a chunk lies in one
    assert_same(gdsckpt.load(p, device="cpu"), {k: _cpu(v) for k, v in state.items()})
    target = _state()
    for t in _leaves(target):
        t.view(torch.uint8).zero_()
    ptrs = [t.data_ptr() for t in _leaves(target)]
    gdsckpt.load_into(p, target)  # into existing tensors: their own memory is the decode target
    assert ptrs == [t.data_ptr() for t in _leaves(target)]
    assert_same(target, state)


def test_a_stream_of_odd_length_and_one_chunk(tmp_path):
    """Streams whose single chunk is the whole stream at odd element counts: planes of odd length,
    no tail (fp32) and a chunk smaller than nvCOMP's internal piece."""
    for n in (1, 2, 3, 5, 4097, 131_071):
        state = {"w": torch.randn(n, device="cuda"), "h": torch.randn(n, device="cuda").half()}
        p = tmp_path / f"odd{n}.gdsckpt"
        gdsckpt.save(state, p, codec="ans-planes")
        assert_same(gdsckpt.load(p), state)


def _leaves(tree):
    if isinstance(tree, torch.Tensor):
        return [tree]
    items = tree.values() if isinstance(tree, dict) else tree
    return [t for v in items for t in _leaves(v)]


def _cpu(tree):
    if isinstance(tree, torch.Tensor):
        return tree.cpu()
    if isinstance(tree, dict):
        return {k: _cpu(v) for k, v in tree.items()}
    return [_cpu(v) for v in tree]


# ---------------------------------------------------------------- codec="auto": the choice, on real AdamW moments


def adamw(steps: int = 5):
    """A 8.4M-parameter MLP on the GPU and its torch.optim.AdamW after `steps` steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(steps):
        loss = model(torch.randn(256, 1024, device="cuda")).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


def _exp_avg_sq(opt, prefix: str) -> dict:
    """The moments under keys of their own: choices are kept per layout (keys and shapes) for the
    whole process, and no other test's save may have made this one's."""
    return {f"{prefix}/{i}": opt.state[p]["exp_avg_sq"] for i, p in enumerate(opt.param_groups[0]["params"])}


def _fp32_stored(stats) -> int:
    (s,) = [s for s in stats.streams if s["dtype"] == "float32"]
    return s["stored_bytes"]


def test_byte_planes_store_exp_avg_sq_smaller_than_typed_ans(tmp_path):
    _, opt = adamw()
    state = _exp_avg_sq(opt, "ratio")  # 33.6 MB of fp32
    typed = gdsckpt.save(state, tmp_path / "typed.gdsckpt", codec="ans")
    planes = gdsckpt.save(state, tmp_path / "planes.gdsckpt", codec="ans-planes")
    saved = {k: 1 - _fp32_stored(s) / s.logical_bytes for k, s in (("ans", typed), ("ans-planes", planes))}
    print(f"exp_avg_sq saved: {saved}")
    assert _fp32_stored(planes) < _fp32_stored(typed), saved
    assert_same(gdsckpt.load(tmp_path / "planes.gdsckpt"), state)


def test_auto_records_the_smaller_choice_and_reuses_it(tmp_path):
    """The index records the chosen spec for the stream; it is the smaller of the two whole-stream
    results (both are deterministic: the same chunks, the same codec); a second save of the same
    layout samples nothing and records the same."""
    _, opt = adamw()
    state = _exp_avg_sq(opt, "auto")
    results = {c: _fp32_stored(gdsckpt.save(state, tmp_path / f"{c}.gdsckpt", codec=c)) for c in ("ans", "ans-planes")}
    first = gdsckpt.save(state, tmp_path / "auto1.gdsckpt")
    assert "codec_choice" in first.stages
    again = gdsckpt.save(state, tmp_path / "auto2.gdsckpt")
    assert "codec_choice" not in again.stages
    for name in ("auto1", "auto2"):
        with gdsckpt.open(tmp_path / f"{name}.gdsckpt") as ck:
            (spec,) = [s.codec for s in ck.index.plan.streams if s.dtype == "float32"]
        assert spec["name"] == min(results, key=results.get), (spec, results)
        assert_same(gdsckpt.load(tmp_path / f"{name}.gdsckpt"), state)
    assert _fp32_stored(first) == min(results.values())


def test_auto_chooses_per_stream_and_a_small_stream_keeps_typed_ans(tmp_path):
    model, opt = adamw(steps=2)
    state = {"model": {k: v.bfloat16() for k, v in model.state_dict().items()}, "optimizer": opt.state_dict(),
             "tiny": torch.randn(1000, device="cuda").double()}  # below one sample piece: not sampled
    stats = gdsckpt.save(state, tmp_path / "m.gdsckpt")
    with gdsckpt.open(tmp_path / "m.gdsckpt") as ck:
        codec = {s.dtype: s.codec for s in ck.index.plan.streams}
    assert codec["float64"]["name"] == "ans" and codec["bfloat16"]["name"] in ("ans", "ans-planes")
    assert codec["float32"]["name"] in ("ans", "ans-planes")
    assert {s["dtype"]: s["codec"] for s in stats.streams} == {d: c["name"] for d, c in codec.items()}
    assert_same(gdsckpt.load(tmp_path / "m.gdsckpt"), state)
