"""codec="auto" per stream (gdsckpt/engine/codec_choice.py): the choice from sample sizes, where the sample
lies, the cache per stream layout, and the sampler on a real backend: the CPU's, with real zstd specs
as the candidates and a real AdamW state as the bytes (on the GPU the candidates are typed and
byte-plane ANS: tests/codecs/test_gpu_ans_planes.py)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import gdsckpt
from gdsckpt.engine import codec_choice as cc
from gdsckpt import codecs
from gdsckpt.engine.cpu_backend import CpuBackend
from gdsckpt.core.defaults import CODEC_SAMPLE_PIECE_BYTES, CODEC_SAMPLE_PIECES
from gdsckpt.core.dtypes import name_of
from gdsckpt.format.plan import Plan, Plans, make_plan
from gdsckpt.engine.ring import ByteViews
from gdsckpt.format.tree import flatten
from conftest import assert_same

A = {"name": "ans", "data_type": "<f4", "nvcomp": "6.0.0", "uncomp_chunk_size": 512 << 10}
B = {"name": "ans-planes", "data_type": "|u1", "nvcomp": "6.0.0", "uncomp_chunk_size": 512 << 10, "shuffle": 4}
PIECE = CODEC_SAMPLE_PIECE_BYTES


def test_the_smaller_sample_wins_and_a_tie_keeps_the_first():
    assert cc.pick([A, B], [100, 99]) is B
    assert cc.pick([A, B], [99, 100]) is A
    assert cc.pick([A, B], [100, 100]) is A
    assert cc.pick([B, A], [100, 100]) is B  # the first, whichever it is
    assert cc.pick([A, B, {"name": "raw"}], [5, 3, 3]) is B


@pytest.mark.parametrize("nbytes", [PIECE * CODEC_SAMPLE_PIECES + 4, 10 * PIECE + 12_345, 1000 * PIECE + 6, 1 << 34])
def test_the_sample_spreads_over_a_long_stream(nbytes):
    ranges = cc.sample_ranges(nbytes)
    assert len(ranges) == CODEC_SAMPLE_PIECES
    assert all(n == PIECE and o % 4096 == 0 for o, n in ranges)
    ends = [o + n for o, n in ranges]
    assert ends[-1] <= nbytes and all(e <= o for e, (o, _) in zip(ends, ranges[1:]))  # in order, apart
    for k, (o, n) in enumerate(ranges):  # each within its own part of the stream
        assert k * nbytes // CODEC_SAMPLE_PIECES - 4096 <= o and o + n <= (k + 1) * nbytes // CODEC_SAMPLE_PIECES + 4096


def test_a_short_stream_is_its_own_sample_and_a_tiny_one_has_none():
    assert cc.sample_ranges(PIECE - 4) == []
    assert cc.sample_ranges(PIECE) == [(0, PIECE)]
    assert cc.sample_ranges(2 * PIECE + 6) == [(0, PIECE), (PIECE, PIECE), (2 * PIECE, 6)]
    assert cc.sample_ranges(CODEC_SAMPLE_PIECES * PIECE) == [(k * PIECE, PIECE) for k in range(CODEC_SAMPLE_PIECES)]


# ---------------------------------------------------------------- the choice, with measured sizes given


def _plan(float32_shapes=((1 << 20,), (3, 1 << 19)), names=("w", "v")):
    """float32 (large enough to sample), bfloat16 (too short), int64 (one candidate)."""
    specs = [(k, "float32", s, 4 * int(torch.tensor(s).prod())) for k, s in zip(names, float32_shapes)]
    specs += [("b", "bfloat16", (1000,), 2000), ("i", "int64", (1 << 20,), 8 << 20)]
    return make_plan(specs, lambda dtype: dict(A), 256 << 20)


def _candidates(dtype):
    return [dict(A), dict(B)] if dtype in ("float32", "bfloat16") else [dict(A)]


class Sizes:
    """A size_of that answers from a table and counts its calls."""

    def __init__(self, per_spec):
        self.per_spec, self.calls = per_spec, []

    def __call__(self, todo):
        self.calls.append({s: [sp["name"] for sp in specs] for s, specs in todo.items()})
        return {s: [self.per_spec[sp["name"]] for sp in specs] for s, specs in todo.items()}


def test_each_stream_with_a_choice_gets_the_smaller_and_others_keep_their_spec():
    plan, sizes = _plan(), Sizes({"ans": 1000, "ans-planes": 900})
    assert cc.choose_codecs(plan, _candidates, sizes, cc.Choices()) == 1
    assert sizes.calls == [{0: ["ans", "ans-planes"]}]  # one call; bfloat16 too short, int64 no choice
    assert [s.codec["name"] for s in plan.streams] == ["ans-planes", "ans", "ans"]
    assert plan.streams[0].codec == B


def test_a_tie_keeps_typed_ans():
    plan = _plan()
    cc.choose_codecs(plan, _candidates, Sizes({"ans": 900, "ans-planes": 900}), cc.Choices())
    assert plan.streams[0].codec == A


def test_the_choice_is_kept_per_layout():
    choices = cc.Choices()
    first = Sizes({"ans": 1000, "ans-planes": 900})
    cc.choose_codecs(_plan(), _candidates, first, choices)
    again = Sizes({"ans": 1, "ans-planes": 900})  # would choose otherwise: it must not be asked
    plan = _plan()
    assert cc.choose_codecs(plan, _candidates, again, choices) == 0 and again.calls == []
    assert plan.streams[0].codec == B
    plan.streams[0].codec["shuffle"] = 2  # the cache hands out copies
    other = _plan()
    cc.choose_codecs(other, _candidates, again, choices)
    assert other.streams[0].codec == B and again.calls == []
    for changed in (_plan(float32_shapes=((1 << 20,), (1 << 19, 3))), _plan(names=("w", "u"))):
        cc.choose_codecs(changed, _candidates, again, choices)  # another layout: sampled, chosen anew
        assert changed.streams[0].codec == A
    assert len(again.calls) == 2

    def other_nvcomp(dtype):
        return [dict(s, nvcomp="6.1.0") for s in _candidates(dtype)]
    plan = _plan()
    cc.choose_codecs(plan, other_nvcomp, again, choices)  # other candidates: not the same choice
    assert len(again.calls) == 3 and plan.streams[0].codec == dict(A, nvcomp="6.1.0")


def test_the_cache_keeps_the_newest_layouts():
    choices = cc.Choices(size=2)
    choices.put(("a",), A)
    choices.put(("b",), B)
    assert choices.get(("a",)) == A  # now the newest
    choices.put(("c",), B)
    assert choices.get(("b",)) is None and choices.get(("a",)) == A and choices.get(("c",)) == B
    assert len(choices) == 2


def test_plans_are_kept_per_layout_and_each_save_chooses_in_its_own_streams():
    plans, made = Plans(size=2), []
    specs = [("w", "float32", (1 << 20,), 4 << 20), ("i", "int64", (8,), 64)]

    def planned(spec):
        def codec_of(dtype):
            made.append(dtype)
            return dict(spec)
        return codec_of
    first = plans.get(specs, planned(A), 256 << 20)
    again = plans.get(list(specs), planned(A), 256 << 20)
    assert again.chunks is first.chunks and again.tensors is first.tensors  # what the GPU keeps its tables by
    assert made == ["float32", "int64"] * 2  # asked per dtype each time: the codecs are part of the layout
    again.streams[0].codec = dict(B)  # codec="auto" choosing for this save only
    again.streams[1].codec["shuffle"] = 2
    assert plans.get(specs, planned(A), 256 << 20).streams[0].codec == A
    assert first.streams[1].codec == A
    for other in ((specs, 1 << 20, A), (specs, 256 << 20, B), (specs[:1], 256 << 20, A)):
        assert plans.get(other[0], planned(other[2]), other[1]).chunks is not first.chunks  # another layout
    assert plans.get(specs, planned(A), 256 << 20).chunks is not first.chunks  # the oldest went


# ---------------------------------------------------------------- the sampler on a real backend


def adamw_state(steps: int = 3) -> dict:
    """A small MLP and its torch.optim.AdamW state after a few steps: ~25 MB of float32."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        loss = model(torch.randn(64, 512)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


