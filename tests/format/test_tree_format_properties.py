"""Property-based tests (issue 5), hypothesis: the state tree and the index round-trip exactly,
and the footer and index parsers, fed arbitrary bytes or arbitrarily mutated indices, raise
nothing but CheckpointFormatError. Settings stay modest so that CI stays fast; raise them with
GDSCKPT_HYPOTHESIS_SCALE=10 for a longer hunt."""

from __future__ import annotations

import json
import math
import os
import struct
import warnings

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import gdsckpt
from conftest import assert_same
from gdsckpt import codecs
from gdsckpt.core import dtypes
from gdsckpt.format import file as fmt
from gdsckpt.format.checksum import checksum
from gdsckpt.errors import CheckpointFormatError, CodecUnavailableError, UnsupportedStateError
from gdsckpt.format.plan import make_plan
from gdsckpt.format.tree import flatten
from ckpt_tools import footer, split

SCALE = int(os.environ.get("GDSCKPT_HYPOTHESIS_SCALE", "1"))
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")

# ---------------------------------------------------------------- strategies

DTYPE_NAMES = sorted(dtypes.BY_NAME)
any_text = st.text(st.characters(exclude_categories=()), max_size=12)  # lone surrogates included
keys = st.one_of(st.text(max_size=6), any_text, st.integers(min_value=-(2 ** 40), max_value=2 ** 40))
plain = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2 ** 300), max_value=2 ** 300),
                  st.sampled_from([10 ** 4300 - 1, -(10 ** 4300) + 1, 2 ** 64, -(2 ** 63) - 1]),
                  st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12), any_text)
shapes = st.lists(st.integers(min_value=0, max_value=6), max_size=4).map(tuple)


@st.composite
def tensors(draw, max_bytes=1 << 16):
    name = draw(st.sampled_from(DTYPE_NAMES))
    dt = dtypes.BY_NAME[name]
    shape = draw(st.one_of(shapes, st.integers(min_value=1, max_value=max_bytes // dt.itemsize).map(lambda n: (n,))))
    n = math.prod(shape)
    seed = draw(st.integers(0, 2 ** 32 - 1))
    raw = torch.randint(0, 2 if dt == torch.bool else 256, (n * dt.itemsize,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed)).numpy().tobytes()
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(shape) if n else torch.empty(shape, dtype=dt)
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, -1)  # non-contiguous
    return t


trees = st.recursive(
    st.one_of(plain, tensors()),
    lambda children: st.one_of(st.lists(children, max_size=4), st.lists(children, max_size=4).map(tuple),
                               st.dictionaries(keys, children, max_size=4)),
    max_leaves=14)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("props")


# ---------------------------------------------------------------- state tree round trip


@settings(max_examples=60 * SCALE, **SETTINGS)
@given(state=trees, codec=st.sampled_from(["zstd", "raw"]), chunk=st.sampled_from([4096, 8192, 1 << 16]))
def test_state_tree_round_trip(scratch, state, codec, chunk):
    p = scratch / "tree.gdsckpt"
    try:
        gdsckpt.save(state, p, codec=codec, chunk_bytes=chunk)
    except UnsupportedStateError as e:
        assume("share the key path" not in str(e))  # {"a/b": t, "a": {"b": t}}: refused, by design
        raise
    assert_same(gdsckpt.load(p), state)


def test_ints_a_reader_would_refuse_are_refused_before_writing(tmp_path):
    p = tmp_path / "big.gdsckpt"
    for v in (10 ** 4300, -(10 ** 4300), [1, {"x": 10 ** 5000}]):
        with pytest.raises(UnsupportedStateError, match="4300 digits"):
            gdsckpt.save({"v": v, "t": torch.ones(2)}, p)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- index round trip


@st.composite
def indexed_plans(draw):
    """A plan from a random tree, with plausible records laid out as the writer lays them out."""
    state = draw(trees)
    try:
        skeleton, leaves = flatten(state)
    except UnsupportedStateError:
        assume(False)
    chunk = draw(st.sampled_from([4096, 8192, 12288]))
    codec_of = {n: draw(st.sampled_from(["raw", "zstd", "ans", "bitcomp"])) for n in DTYPE_NAMES}

    def choose(name):
        c = codec_of[name]
        spec = codecs.spec_for(c, name, "5.0.0", side=draw(st.sampled_from(["cpu", "gpu"])))
        if c == "zstd":
            spec["frame_bytes"] = draw(st.sampled_from([4096, 8192, 1 << 20]))
        return spec

    plan = make_plan([(l.key, dtypes.name_of(l.tensor.dtype), tuple(l.tensor.shape), l.tensor.nbytes)
                      for l in leaves], choose, chunk)
    records, offset = [], fmt.HEADER_SIZE
    for c in plan.chunks:
        spec = plan.streams[c.stream].codec
        raw = spec["name"] == "raw" or draw(st.booleans())
        frames = None
        if raw:
            stored = c.length
        elif spec["name"] == "zstd":
            n = len(codecs.frame_bounds(c.length, spec["frame_bytes"]))
            frames = draw(st.lists(st.integers(1, 5000), min_size=n, max_size=n))
            stored = codecs.frame_offsets(frames)[-1]
            assume(c.length <= stored * fmt.MAX_EXPANSION["zstd"])
        else:
            stored = draw(st.integers(max(1, -(-c.length // fmt.MAX_EXPANSION[spec["name"]])), c.length))
        records.append(fmt.ChunkRecord(offset, stored, raw, draw(st.integers(0, 2 ** 64 - 1)), frames))
        offset = fmt.align_up(offset + stored) + draw(st.sampled_from([0, 0, 4096]))
    devices = [draw(st.sampled_from(["cpu", "cuda"])) for _ in leaves]
    meta = {"library": "gdsckpt test", "nvcomp": draw(st.one_of(st.none(), st.just("5.0.0"))),
            "created": draw(st.text(max_size=8)), "writer": {"backend": "cpu"}}
    return meta, skeleton, devices, plan, records, fmt.align_up(offset)


@settings(max_examples=80 * SCALE, **SETTINGS)
@given(case=indexed_plans())
def test_index_round_trip(case):
    meta, skeleton, devices, plan, records, index_offset = case
    raw = fmt.encode_index(meta, skeleton, devices, plan, records)
    # through the footer as a reader finds it
    tail = raw + fmt.footer_bytes(index_offset, raw)
    size = index_offset + len(tail)
    head = fmt.header_bytes()

    def pread(n, off):
        data = head + bytes(index_offset - len(head)) + tail
        return data[off:off + n]

    assert fmt.read_footer(pread, size, "mem") == (index_offset, len(raw), checksum(raw))
    idx = fmt.parse_index(raw, checksum(raw), index_offset, "mem")
    assert idx.plan.tensors == plan.tensors
    assert [(s.dtype, s.codec, s.nbytes, s.tensors) for s in idx.plan.streams] == \
        [(s.dtype, s.codec, s.nbytes, s.tensors) for s in plan.streams]
    assert idx.plan.chunks == plan.chunks
    assert idx.records == records
    assert idx.devices == devices
    assert json.dumps(idx.skeleton, allow_nan=True) == json.dumps(skeleton, allow_nan=True)
    assert {k: idx.meta[k] for k in meta} == meta


# ---------------------------------------------------------------- the parsers on arbitrary input


def _parse_file(data: bytes):
    """What open() does with a file's bytes: footer, then index. Returns the Index."""
    off, length, ck = fmt.read_footer(lambda n, o: data[o:o + n], len(data), "fuzz")
    return fmt.parse_index(data[off:off + length], ck, off, "fuzz")


@settings(max_examples=300 * SCALE, **SETTINGS)
@given(data=st.one_of(
    st.binary(max_size=9000),
    st.binary(max_size=200).map(lambda b: fmt.header_bytes() + b),
    st.tuples(st.binary(max_size=300), st.binary(min_size=64, max_size=64)).map(
        lambda t: fmt.header_bytes() + t[0] + fmt.FOOTER_MAGIC + t[1][8:]),
))
def test_footer_parser_on_arbitrary_bytes(data):
    try:
        _parse_file(data)
    except CheckpointFormatError:
        pass


@settings(max_examples=300 * SCALE, **SETTINGS)
@given(raw=st.one_of(st.binary(max_size=2000), st.text(max_size=400).map(str.encode),
                     st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=5)),
                                  lambda c: st.one_of(st.lists(c, max_size=4),
                                                      st.dictionaries(st.text(max_size=8), c, max_size=4)),
                                  max_leaves=20).map(lambda v: json.dumps(v).encode())),
       major=st.sampled_from([1, 1, 1, 0, 2, 65535]), minor=st.integers(0, 65535))
def test_index_parser_on_arbitrary_signed_bytes(raw, major, minor):
    """Arbitrary bytes as the index, with a valid footer and checksums around them."""
    head = bytearray(fmt.header_bytes())
    head[8:12] = struct.pack("<HH", major, minor)
    data = bytes(head) + raw + footer(4096, raw, major=major, minor=minor)
    try:
        _parse_file(data)
    except CheckpointFormatError:
        pass


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=-2, max_value=2 ** 65),
              st.floats(), st.text(max_size=6),
              st.sampled_from([0, 1, -1, 4096, 2 ** 31, 2 ** 62, 2 ** 63, 2 ** 64, "float32", "uint8", "zstd",
                               "raw", "ans", "cpu", "cuda", [], {}, "0000000000000000", {"name": "raw"}])),
    lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=6), c, max_size=3)),
    max_leaves=6)


