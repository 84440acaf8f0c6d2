"""Byte-plane ANS ("ans-planes"): its spec as a reader checks it, the spec's round trip through the
index, the CPU's typed refusal, and the byte shuffle it runs on the GPU: the CPU reference against
FORMAT.md's definition, and the GPU kernels' own source, compiled for this host where a C++
compiler is, against the CPU reference."""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import gdsckpt
from gdsckpt import codecs
from gdsckpt.engine.backend import gpu_status
from gdsckpt.codecs.zstd_cpu import shuffle_bytes, unshuffle_bytes
from ckpt_tools import file_declaring

ROOT = Path(__file__).resolve().parents[2]
PLANES = codecs.lookup("ans-planes")


def planes_as_format_md_says(data: bytes, w: int) -> bytes:
    """FORMAT.md's byte shuffle, read literally: with L bytes and m = floor(L / w), plane p
    (p = 0 .. w-1) is byte p of each of the m w-byte elements, in order; the planes follow each
    other, then the last L - m*w bytes unchanged."""
    m = len(data) // w
    return bytes(data[i * w + p] for p in range(w) for i in range(m)) + data[m * w:]


LENGTHS = [0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 1000, 1001, 1003, 4101]


@pytest.mark.parametrize("w", [2, 4, 8])
def test_the_reference_shuffle_is_format_mds_layout(w):
    rng = np.random.default_rng(w)
    for n in LENGTHS:
        data = rng.integers(0, 256, n, dtype=np.uint8)
        planes = shuffle_bytes(data, w, np.empty(n, np.uint8))
        assert planes.tobytes() == planes_as_format_md_says(data.tobytes(), w), (w, n)
        back = np.empty(n, np.uint8)
        unshuffle_bytes(planes, w, back)
        assert np.array_equal(back, data), (w, n)


def test_format_md_documents_the_spec():
    text = (ROOT / "gdsckpt" / "format" / "FORMAT.md").read_text()
    assert '`{"name": "ans-planes", "data_type": "|u1", "nvcomp": version, "uncomp_chunk_size", "shuffle": w}`' in text


# ---------------------------------------------------------------- the spec


def test_the_writer_makes_a_plane_per_byte_of_the_scalar():
    spec = lambda d: PLANES.spec(d, side="gpu", nvcomp_version="6.0.0")  # noqa: E731
    assert spec("float32") == {"name": "ans-planes", "data_type": "|u1", "nvcomp": "6.0.0",
                                "uncomp_chunk_size": 512 << 10, "shuffle": 4}
    assert spec("bfloat16")["shuffle"] == spec("float16")["shuffle"] == 2
    assert spec("float64")["shuffle"] == spec("complex128")["shuffle"] == 8
    assert "shuffle" not in spec("uint8") and "shuffle" not in spec("float8_e4m3fn")  # one plane: ANS over bytes
    assert not PLANES.cpu_encodes and not PLANES.cpu_decodes(spec("float32")) and PLANES.gpu_decodes(spec("float32"))
    assert PLANES.nvcomp_native and PLANES.nvcomp_algorithm == "ANS"



SPEC = {"name": "ans-planes", "data_type": "|u1", "nvcomp": "6.0.0", "uncomp_chunk_size": 512 << 10, "shuffle": 4}


def test_the_spec_round_trips_through_the_index(tmp_path):
    p, s = file_declaring(SPEC, tmp_path)
    with gdsckpt.open(p) as ck:
        assert ck.index.plan.streams[s].codec == SPEC
        assert ck.verify()["chunks"] > 0  # checksums are the CPU's business whatever the codec


def test_on_a_cpu_host_a_load_is_refused_naming_the_codec(tmp_path):
    if gpu_status()[0]:
        pytest.skip("this host has a GPU")
    p, _ = file_declaring(SPEC, tmp_path)
    with pytest.raises(gdsckpt.CodecUnavailableError) as e:
        gdsckpt.load(p)
    assert "'ans-planes' chunks, which only nvCOMP on a GPU can decode" in str(e.value)
    assert f"gdsckpt convert {p} OUT --codec zstd" in str(e.value)
    with pytest.raises(gdsckpt.CodecUnavailableError, match="'ans-planes'"):
        gdsckpt.load(p, backend="cpu")


@pytest.mark.parametrize("spec,problem", [
    (dict(SPEC, shuffle=3), "byte shuffle 3 is not 2, 4 or 8"),
    (dict(SPEC, shuffle=True), "byte shuffle True is not 2, 4 or 8"),
    (dict(SPEC, data_type="<f4"), "ans-planes codec with symbol type '<f4', not bytes"),
    ({k: v for k, v in SPEC.items() if k != "nvcomp"}, "ans-planes codec without nvCOMP version or data type"),
    (dict(SPEC, uncomp_chunk_size=3000), "nvCOMP chunk size 3000 is not a power of two"),
    ({"name": "ans", "data_type": "<f4", "nvcomp": "6.0.0", "shuffle": 4}, "byte shuffle on a 'ans' stream"),
])
def test_a_damaged_spec_is_refused_on_open(tmp_path, spec, problem):
    p, s = file_declaring(spec, tmp_path)
    with pytest.raises(gdsckpt.CheckpointFormatError, match=f"stream {s}: {problem}"):
        gdsckpt.open(p)