ZSTD_PLAIN = {"name": "zstd", "level": 1, "frame_bytes": 4 << 20}


def _stream_bytes(plan, tensors, s) -> torch.Tensor:
    return torch.cat([tensors[i].reshape(-1).contiguous().view(torch.uint8) for i in plan.streams[s].tensors])


def test_the_sampler_compresses_the_streams_own_bytes_piece_by_piece():
    """The pieces are the stream's bytes at sample_ranges; their sizes are the backend's encode of
    each piece (raw where it does not shrink), under each candidate; the choice is the smaller."""
    _, leaves = flatten(adamw_state())
    tensors = [l.tensor for l in leaves]
    plan = make_plan([(l.key, name_of(l.tensor.dtype), tuple(l.tensor.shape), l.tensor.nbytes) for l in leaves],
                     lambda dtype: codecs.cpu_auto_spec(dtype), 16 << 20)
    (s,) = [i for i, st in enumerate(plan.streams) if st.dtype == "float32"]
    stream = _stream_bytes(plan, tensors, s)
    assert len(stream) > CODEC_SAMPLE_PIECES * PIECE  # spread pieces, across many tensors
    specs = [dict(ZSTD_PLAIN), codecs.cpu_auto_spec("float32")]  # unshuffled and byte-shuffled zstd
    with CpuBackend() as be:
        sampler = cc.Sampler(be, plan, tensors)
        pieces = sampler.pieces([s])
        assert [(c.offset, c.length) for c in pieces] == cc.sample_ranges(plan.streams[s].nbytes)
        gather = be.gatherer(Plan(plan.tensors, plan.streams, pieces), ByteViews(tensors))
        for c in pieces:
            got, shuffled = gather(c, be.empty(c.length), specs[1])  # the CPU's codec shuffles as it codes
            assert torch.equal(got, stream[c.offset:c.offset + c.length]) and not shuffled
        want = []
        for spec in specs:
            total = 0
            for c in pieces:
                stored, _ = be.encode(spec, stream[c.offset:c.offset + c.length].clone(), be.empty(c.length), None)
                total += c.length if stored < 0 else stored
            want.append(total)
        assert sampler({s: specs}) == {s: want}
    assert want[1] < want[0] <= sum(c.length for c in pieces)  # byte planes pay on AdamW's moments
    cc.choose_codecs(plan, lambda dtype: specs if dtype == "float32" else [plan.streams[0].codec],
                     cc.Sampler(CpuBackend(), plan, tensors), cc.Choices())
    assert plan.streams[s].codec == specs[1]


