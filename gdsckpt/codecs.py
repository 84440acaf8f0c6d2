"""Codec names, how a stream picks one, and the layout of zstd frames inside a chunk.

A codec spec is the JSON the index records for a stream, e.g.
{"name": "ans", "data_type": "<f4", "nvcomp": "6.0.0"}. The implementations live in
the backends: gdsckpt/cpu_backend.py (raw, zstd) and gdsckpt/gpu/codecs.py (nvCOMP);
both sides agree on the bytes of zstd (standard frames) and raw.
"""

from __future__ import annotations

from . import dtypes
from .defaults import ANS_INTERNAL_CHUNK, CPU_AUTO_LEVEL, ZSTD_FRAME_BYTES, ZSTD_LEVEL
from .errors import CodecUnavailableError

CPU_CODECS = ("raw", "zstd")
NVCOMP_CODECS = ("ans", "bitcomp")
ALL_CODECS = CPU_CODECS + NVCOMP_CODECS
# A zstd chunk is a run of standard zstd frames, their compressed lengths recorded in the
# chunk record; frame sizes per side are in defaults.ZSTD_FRAME_BYTES.
__all__ = ["ZSTD_FRAME_BYTES", "spec_for", "resolve", "frame_bounds", "frame_offsets", "check_zstd_header"]

_BITCOMP_TYPES = {"float16": "<f2", "bfloat16": "<u2", "float32": "<f4", "float64": "<f8",
                  "int16": "<i2", "int32": "<i4", "int64": "<i8", "uint16": "<u2", "uint32": "<u4",
                  "uint64": "<u8", "int8": "|i1"}


def spec_for(name: str, dtype: str, nvcomp_version: str | None, side: str = "cpu") -> dict:
    """The spec a stream of `dtype` gets for codec `name`."""
    if name == "ans":
        return {"name": "ans", "data_type": dtypes.ans_data_type(dtype), "nvcomp": nvcomp_version,
                "uncomp_chunk_size": ANS_INTERNAL_CHUNK}
    if name == "bitcomp":
        return {"name": "bitcomp", "data_type": _BITCOMP_TYPES.get(dtype, "|u1"), "nvcomp": nvcomp_version}
    if name == "zstd":
        return {"name": "zstd", "level": ZSTD_LEVEL, "frame_bytes": ZSTD_FRAME_BYTES[side]}
    if name == "raw":
        return {"name": "raw"}
    raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(('auto',) + ALL_CODECS)}")


def resolve(codec, dtype: str, *, gpu: bool, nvcomp_version: str | None) -> dict:
    """The spec of one stream. `codec` is "auto", a name, or {dtype name: name}."""
    if isinstance(codec, dict):
        codec = codec.get(dtype, "auto")
    if codec == "auto":
        if not gpu:
            return cpu_auto_spec(dtype)
        codec = "ans"
    if codec in NVCOMP_CODECS and not gpu:
        raise CodecUnavailableError(
            f"codec {codec!r} needs nvCOMP on a GPU; this save runs on the CPU. "
            "Use codec='zstd' (portable) or install gdsckpt[cu12]/[cu13] and save CUDA tensors")
    return spec_for(codec, dtype, nvcomp_version, "gpu" if gpu else "cpu")


# Byte-shuffle width per dtype: the size of one scalar (a complex number is two), so that each
# plane holds one byte position of every element and the exponent bytes of floats sit together.
_SHUFFLE_WIDTH = {"float16": 2, "bfloat16": 2, "int16": 2, "uint16": 2, "complex32": 2,
                  "float32": 4, "int32": 4, "uint32": 4, "complex64": 4,
                  "float64": 8, "int64": 8, "uint64": 8, "complex128": 8}
SHUFFLE_WIDTHS = (2, 4, 8)  # the values FORMAT.md allows for a zstd spec's optional "shuffle"


def cpu_auto_spec(dtype: str) -> dict:
    """codec="auto" on the CPU: zstd at a fast level over byte-shuffled chunks (defaults.py says why).
    Shuffled zstd decodes on the CPU only; the GPU side refuses it (gpu_can_decode)."""
    spec = {"name": "zstd", "level": CPU_AUTO_LEVEL, "frame_bytes": ZSTD_FRAME_BYTES["cpu"]}
    width = _SHUFFLE_WIDTH.get(dtype, 1)
    if width > 1:
        spec["shuffle"] = width
    return spec


def gpu_can_decode(spec: dict) -> bool:
    """nvCOMP decodes every codec but byte-shuffled zstd, whose unshuffle is CPU code."""
    return "shuffle" not in spec


def cpu_can_decode(spec: dict) -> bool:
    return spec["name"] in CPU_CODECS


def no_cpu_decoder(spec: dict, path) -> CodecUnavailableError:
    """The error for a chunk the chosen backend cannot decode: nvCOMP's codecs with no GPU here,
    or byte-shuffled zstd on the GPU backend."""
    if not gpu_can_decode(spec):
        return CodecUnavailableError(
            f"{str(path)!r} holds byte-shuffled zstd chunks (codec='auto' on the CPU writes them), which only "
            "the CPU backend decodes; open it with backend='cpu' (device='cuda' still puts the tensors on the GPU)")
    return CodecUnavailableError(
        f"{str(path)!r} holds {spec['name']!r} chunks, which only nvCOMP on a GPU can decode, and this "
        "process has no usable GPU. On a GPU machine, make a portable copy with "
        f"`gdsckpt convert {path} OUT --codec zstd` (zstd and raw chunks decode on any CPU)")


FRAME_ALIGN = 16  # nvCOMP reads each frame from a 16-byte aligned address


def frame_bounds(length: int, frame_bytes: int):
    """(offset, length) of each uncompressed zstd frame of a chunk."""
    return [(o, min(frame_bytes, length - o)) for o in range(0, length, frame_bytes)]


def frame_offsets(frames: list[int]) -> list[int]:
    """Where each compressed frame starts in the stored bytes: each at the next 16-byte
    boundary after the previous one, the gap zero-filled. Returns len(frames)+1 offsets,
    the last being the stored length."""
    offsets, pos = [], 0
    for k in frames:
        offsets.append(pos)
        pos = pos + k if len(offsets) == len(frames) else (pos + k + FRAME_ALIGN - 1) // FRAME_ALIGN * FRAME_ALIGN
    return offsets + [pos]


ZSTD_HEADER_MAX = 18  # magic + the longest frame header


def check_zstd_header(head, n: int) -> None:
    """A frame must start with zstd's magic and, if it states its content size, claim `n` bytes.
    zstandard sizes its output from that claim, and nVCOMP's decoder trusts its input: both
    see a frame only after this check (and the chunk checksum) passed."""
    import zstandard  # here, not at the top: format parsing must not pull in the zstd implementation

    try:
        claimed = zstandard.frame_content_size(bytes(head))
    except zstandard.ZstdError as e:
        raise ValueError(f"not a zstd frame header ({e})") from None
    if claimed not in (-1, n):
        raise ValueError(f"zstd frame header claims {claimed} bytes, the frame holds {n}")
