"""The codec registry: every registered codec's declared properties checked against what the CPU
really does with it. Where a codec encodes on the CPU: its specs are what the reader accepts, a
save and load round-trips bit-exact, its chunk records respect its own bounds. Where it does not:
the save is refused before anything is written, and where the CPU cannot decode it, a file of it
is refused with the codec's own error. A new codec in codecs.CODECS is checked here with no new
test."""

from __future__ import annotations

import json

import pytest
import torch

import gdsckpt
from gdsckpt import codecs
from gdsckpt.format import file as fmt
from gdsckpt.engine.backend import gpu_status
from gdsckpt.engine.cpu_backend import CpuBackend
from gdsckpt.core.dtypes import BY_NAME
from ckpt_tools import file_declaring
from conftest import all_dtype_tensors, assert_same

CODECS = pytest.mark.parametrize("codec", codecs.CODECS, ids=lambda c: c.name)


def _specs(codec):
    """Every spec the writer makes for this codec: each dtype, each side, codec="auto" on the CPU."""
    out = [codec.spec(d, side=side, nvcomp_version="6.0.0") for d in BY_NAME for side in ("cpu", "gpu")]
    out += [s for s in (codecs.cpu_auto_spec(d) for d in BY_NAME) if s["name"] == codec.name]
    return out


def test_the_registry_is_what_the_rest_asks():
    names = [c.name for c in codecs.CODECS]
    assert len(set(names)) == len(names)
    assert codecs.ALL_CODECS == tuple(names)
    assert all(codecs.lookup(c.name) is c for c in codecs.CODECS)
    assert codecs.lookup("lz4") is None and codecs.lookup(["zstd"]) is None and codecs.lookup(None) is None
    assert codecs.NVCOMP_CODECS == tuple(c.name for c in codecs.CODECS if c.nvcomp_native)
    assert fmt.MAX_EXPANSION == {c.name: c.max_expansion for c in codecs.CODECS}
    with pytest.raises(ValueError, match="unknown codec 'lz4'; choose one of auto, raw, zstd, ans, ans-planes, bitcomp"):
        codecs.spec_for("lz4", "float32", None)


@CODECS
def test_declarations_are_consistent(codec):
    assert isinstance(codec.name, str) and codec.max_expansion >= 1
    assert not (codec.nvcomp_native and codec.nvcomp_algorithm is None), "a native bitstream needs nvCOMP"
    assert not (codec.always_raw and codec.framed)
    if codec.framed:  # the framed layout needs a frame size in every spec
        assert all("frame_bytes" in s for s in _specs(codec))


@CODECS
def test_the_reader_accepts_every_spec_the_writer_makes(codec):
    for spec in _specs(codec):
        assert spec["name"] == codec.name
        assert json.loads(json.dumps(spec)) == spec
        assert codecs.lookup(spec["name"]) is codec and codec.spec_problem(spec) is None, spec


@CODECS
def test_a_shuffle_field_only_where_the_codec_shuffles(codec):
    spec = dict(codec.spec("float32", side="cpu", nvcomp_version="6.0.0"), shuffle=4)
    problem = codec.spec_problem(spec)
    assert (problem is None) == codec.shuffles
    if problem:
        assert problem == f"byte shuffle on a {codec.name!r} stream, whose codec has no byte planes"


CHUNK = 1 << 20


def _state():
    g = torch.Generator().manual_seed(5)
    state = {f"t/{name}": t for name, t in all_dtype_tensors(n=20_001, seed=3).items()}
    state["zeros"] = torch.zeros(3 * CHUNK, dtype=torch.uint8)  # whole chunks of the densest data
    state["noise"] = torch.randint(0, 256, (70_000,), dtype=torch.uint8, generator=g)  # stored raw
    state["step"] = 7
    return state


@CODECS
def test_on_the_cpu_it_round_trips_or_is_refused(codec, tmp_path):
    """cpu_encodes: the save writes the registry's specs, the load is bit-exact, every chunk keeps
    the codec's bounds (always_raw, framed, max_stored, max_expansion) and the CPU backend decodes
    it (cpu_decodes). Otherwise: refused before a file exists."""
    p = tmp_path / f"{codec.name}.gdsckpt"
    state = _state()
    if not codec.cpu_encodes:
        with pytest.raises(gdsckpt.CodecUnavailableError, match=f"codec '{codec.name}' needs nvCOMP on a GPU"):
            gdsckpt.save(state, p, codec=codec.name, backend="cpu")
        assert not p.exists() and not list(tmp_path.iterdir())
        return
    gdsckpt.save(state, p, codec=codec.name, chunk_bytes=CHUNK, backend="cpu")
    assert_same(gdsckpt.load(p), state)
    with gdsckpt.open(p) as ck:
        plan, records = ck.index.plan, ck.index.records
        assert ck.verify(deep=True)["deep"]
    for s in plan.streams:
        assert s.codec == codecs.resolve(codec.name, s.dtype, gpu=False, nvcomp_version=None)
        assert codec.cpu_decodes(s.codec) and CpuBackend().can_decode(s.codec)
    compressed = [(c, r) for c, r in zip(plan.chunks, records) if not r.raw]
    assert (not compressed) == codec.always_raw
    for c, r in compressed:
        assert r.stored <= codec.max_stored(c.length) and c.length <= r.stored * codec.max_expansion
        assert (r.frames is not None) == codec.framed
    if compressed:  # the densest chunk is within the declared expansion, and near it
        zeros = max(c.length / r.stored for c, r in compressed)
        assert codec.max_expansion / 8 < zeros <= codec.max_expansion



@CODECS
def test_where_the_cpu_cannot_decode_the_codec_says_why(codec, tmp_path):
    """A valid file of a codec no CPU decoder reads: opened and its checksums verified, but a load
    on this host is refused with the codec's own error (which says how to convert it)."""
    spec = codec.spec("float32", side="gpu", nvcomp_version="6.0.0")
    if codec.cpu_decodes(spec):
        assert codec.cpu_encodes, "a codec the CPU decodes but cannot write needs a test file of its own"
        return  # read back in test_on_the_cpu_it_round_trips_or_is_refused
    if gpu_status()[0]:
        pytest.skip("this host has a GPU")
    p, _ = file_declaring(spec, tmp_path)
    with gdsckpt.open(p) as ck:
        assert ck.verify()["chunks"] > 0
        assert not CpuBackend().can_decode(ck.index.plan.streams[0].codec)
    want = str(codec.no_decoder(spec, p))
    assert "gdsckpt convert" in want
    with pytest.raises(gdsckpt.CodecUnavailableError) as e:
        gdsckpt.load(p)
    assert str(e.value) == want
    with pytest.raises(gdsckpt.CodecUnavailableError, match="convert"):
        gdsckpt.open(p).verify(deep=True)


@CODECS
def test_what_the_gpu_declines_is_said_to_go_through_the_cpu(codec):
    """A spec the GPU backend does not decode but the CPU does (byte-shuffled zstd): the error
    names the CPU backend."""
    for spec in _specs(codec):
        if not codec.gpu_decodes(spec):
            assert codec.cpu_decodes(spec)
            assert "backend='cpu'" in str(codecs.no_cpu_decoder(spec, "x.gdsckpt"))