def test_a_cpu_save_samples_nothing(tmp_path):
    """codec="auto" on the CPU has one candidate per stream (byte-shuffled zstd): no sample is
    compressed, and the file is what it was (tests/writing/test_writer_bytes.py holds its bytes)."""
    state = adamw_state(steps=1)
    stats = gdsckpt.save(state, tmp_path / "a.gdsckpt", backend="cpu")
    assert "codec_choice" not in stats.stages
    assert all(codecs.candidates("auto", d, gpu=False, nvcomp_version=None) == [codecs.cpu_auto_spec(d)]
               for d in ("float32", "bfloat16", "int64"))


@pytest.mark.parametrize("cores", [1, 2, 3])
def test_on_a_host_of_few_cores_cpu_auto_stores_raw(tmp_path, monkeypatch, cores):
    """codec="auto" on the CPU of a host with fewer cores than CPU_AUTO_COMPRESS_MIN_CORES stores
    raw (shuffle and zstd there cost more time than the bytes they save); the file reads back
    bit-exact. With the cores, byte-shuffled zstd as before."""
    from gdsckpt.core import defaults
    monkeypatch.setattr(defaults, "CPU_AUTO_COMPRESS_MIN_CORES", 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    state = adamw_state(steps=1)
    stats = gdsckpt.save(state, tmp_path / "a.gdsckpt", backend="cpu")
    assert stats.stored_bytes == stats.logical_bytes
    with gdsckpt.open(tmp_path / "a.gdsckpt") as ck:
        assert {s.codec["name"] for s in ck.index.plan.streams} == {"raw"}
    assert_same(gdsckpt.load(tmp_path / "a.gdsckpt"), state)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
    assert codecs.resolve("auto", "float32", gpu=False, nvcomp_version=None) == codecs.cpu_auto_spec("float32")
    assert codecs.resolve("auto", "float32", gpu=True, nvcomp_version="5.0.0")["name"] != "raw"
