"""Randomized damage to saved checkpoints (issue 5): bit flips in chunk data, index, footer and
header, truncation at any byte, zero-filled ranges, appended bytes.

Every damage that touches a byte the reader reads must raise a CheckpointFormatError that names
the file (and, for chunk damage, the tensor key and chunk), before the damaged chunk reaches a
decoder; a damage confined to bytes nothing reads (the zero padding between 4 KiB aligned
records) must load bit-exact. Never another exception, a crash, a hang or a wrong tensor.
`gdsckpt verify` (checksums only) must agree on every damaged file.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import os
import random

import pytest
import torch

import gdsckpt
from gdsckpt import cli, codecs
from gdsckpt.engine.backend import CpuBackend
from gdsckpt.format.checksum import checksum
from conftest import assert_same
from ckpt_tools import covered_ranges, split

N_DAMAGES = int(os.environ.get("GDSCKPT_DAMAGES", "1050"))  # over three files; CI size


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    layers = {}
    for i in range(12):
        layers[f"layer{i}"] = {
            "w": (torch.randn(64, 48, generator=g) * 0.02).to(torch.bfloat16),
            "b": torch.zeros(48),
            "scale": torch.randn(48, generator=g),
            "steps": torch.tensor(i * 10, dtype=torch.int64),
        }
    return {
        "layers": layers,
        "noise": torch.randint(0, 256, (70_000,), dtype=torch.uint8, generator=g),  # incompressible: raw
        "big": torch.randn(90_000, generator=g),
        "ramp": torch.arange(60_000, dtype=torch.int32),
        "half": torch.randn(5_000, generator=g).half(),
        "mask": torch.rand(3_000, generator=g) > 0.5,
        "cplx": torch.randn(700, dtype=torch.complex64, generator=g),
        "scalar": torch.tensor(1.5, dtype=torch.float64),
        "empty": torch.empty(0, 5),
        "plain": {"lr": 1e-3, "betas": (0.9, 0.95), "name": "adamw", "nan": float("nan"), "step": 3},
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory, request):
    """Three intact files: zstd with one frame per chunk, zstd cut into 8 KiB frames (the GPU's
    layout: zero-filled 16-byte gaps between frames), and raw."""
    d = tmp_path_factory.mktemp("intact")
    out = {}
    state = _state(0)
    for name, codec, frame in [("zstd", "zstd", None), ("zstd-frames", "zstd", 8192), ("raw", "raw", None)]:
        p = d / f"{name}.gdsckpt"
        old = dict(codecs.ZSTD_FRAME_BYTES)
        if frame:
            codecs.ZSTD_FRAME_BYTES["cpu"] = frame
        try:
            gdsckpt.save(state, p, codec=codec, chunk_bytes=32 << 10)
        finally:
            codecs.ZSTD_FRAME_BYTES.update(old)
        out[name] = p.read_bytes()
    ck = gdsckpt.open(d / "zstd-frames.gdsckpt")
    assert any(r.frames and len(r.frames) > 1 for r in ck.index.records)
    assert any(r.raw for r in ck.index.records) and any(not r.raw for r in ck.index.records)
    assert len(ck.index.records) > 20
    return state, out


# ---------------------------------------------------------------- damage generator


def _damage(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    """One random damage: (description, damaged bytes)."""
    _, doc, off = split(data)
    n = len(data)
    kind = rng.choices(["flip-chunk", "flip-index", "flip-footer", "flip-header", "flip-any", "truncate",
                        "zero-range", "append"], weights=[26, 14, 9, 4, 8, 15, 15, 9])[0]
    b = bytearray(data)
    if kind.startswith("flip"):
        if kind == "flip-chunk":
            c = rng.choice(doc["chunks"])
            lo, hi = c["file_offset"], c["file_offset"] + c["stored"]
        elif kind == "flip-index":
            lo, hi = off, n - 64
        elif kind == "flip-footer":
            lo, hi = n - 64, n
        elif kind == "flip-header":
            lo, hi = 0, 16 if rng.random() < 0.8 else 4096
        else:
            lo, hi = 0, n
        flips = []
        for _ in range(rng.choice([1, 1, 1, 2, 3, 8])):
            pos, bit = rng.randrange(lo, hi), rng.randrange(8)
            b[pos] ^= 1 << bit
            flips.append(f"{pos}.{bit}")
        return f"{kind} {' '.join(flips)}", bytes(b)
    if kind == "truncate":
        cut = rng.choice([rng.randrange(n), rng.randrange(max(0, n - 200), n), rng.randrange(0, 8200)])
        return f"truncate at {cut}", data[:cut]
    if kind == "zero-range":
        start = rng.randrange(n)
        length = rng.choice([1, 2, 8, rng.randrange(1, 64), rng.randrange(1, 9000)])
        b[start:start + length] = bytes(len(b[start:start + length]))
        return f"zero {start}+{length}", bytes(b)
    tail = rng.choice([bytes(rng.randrange(1, 5000)), rng.randbytes(rng.randrange(1, 300)), data[-64:],
                       data[-rng.randrange(1, 200):]])
    return f"append {len(tail)} bytes", data + tail


def _touches_read_bytes(intact: bytes, damaged: bytes) -> bool:
    if len(intact) != len(damaged):
        return True
    ranges = covered_ranges(intact)
    diff = (torch.frombuffer(bytearray(intact), dtype=torch.uint8)
            != torch.frombuffer(bytearray(damaged), dtype=torch.uint8)).nonzero().flatten().tolist()
    return any(lo <= p < hi for p in diff for lo, hi in ranges)


def _first_damaged_chunk(intact: bytes, damaged: bytes):
    """The first chunk (in read order) whose stored bytes differ, when the header, index and
    footer are intact; None otherwise."""
    if len(intact) != len(damaged):
        return None
    _, doc, off = split(intact)
    if intact[off:] != damaged[off:] or intact[:12] != damaged[:12]:
        return None
    for i, c in enumerate(doc["chunks"]):
        lo, hi = c["file_offset"], c["file_offset"] + c["stored"]
        if intact[lo:hi] != damaged[lo:hi]:
            return i
    return None


@pytest.fixture
def decoder_guard(monkeypatch, files):
    """Wrap the CPU decoder (and the raw copy path's source) so that any stored bytes reaching it
    are checked against the intact files' chunk checksums: damaged bytes must never get there."""
    _, intact = files
    good = set()
    for data in intact.values():
        _, doc, _ = split(data)
        good |= {int(c["checksum"], 16) for c in doc["chunks"]}
    violations, calls = [], [0]
    real = CpuBackend.decode

    def guarded(self, spec, stored, out, frames):
        calls[0] += 1
        if checksum(stored.numpy()) not in good:
            violations.append(len(stored))
        return real(self, spec, stored, out, frames)

    monkeypatch.setattr(CpuBackend, "decode", guarded)
    return violations, calls


def _cli(*argv) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(argv))
    return rc, out.getvalue() + err.getvalue()


