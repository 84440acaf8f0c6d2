"""The codec registry: every codec gdsckpt reads and writes, and how a stream picks one.

A codec spec is the JSON the index records for a stream, e.g.
{"name": "ans", "data_type": "<f4", "nvcomp": "6.0.0"}; its "name" picks the codec here, and the
codec object (codecs/base.py's `Codec`) answers everything else: what a reader accepts, where
it encodes and decodes. Adding a codec is one module with its `Codec` subclass and one line in
CODECS below. The functions below are the questions the rest of gdsckpt asks, answered from the
registry, including which specs codec="auto" chooses among (`candidates`; the choice itself,
from a sample of the stream, is gdsckpt/engine/codec_choice.py's).
"""

from __future__ import annotations

import os

from gdsckpt.core import defaults
from gdsckpt.core.defaults import ZSTD_FRAME_BYTES
from ..errors import CodecUnavailableError
from .ans import Ans
from .ans_planes import AnsPlanes
from .base import FRAME_ALIGN, SHUFFLE_WIDTHS, Codec, frame_bounds, frame_offsets
from .bitcomp import Bitcomp
from .raw import Raw
from .zstd import ZSTD_HEADER_MAX, Zstd, check_zstd_header, cpu_auto_spec

# The registry, in the order error messages list the names.
CODECS: tuple[Codec, ...] = (
    Raw(),
    Zstd(),
    Ans(),
    AnsPlanes(),
    Bitcomp(),
)
_BY_NAME = {c.name: c for c in CODECS}
GPU_AUTO = "ans"  # codec="auto" on the GPU: typed ANS (on the CPU: cpu_auto_spec, byte-shuffled zstd, or raw on few cores)
# ...or, for streams of these dtypes, byte-plane ANS where a sample of the stream stores smaller
# with it (candidates; codec_choice.py samples). AdamW's fp32 moments: exp_avg_sq 17.8% saved with
# byte planes against 15.0% typed (H100, nvCOMP 6).
GPU_AUTO_PLANES = ("float16", "bfloat16", "float32", "float64")

ALL_CODECS = tuple(_BY_NAME)
NVCOMP_CODECS = tuple(c.name for c in CODECS if c.nvcomp_native)  # their bitstream is tied to nvCOMP's major
MAX_EXPANSION = {c.name: c.max_expansion for c in CODECS}

__all__ = ["ALL_CODECS", "CODECS", "FRAME_ALIGN", "MAX_EXPANSION", "NVCOMP_CODECS", "SHUFFLE_WIDTHS",
           "ZSTD_FRAME_BYTES", "ZSTD_HEADER_MAX", "Codec", "candidates", "check_zstd_header", "cpu_auto_compresses", "cpu_auto_spec",
           "cpu_can_decode", "frame_bounds", "frame_offsets", "gpu_can_decode", "lookup", "no_cpu_decoder",
           "of", "resolve", "spec_for"]


def lookup(name) -> Codec | None:
    """The codec called `name`; None for anything else (a name read from a file may be any JSON)."""
    return _BY_NAME.get(name) if isinstance(name, str) else None


def of(spec: dict) -> Codec:
    """The codec of a spec the index validated (or resolve made)."""
    return _BY_NAME[spec["name"]]


def spec_for(name: str, dtype: str, nvcomp_version: str | None, side: str = "cpu") -> dict:
    """The spec a stream of `dtype` gets for codec `name`."""
    codec = lookup(name)
    if codec is None:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(('auto',) + ALL_CODECS)}")
    return codec.spec(dtype, side=side, nvcomp_version=nvcomp_version)


def resolve(codec, dtype: str, *, gpu: bool, nvcomp_version: str | None) -> dict:
    """The spec of one stream. `codec` is "auto", a name, or {dtype name: name}."""
    if isinstance(codec, dict):
        codec = codec.get(dtype, "auto")
    if codec == "auto":
        if not gpu:
            return cpu_auto_spec(dtype) if cpu_auto_compresses() else {"name": "raw"}
        codec = GPU_AUTO
    chosen = lookup(codec)
    if chosen is not None and not gpu and not chosen.cpu_encodes:
        raise CodecUnavailableError(
            f"codec {codec!r} needs nvCOMP on a GPU; this save runs on the CPU. "
            "Use codec='zstd' (portable) or install gdsckpt[cu12]/[cu13] and save CUDA tensors")
    return spec_for(codec, dtype, nvcomp_version, "gpu" if gpu else "cpu")


def cpu_auto_compresses() -> bool:
    """Whether codec="auto" on the CPU compresses (cpu_auto_spec): where this process may run on
    defaults.CPU_AUTO_COMPRESS_MIN_CORES cores or more; on fewer it stores raw, which saves faster
    there than the shuffle and zstd sharing the cores with the writes."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        cores = os.cpu_count() or 1
    return cores >= defaults.CPU_AUTO_COMPRESS_MIN_CORES


def candidates(codec, dtype: str, *, gpu: bool, nvcomp_version: str | None) -> list[dict]:
    """The specs a stream of `dtype` may get, resolve's first: for codec="auto" on the GPU and a
    dtype of GPU_AUTO_PLANES, typed ANS and byte-plane ANS; else resolve's alone. The caller keeps
    the one that stores a sample of the stream smallest, the first on a tie (codec_choice.py)."""
    first = resolve(codec, dtype, gpu=gpu, nvcomp_version=nvcomp_version)
    asked = codec.get(dtype, "auto") if isinstance(codec, dict) else codec
    if gpu and asked == "auto" and dtype in GPU_AUTO_PLANES:
        return [first, spec_for("ans-planes", dtype, nvcomp_version, "gpu")]
    return [first]


def gpu_can_decode(spec: dict) -> bool:
    return of(spec).gpu_decodes(spec)


def cpu_can_decode(spec: dict) -> bool:
    return of(spec).cpu_decodes(spec)


def no_cpu_decoder(spec: dict, path) -> CodecUnavailableError:
    """The error for a chunk the chosen backend cannot decode: nvCOMP's codecs with no GPU here,
    or byte-shuffled zstd on the GPU backend."""
    return of(spec).no_decoder(spec, path)
