"""The CPU codecs: byte-shuffled zstd (codec="auto" on the CPU, FORMAT.md's optional 1.1 field
"shuffle"), raw-block zstd frames for frames that do not pay, whole chunks stored raw, and the
index validation of the shuffle field. Every round trip is bit-exact."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch
import zstandard

import gdsckpt
from gdsckpt import codecs
from gdsckpt.codecs.zstd_cpu import raw_frame_size, shuffle_bytes, unshuffle_bytes, write_raw_frame
from gdsckpt.engine.cpu_backend import CpuCodecs
from gdsckpt.core.dtypes import BY_NAME, ITEMSIZE
from ckpt_tools import rebuild, split
from conftest import all_dtype_tensors, assert_same

WIDTHS = codecs.SHUFFLE_WIDTHS


def _bytes(n: int, seed: int = 0, kind: str = "floats") -> np.ndarray:
    """n bytes: float32-like data (compressible exponents, random mantissas), or random bytes."""
    rng = np.random.default_rng(seed)
    if kind == "random":
        return rng.integers(0, 256, n, dtype=np.uint8)
    f = (rng.standard_normal(n // 4 + 1) * 1e-3).astype("<f4").view(np.uint8)
    return np.ascontiguousarray(f[:n])


def _reference_shuffle(src: np.ndarray, w: int) -> np.ndarray:
    m = len(src) // w
    return np.concatenate([src[p:m * w:w] for p in range(w)] + [src[m * w:]])


@pytest.mark.parametrize("w", WIDTHS)
@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 9, 4095, 4097, 65536 + 5, 1000003])
def test_shuffle_matches_the_format_and_inverts(w, n):
    src = _bytes(n, seed=n)
    out = np.full(n + 7, 0xAA, dtype=np.uint8)
    got = shuffle_bytes(src, w, out)
    assert np.array_equal(got, _reference_shuffle(src, w))  # FORMAT.md's definition, tail last
    assert np.all(out[n:] == 0xAA)  # nothing past the chunk
    back = np.empty(n, dtype=np.uint8)
    unshuffle_bytes(got.copy(), w, back)
    assert np.array_equal(back, src)


@pytest.mark.parametrize("w", WIDTHS)
def test_shuffle_split_over_threads_is_the_same(w):
    """The codec threads each shuffle a range of elements; the pieces make the whole."""
    src = _bytes(100_003, seed=w)
    whole = shuffle_bytes(src, w, np.empty(len(src), np.uint8)).copy()
    m = len(src) // w
    for parts in (2, 3, 7):
        out = np.empty(len(src), np.uint8)
        step = -(-m // parts)
        for r0 in range(0, m, step):
            shuffle_bytes(src, w, out, (r0, min(m, r0 + step)))
        assert np.array_equal(out, whole)
        back = np.empty(len(src), np.uint8)
        for r0 in range(0, m, step):
            unshuffle_bytes(whole, w, back, (r0, min(m, r0 + step)))
        assert np.array_equal(back, src)


@pytest.mark.parametrize("n", [1, 5, 131071, 131072, 131073, 262144, 300000])
def test_raw_frames_are_standard_zstd(n):
    """A frame that does not pay is written as raw blocks: any zstd decoder reads it, its header
    states its size (the check every frame passes before a decoder sees it)."""
    data = _bytes(n, kind="random")
    out = np.zeros(raw_frame_size(n), np.uint8)
    write_raw_frame(data, out)
    frame = out.tobytes()
    assert zstandard.frame_content_size(frame) == n
    codecs.check_zstd_header(frame[:codecs.ZSTD_HEADER_MAX], n)
    assert zstandard.ZstdDecompressor().decompress(frame, max_output_size=n) == data.tobytes()


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("w", (None,) + WIDTHS)
@pytest.mark.parametrize("n", [1, 3, 4097, 4096 * 7 + 5, 200_001, (1 << 20) + 3])
def test_codec_round_trip_odd_lengths(w, n, threads):
    """encode/decode of one chunk, lengths not divisible by the shuffle width, small frames so that
    a chunk has many (some raw blocks, some compressed) and frames cross plane boundaries."""
    spec = {"name": "zstd", "level": 1, "frame_bytes": 64 << 10}
    if w:
        spec["shuffle"] = w
    cc = CpuCodecs(threads=threads)
    try:
        for kind in ("floats", "random"):
            src = _bytes(n, seed=n + (w or 0), kind=kind)
            out = np.zeros(n, np.uint8)
            stored, frames = cc.encode(spec, src, out)
            if stored < 0:  # would not shrink: the ring stores the logical bytes
                assert kind == "random" or n < 64
                continue
            assert 0 < stored < n and len(frames) == len(codecs.frame_bounds(n, spec["frame_bytes"]))
            assert codecs.frame_offsets(frames)[-1] == stored
            back = np.full(n, 0x55, np.uint8)
            cc.decode(spec, out[:stored].copy(), back, frames)
            assert np.array_equal(back, src), (kind, n, w)
    finally:
        cc.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_large_frames_on_zstd_workers_round_trip(threads):
    """Frames from ZstdCpu.MT_FRAME_BYTES up compress on zstd's own workers: still one standard
    frame each, with its content size."""
    n = 5 * (1 << 20) + 3
    spec = {"name": "zstd", "level": 1, "frame_bytes": 2 << 20, "shuffle": 4}
    src = (np.arange(n // 4 + 1, dtype="<f4") % 977 / 7).view(np.uint8)[:n].copy()  # compressible planes
    cc = CpuCodecs(threads=threads)
    try:
        out = np.zeros(n, np.uint8)
        stored, frames = cc.encode(spec, src, out)
        assert 0 < stored < n // 2 and len(frames) == 3
        for (_, size), pos, clen in zip(codecs.frame_bounds(n, spec["frame_bytes"]), codecs.frame_offsets(frames), frames):
            assert zstandard.frame_content_size(out[pos:pos + clen].tobytes()) == size
        back = np.empty(n, np.uint8)
        cc.decode(spec, out[:stored].copy(), back, frames)
        assert np.array_equal(back, src)
    finally:
        cc.close()


def test_frames_that_do_not_pay_are_raw_blocks_and_random_chunks_are_raw():
    """Shuffled fp32: the three mantissa planes are stored as raw blocks (no compressor run), the
    exponent plane compressed; a chunk of random bytes is stored raw."""
    spec = codecs.cpu_auto_spec("float32")
    assert spec["shuffle"] == 4
    src = _bytes(4 << 20, seed=1)
    cc = CpuCodecs(threads=2)
    try:
        out = np.zeros(len(src), np.uint8)
        stored, frames = cc.encode(dict(spec, frame_bytes=1 << 20), src, out)
        assert [f == raw_frame_size(1 << 20) for f in frames] == [True, True, True, False]
        assert stored < 0.85 * len(src)
        back = np.empty_like(src)
        cc.decode(dict(spec, frame_bytes=1 << 20), out[:stored].copy(), back, frames)
        assert np.array_equal(back, src)
        assert cc.encode(spec, _bytes(4 << 20, kind="random"), out) == (-1, None)
    finally:
        cc.close()


@pytest.mark.parametrize("w, n", [(4, 1 << 20), (8, 3 << 20), (2, 512 << 10)])
def test_a_frame_spanning_several_planes_is_still_compressed(w, n):
    """A frame holding all planes (a chunk smaller than a frame, or 2 MiB planes of fp64 in 4 MiB
    frames) is sampled all over, not just in its middle (a mantissa plane): it is compressed."""
    src = (np.random.default_rng(w).standard_normal(n // w) * 1e-3).astype(f"<f{w}")
    src = src.view(np.uint8)[:n].copy()
    spec = {"name": "zstd", "level": 1, "frame_bytes": 4 << 20, "shuffle": w}
    cc = CpuCodecs(threads=2)
    try:
        out = np.zeros(len(src), np.uint8)
        stored, frames = cc.encode(spec, src, out)
        assert 0 < stored < 0.95 * len(src) and frames[0] != raw_frame_size(min(len(src), 4 << 20))
    finally:
        cc.close()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("w, frames_per_plane", [(4, 1), (2, 2), (4, 4), (8, 1)])
def test_plane_path_writes_the_same_bytes(threads, w, frames_per_plane):
    """Where frames are whole pieces of planes, encode shuffles and compresses frame by frame
    (raw frames copied straight from the strided plane): byte for byte what shuffling the whole
    chunk and then compressing it gives."""
    fb = 256 << 10
    n = w * fb * frames_per_plane
    rng = np.random.default_rng(w)
    src = (rng.standard_normal(n // w) * 1e-3).astype(f"<f{w}").view(np.uint8).copy()
    src[: n // 4] = 0  # a run of zeros: some frames compress to almost nothing
    spec = {"name": "zstd", "level": 1, "frame_bytes": fb, "shuffle": w}
    got, want = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
    cc = CpuCodecs(threads=threads)
    try:
        s1, f1 = cc.encode(spec, src, got)
        cc.coder(spec).PLANES = False
        s2, f2 = cc.encode(spec, src, want)
        assert (s1, f1) == (s2, f2) and s1 > 0
        assert np.array_equal(got[:s1], want[:s2])
        back = np.empty(n, np.uint8)
        cc.decode(spec, got[:s1].copy(), back, f1)
        assert np.array_equal(back, src)
    finally:
        cc.close()


def test_every_dtype_round_trips_through_auto(tmp_path):
    """codec="auto" on the CPU: every dtype, element counts that are not multiples of anything,
    chunks that cut tensors and tensors that share chunks; bit-exact, including the non-finite
    floats. Floats and wide ints are shuffled by their scalar size, 1-byte types are not."""
    state = {}
    for n in (1, 3, 1001, 70_001):
        for name, t in all_dtype_tensors(n=n, seed=n).items():
            state[f"{name}/{n}"] = t
    state["nonfinite"] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45] * 999)
    p = tmp_path / "auto.gdsckpt"
    stats = gdsckpt.save(state, p, chunk_bytes=64 << 10)
    assert_same(gdsckpt.load(p), state)
    with gdsckpt.open(p) as ck:
        by_dtype = {s.dtype: s.codec for s in ck.index.plan.streams}
    for name, spec in by_dtype.items():
        assert spec["name"] == "zstd" and spec["level"] == 1
        want = codecs.cpu_auto_spec(name).get("shuffle")
        assert spec.get("shuffle") == want
        assert want is None if ITEMSIZE[name] == 1 else want in WIDTHS
    assert by_dtype["float32"]["shuffle"] == 4 and by_dtype["bfloat16"]["shuffle"] == 2
    assert by_dtype["complex64"]["shuffle"] == 4 and by_dtype["float64"]["shuffle"] == 8
    assert stats.stored_bytes < stats.logical_bytes
    assert gdsckpt.open(p).verify(deep=True)["deep"]


def test_explicit_zstd_stays_portable(tmp_path):
    """codec="zstd" is the portable choice (nvCOMP decodes it too): no shuffle field."""
    p = tmp_path / "z.gdsckpt"
    state = {"w": torch.randn(100_000), "h": torch.randn(5000).bfloat16()}
    gdsckpt.save(state, p, codec="zstd")
    with gdsckpt.open(p) as ck:
        assert all("shuffle" not in s.codec for s in ck.index.plan.streams)
        assert all(codecs.gpu_can_decode(s.codec) for s in ck.index.plan.streams)
    assert_same(gdsckpt.load(p), state)


def test_files_without_the_field_still_load(tmp_path):
    """Files written before the shuffle field (16 MiB frames, level 3, no "shuffle") load."""
    state = {"w": torch.randn(3_000_000), "b": torch.randn(1000).bfloat16(), "i": torch.arange(10)}
    old = dict(codecs.ZSTD_FRAME_BYTES)
    codecs.ZSTD_FRAME_BYTES["cpu"] = 16 << 20
    try:
        p = tmp_path / "old.gdsckpt"
        gdsckpt.save(state, p, codec="zstd")
    finally:
        codecs.ZSTD_FRAME_BYTES.update(old)
    _, doc, _ = split(p.read_bytes())
    assert {s["codec"]["frame_bytes"] for s in doc["streams"]} == {16 << 20}
    assert not any("shuffle" in s["codec"] for s in doc["streams"])
    assert_same(gdsckpt.load(p), state)


@pytest.fixture(scope="module")
def shuffled_file(tmp_path_factory) -> bytes:
    p = tmp_path_factory.mktemp("shuffle") / "s.gdsckpt"
    gdsckpt.save({"w": torch.randn(20_000), "c": torch.arange(3000)}, p, chunk_bytes=16 << 10)
    data = p.read_bytes()
    _, doc, _ = split(data)
    assert [s["codec"].get("shuffle") for s in doc["streams"]] == [4, 8]
    return data


@pytest.mark.parametrize("value", [0, 1, 3, 5, 16, -4, 1 << 40, 4.0, "4", True, None, [4], {"w": 4}])
def test_damaged_shuffle_field_is_refused(tmp_path, shuffled_file, value):
    """A shuffle width that is not 2, 4 or 8 (with a valid index checksum: damage or forgery)
    is refused when the file is opened, naming the stream, before any chunk is read."""
    _, doc, _ = split(shuffled_file)
    doc["streams"][0]["codec"]["shuffle"] = value
    p = tmp_path / "bad.gdsckpt"
    p.write_bytes(rebuild(shuffled_file, doc))
    with pytest.raises(gdsckpt.CheckpointFormatError, match="stream 0: byte shuffle"):
        gdsckpt.open(p)


@pytest.mark.parametrize("codec", [{"name": "raw", "shuffle": 4},
                                   {"name": "ans", "data_type": "<f4", "nvcomp": "6.0.0", "shuffle": 4}])
def test_shuffle_only_on_zstd(tmp_path, shuffled_file, codec):
    _, doc, _ = split(shuffled_file)
    doc["streams"][0]["codec"] = codec
    for c in doc["chunks"]:
        if c["stream"] == 0:
            c.pop("frames", None)
    p = tmp_path / "bad.gdsckpt"
    p.write_bytes(rebuild(shuffled_file, doc))
    with pytest.raises(gdsckpt.CheckpointFormatError, match="byte shuffle"):
        gdsckpt.open(p)


def test_a_wrong_but_valid_width_cannot_crash_the_reader(tmp_path, shuffled_file):
    """A forged width of another valid value only scrambles the forger's own tensor's bytes."""
    _, doc, _ = split(shuffled_file)
    doc["streams"][0]["codec"]["shuffle"] = 2
    p = tmp_path / "w2.gdsckpt"
    p.write_bytes(rebuild(shuffled_file, doc))
    out = gdsckpt.load(p)
    assert out["w"].shape == (20_000,) and torch.equal(out["c"], torch.arange(3000))


def test_the_gpu_refuses_shuffled_zstd_and_loads_go_through_the_cpu(tmp_path, shuffled_file):
    """The GPU backend has no unshuffle: it declines byte-shuffled chunks (and says how to read
    them), and a load that would pick the GPU for its destinations picks the CPU instead."""
    _, doc, _ = split(shuffled_file)
    spec = doc["streams"][0]["codec"]
    assert not codecs.gpu_can_decode(spec) and codecs.cpu_can_decode(spec)
    assert codecs.gpu_can_decode({"name": "zstd", "level": 3, "frame_bytes": 1 << 20})
    err = codecs.no_cpu_decoder(spec, "x.gdsckpt")
    assert "byte-shuffled" in str(err) and "backend='cpu'" in str(err)
    p = tmp_path / "s.gdsckpt"
    p.write_bytes(shuffled_file)
    with gdsckpt.open(p) as ck:
        cuda_like = types.SimpleNamespace(is_cuda=True)
        assert ck._backend_kind({0: cuda_like}) == "cpu"


@pytest.mark.gpu
def test_cpu_auto_file_loads_onto_the_gpu(tmp_path):
    state = {"w": torch.randn(300_000), "b": torch.randn(7000).bfloat16()}
    p = tmp_path / "cpu.gdsckpt"
    gdsckpt.save(state, p)
    out = gdsckpt.load(p, device="cuda")
    assert out["w"].is_cuda
    assert_same({k: v.cpu() for k, v in out.items()}, state)
    with pytest.raises(gdsckpt.CodecUnavailableError, match="byte-shuffled"):
        gdsckpt.load(p, device="cuda", backend="gpu")


def test_auto_is_zstd_on_the_cpu_for_every_dtype():
    for name in BY_NAME:
        spec = codecs.resolve("auto", name, gpu=False, nvcomp_version=None)
        assert spec == codecs.cpu_auto_spec(name)
        assert json.loads(json.dumps(spec)) == spec


# ---------------------------------------------------------------- O_DIRECT writes of the ring's slots


def _data_area(p):
    head, doc, off = split(p.read_bytes())
    return head, doc


def test_direct_writes_match_buffered_ones(tmp_path, monkeypatch):
    """Slots are written with O_DIRECT, rounded up to 4 KiB with zeros: the file holds the same
    bytes as a buffered save (records and zero padding; only the index's timestamp may differ)."""
    from gdsckpt.engine import cpu_backend as cb
    used = []
    real = cb.HostFile._write_direct
    monkeypatch.setattr(cb.HostFile, "_write_direct", lambda self, *a: used.append(real(self, *a)) or used[-1])
    state = {"w": torch.randn(1_000_003), "b": torch.randn(70_001).bfloat16(), "i": torch.arange(999)}
    a, b = tmp_path / "direct.gdsckpt", tmp_path / "buffered.gdsckpt"
    gdsckpt.save(state, a, chunk_bytes=256 << 10)
    assert used and all(used)  # every record went through O_DIRECT (this file system has it)
    monkeypatch.setattr(cb, "CPU_DIRECT_IO", False)
    gdsckpt.save(state, b, chunk_bytes=256 << 10)
    (ha, da), (hb, db) = _data_area(a), _data_area(b)
    assert ha == hb and da["chunks"] == db["chunks"]
    assert_same(gdsckpt.load(a), state)


def test_raw_chunks_from_the_callers_tensor_are_not_touched(tmp_path):
    """A chunk stored raw straight from the caller's tensor is written buffered: the rounding up
    to 4 KiB, which zeroes bytes past the record in the slot, must never touch a tensor."""
    noise = torch.randint(0, 256, (3 * (256 << 10) + 100,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    keep = noise.clone()
    p = tmp_path / "raw.gdsckpt"
    stats = gdsckpt.save({"noise": noise}, p, chunk_bytes=256 << 10)
    assert stats.streams[0]["raw_chunks"] == 4
    assert torch.equal(noise, keep)
    assert torch.equal(gdsckpt.load(p)["noise"], keep)


def test_direct_write_refused_falls_back_to_buffered(tmp_path, monkeypatch):
    """EINVAL from an O_DIRECT write (an alignment this file system wants and we did not meet):
    the chunk is written again, buffered, and the save completes bit-exact."""
    import errno
    import os
    from gdsckpt.engine import cpu_backend as cb
    real_open, direct_fds = os.open, set()

    def tracking_open(path, flags, *a):
        fd = real_open(path, flags, *a)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    real_pwrite = os.pwrite

    def pwrite(fd, data, offset):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "open", tracking_open)
    monkeypatch.setattr(os, "pwrite", pwrite)
    state = {"w": torch.randn(600_000)}
    p = tmp_path / "fallback.gdsckpt"
    gdsckpt.save(state, p, chunk_bytes=256 << 10)
    assert direct_fds
    monkeypatch.undo()
    assert_same(gdsckpt.load(p), state)
    assert cb.CPU_DIRECT_IO


def test_file_systems_without_o_direct(tmp_path):
    """tmpfs refuses O_DIRECT at open: the save writes buffered."""
    import os
    import tempfile
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        state = {"w": torch.randn(300_000)}
        p = os.path.join(d, "s.gdsckpt")
        gdsckpt.save(state, p, chunk_bytes=256 << 10)
        assert_same(gdsckpt.load(p), state)