def test_randomized_damage(files, tmp_path, decoder_guard):
    state, intact = files
    violations, decoder_calls = decoder_guard
    rng = random.Random(int(os.environ.get("GDSCKPT_DAMAGE_SEED", "5")))
    p = tmp_path / "damaged.gdsckpt"
    counts = {"raised": 0, "loaded": 0, "chunk errors": 0, "unchanged": 0}
    faulthandler.dump_traceback_later(600, exit=True)  # a hang fails loudly instead of stalling CI
    try:
        for k in range(N_DAMAGES):
            name = list(intact)[k % len(intact)]
            data = intact[name]
            what, damaged = _damage(rng, data)
            where = f"damage {k} on {name}: {what}"
            p.write_bytes(damaged)
            must_raise = _touches_read_bytes(data, damaged)
            counts["unchanged"] += damaged == data
            chunk = _first_damaged_chunk(data, damaged)
            try:
                out = gdsckpt.load(p)
            except gdsckpt.CheckpointFormatError as e:
                assert must_raise, f"{where}: raised {e!r} though only unread padding changed"
                assert e.path is not None and str(p) in str(e), f"{where}: error does not name the file: {e}"
                if chunk is not None:
                    assert isinstance(e, gdsckpt.ChecksumError), f"{where}: {e!r}"
                    assert e.chunk == chunk and e.key is not None and e.key in str(e), f"{where}: {e!r}"
                    counts["chunk errors"] += 1
                counts["raised"] += 1
            else:
                assert not must_raise, f"{where}: damaged read bytes loaded without an error"
                assert_same(out, state)
                counts["loaded"] += 1
            rc, text = _cli("verify", str(p))
            assert rc == (1 if must_raise else 0), f"{where}: verify returned {rc}: {text}"  # 1: damaged
            if must_raise:
                assert str(p) in text and "Traceback" not in text, f"{where}: {text}"
                if chunk is not None:
                    assert f"chunk {chunk}" in text, f"{where}: {text}"
            assert not violations, f"{where}: damaged bytes reached the decoder"
    finally:
        faulthandler.cancel_dump_traceback_later()
    print(f"\n{N_DAMAGES} damages: {counts}; decoder calls {decoder_calls[0]}")
    assert counts["raised"] > 0.8 * N_DAMAGES and counts["chunk errors"] > 0.15 * N_DAMAGES
    assert decoder_calls[0] > 0