@pytest.fixture(scope="module")
def valid_file(scratch):
    state = {"a": torch.arange(3000, dtype=torch.float32), "b": [torch.ones(3, 2, dtype=torch.bfloat16), 7],
             "c": {"d": torch.zeros(5000, dtype=torch.uint8), "e": torch.empty(0, 3)}, "f": 1.5}
    p = scratch / "valid.gdsckpt"
    gdsckpt.save(state, p, chunk_bytes=4096)
    return p.read_bytes()


@settings(max_examples=400 * SCALE, **SETTINGS)
@given(data=st.data())
def test_index_validation_on_mutated_indices(valid_file, scratch, data):
    """Replace, delete or insert one random node of a real index (re-signed): the parser accepts
    the file or raises CheckpointFormatError; if it accepts, loading gives whole tensors or a
    typed error, never a crash or another exception."""
    head, doc, off = split(valid_file)
    node, path = doc, []
    while isinstance(node, (dict, list)) and node and data.draw(st.integers(0, 3)) > 0:
        k = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        path.append(k)
        node = node[k]
    action = data.draw(st.sampled_from(["replace", "replace", "delete", "insert"]))
    value = data.draw(json_values)
    if not path:
        doc = value if action == "replace" else doc
    else:
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        if action == "replace":
            parent[path[-1]] = value
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent, list):
            parent.insert(path[-1], value)
        else:
            parent[data.draw(st.text(max_size=6))] = value
    raw = json.dumps(doc).encode()
    file_bytes = head + raw + footer(off, raw)
    try:
        _parse_file(file_bytes)
    except CheckpointFormatError:
        return
    p = scratch / "mutated.gdsckpt"
    p.write_bytes(file_bytes)
    try:
        out = gdsckpt.load(p)
    except (CheckpointFormatError, CodecUnavailableError):
        return
    assert isinstance(out, (dict, list, tuple, torch.Tensor, int, float, str, bool, type(None)))