def test_without_shuffle_it_is_ans_over_bytes(tmp_path):
    """One-byte dtypes' spec: no "shuffle", accepted (a wider stream declared so is only the
    forger's own bytes in another order)."""
    spec = {k: v for k, v in SPEC.items() if k != "shuffle"}
    assert PLANES.spec_problem(spec) is None
    p, s = file_declaring(spec, tmp_path)
    with gdsckpt.open(p) as ck:
        assert ck.index.plan.streams[s].codec == spec


def test_save_accepts_the_name_and_the_cpu_refuses_it_before_writing(tmp_path):
    p = tmp_path / "x.gdsckpt"
    for codec in ("ans-planes", {"float32": "ans-planes"}):
        with pytest.raises(gdsckpt.CodecUnavailableError, match="codec 'ans-planes' needs nvCOMP on a GPU"):
            gdsckpt.save({"w": torch.randn(10)}, p, codec=codec, backend="cpu")
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------- the GPU kernels, compiled for the host

_HARNESS = r"""
// gdsckpt/engine/gpu/kernels.py's byte-plane kernels on the host: every (block, thread) of a small grid in turn.
#include <cstdio>
#include <cstdlib>
#include <vector>
#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
struct Dim3 { unsigned x = 0; };
static Dim3 blockIdx, threadIdx, blockDim, gridDim;
#include "planes.cu"
typedef void (*Kernel)(const unsigned char*, unsigned char*, long long, int);
int main(int, char** argv) {  // direction (s/u) width n src_offset dst_offset grid block; n bytes in, n out
    const char d = argv[1][0];
    const int w = atoi(argv[2]), so = atoi(argv[4]), dof = atoi(argv[5]);
    const long long n = atoll(argv[3]);
    const unsigned grid = atoi(argv[6]), block = atoi(argv[7]);
    std::vector<unsigned char> in(n + 64), out(n + 64, 0xAB);
    if (n && fread(in.data() + so, 1, n, stdin) != (size_t)n) return 2;
    Kernel k = d == 's' ? (w == 2 ? gdsckpt_shuffle_2 : w == 4 ? gdsckpt_shuffle_4 : gdsckpt_shuffle_8)
                        : (w == 2 ? gdsckpt_unshuffle_2 : w == 4 ? gdsckpt_unshuffle_4 : gdsckpt_unshuffle_8);
    const unsigned char* src = in.data() + so;
    unsigned char* dst = out.data() + dof;
    const int aligned = (unsigned long long)(d == 's' ? (const unsigned char*)src : dst) % w == 0;  // as kernels.py
    gridDim.x = grid;
    blockDim.x = block;
    for (unsigned b = 0; b < grid; ++b)
        for (unsigned t = 0; t < block; ++t) {
            blockIdx.x = b;
            threadIdx.x = t;
            k(src, dst, n, aligned);
        }
    for (long long i = 0; i < (long long)out.size(); ++i)
        if ((i < dof || i >= dof + n) && out[i] != 0xAB) return 3;  // nothing written outside dst
    fwrite(dst, 1, n, stdout);
    return 0;
}
"""


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory) -> Path:
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the kernels for the host")
    tree = ast.parse((ROOT / "gdsckpt" / "engine" / "gpu" / "kernels.py").read_text())
    source = next(n.value.value for n in tree.body
                  if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "_PLANES")
    d = tmp_path_factory.mktemp("planes")
    (d / "planes.cu").write_text(source)
    (d / "harness.cpp").write_text(_HARNESS)
    subprocess.run([cxx, "-std=c++14", "-O1", "-Wno-unknown-pragmas", "-o", str(d / "harness"), str(d / "harness.cpp")],
                   check=True, cwd=d)
    return d / "harness"


def _run(harness: Path, direction: str, w: int, data: np.ndarray, offsets, grid) -> np.ndarray:
    r = subprocess.run([str(harness), direction, str(w), str(len(data)), *map(str, offsets), *map(str, grid)],
                       input=data.tobytes(), capture_output=True, check=False)
    assert r.returncode == 0, (direction, w, len(data), offsets, grid, r.returncode)
    return np.frombuffer(r.stdout, np.uint8)


@pytest.mark.parametrize("w", [2, 4, 8])
def test_the_gpu_kernels_compute_the_reference_shuffle(host_kernels, w):
    """Odd lengths (a tail of L % w bytes, planes of odd length), elements off their alignment in
    memory (the byte-by-byte path), grids smaller than the work (the grid-stride loop)."""
    rng = np.random.default_rng(10 + w)
    for n in (0, 1, w - 1, w + 1, 3 * w, 1001, 4101, 65537):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        planes = shuffle_bytes(data, w, np.empty(n, np.uint8))
        for offsets in ((0, 0), (1, 3), (8, 16)):
            for grid in ((1, 1), (3, 32)):
                assert np.array_equal(_run(host_kernels, "s", w, data, offsets, grid), planes), (n, offsets, grid)
                assert np.array_equal(_run(host_kernels, "u", w, planes, offsets, grid), data), (n, offsets, grid)