def test_every_single_truncation_of_the_tail(files, tmp_path):
    """Cut the last 300 bytes one at a time (footer, index end): each a clear error."""
    _, intact = files
    data = intact["zstd"]
    p = tmp_path / "t.gdsckpt"
    for cut in range(len(data) - 300, len(data)):
        p.write_bytes(data[:cut])
        with pytest.raises(gdsckpt.CheckpointFormatError, match="footer|too short|truncated"):
            gdsckpt.open(p)


def test_checksum_verify_catches_chunk_damage_without_decoding(files, tmp_path, monkeypatch):
    """`verify` (no --deep) finds every damaged chunk from checksums alone: no decoder runs."""
    _, intact = files
    data = intact["zstd-frames"]
    _, doc, _ = split(data)
    monkeypatch.setattr(CpuBackend, "decode", lambda *a: pytest.fail("verify without --deep decoded a chunk"))
    p = tmp_path / "v.gdsckpt"
    for i, c in enumerate(doc["chunks"]):
        b = bytearray(data)
        b[c["file_offset"] + (i * 7919) % c["stored"]] ^= 0x10
        p.write_bytes(bytes(b))
        with pytest.raises(gdsckpt.ChecksumError) as ei:
            gdsckpt.open(p).verify()
        assert ei.value.chunk == i and ei.value.key


def test_deep_verify_decodes(files, tmp_path):
    _, intact = files
    p = tmp_path / "ok.gdsckpt"
    p.write_bytes(intact["zstd"])
    rc, text = _cli("verify", "--deep", str(p))
    assert rc == 0 and "decoded" in text


def test_decoder_guard_has_teeth(files, tmp_path, decoder_guard, monkeypatch):
    """With the ring's checksum check disabled, the guard sees damaged bytes reach the decoder:
    so the guard in test_randomized_damage would notice if the ring ever decoded before verifying."""
    violations, _ = decoder_guard
    _, intact = files
    data = intact["zstd"]
    _, doc, _ = split(data)
    c = next(c for c in doc["chunks"] if "frames" in c)
    b = bytearray(data)
    b[c["file_offset"] + c["stored"] // 2] ^= 0xFF
    p = tmp_path / "g.gdsckpt"
    p.write_bytes(bytes(b))
    recorded = iter([int(r["checksum"], 16) for r in doc["chunks"]])  # the ring checks chunks in order
    monkeypatch.setattr(CpuBackend, "checksum", lambda self, buf, algorithm: next(recorded))
    with contextlib.suppress(gdsckpt.CheckpointFormatError):
        gdsckpt.load(p)
    assert violations
