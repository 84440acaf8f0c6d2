"""Codec names, how a stream picks one, and the CPU implementations (raw, zstd).

A codec spec is the JSON the index records for a stream, e.g.
{"name": "ans", "data_type": "<f4", "nvcomp": "6.0.0"}. The GPU implementations
live in gdsckpt/gpu/codecs.py; both sides agree on the bytes of zstd (standard
frames) and raw.
"""

from __future__ import annotations

import numpy as np
import zstandard

from . import dtypes
from .errors import CodecUnavailableError

CPU_CODECS = ("raw", "zstd")
NVCOMP_CODECS = ("ans", "bitcomp")
ALL_CODECS = CPU_CODECS + NVCOMP_CODECS
# A zstd chunk is a run of standard zstd frames, their compressed lengths recorded in the
# chunk record. The GPU cuts small frames for parallelism (nvCOMP's RAW zstd takes one
# frame per batch entry, 16 MiB at most); the CPU cuts large ones for ratio.
ZSTD_FRAME_BYTES = {"cpu": 16 << 20, "gpu": 1 << 20}
ZSTD_LEVEL = 3
# nvCOMP splits each chunk into pieces of this size, each with its own frequency table. 512 KiB
# instead of nvCOMP's 64 KiB saved 33.5% instead of 31.4% of bf16 weights and 14.1% instead of
# 12.1% of fp32 state, at the same speed (bench/results/2026-11-22-h100-e/ans-options.json).
ANS_INTERNAL_CHUNK = 512 << 10

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
        codec = "ans" if gpu else "zstd"
    if codec in NVCOMP_CODECS and not gpu:
        raise CodecUnavailableError(
            f"codec {codec!r} needs nvCOMP on a GPU; this save runs on the CPU. "
            "Use codec='zstd' (portable) or install gdsckpt[cu12]/[cu13] and save CUDA tensors")
    return spec_for(codec, dtype, nvcomp_version, "gpu" if gpu else "cpu")


def cpu_can_decode(spec: dict) -> bool:
    return spec["name"] in CPU_CODECS


def no_cpu_decoder(spec: dict, path) -> CodecUnavailableError:
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
    try:
        claimed = zstandard.frame_content_size(bytes(head))
    except zstandard.ZstdError as e:
        raise ValueError(f"not a zstd frame header ({e})") from None
    if claimed not in (-1, n):
        raise ValueError(f"zstd frame header claims {claimed} bytes, the frame holds {n}")


class CpuCodecs:
    """raw and zstd on host memory. zstandard releases the GIL, so the ring overlaps it with I/O."""

    def __init__(self):
        self._c = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=-1)
        self._d = zstandard.ZstdDecompressor()

    def encode(self, spec: dict, src: np.ndarray, out: np.ndarray) -> tuple[int, list | None]:
        """Compress src into out: (stored length, frame lengths), or (-1, None) if it would not shrink."""
        if spec["name"] != "zstd":
            return -1, None
        pos, frames = 0, []
        for o, n in frame_bounds(len(src), spec["frame_bytes"]):
            start = (pos + FRAME_ALIGN - 1) // FRAME_ALIGN * FRAME_ALIGN
            data = self._c.compress(src[o:o + n])
            if start + len(data) >= len(src):
                return -1, None
            out[pos:start] = 0
            out[start:start + len(data)] = np.frombuffer(data, dtype=np.uint8)
            pos = start + len(data)
            frames.append(len(data))
        return pos, frames

    def decode(self, spec: dict, stored: np.ndarray, out: np.ndarray, frames: list | None) -> None:
        if spec["name"] != "zstd":
            raise CodecUnavailableError(f"no CPU decoder for codec {spec['name']!r}")
        for (o, n), pos, clen in zip(frame_bounds(len(out), spec["frame_bytes"]), frame_offsets(frames), frames):
            check_zstd_header(stored[pos:pos + min(clen, ZSTD_HEADER_MAX)], n)
            data = self._d.decompress(stored[pos:pos + clen], max_output_size=n)
            if len(data) != n:
                raise ValueError(f"zstd frame decoded to {len(data)} bytes, expected {n}")
            out[o:o + n] = np.frombuffer(data, dtype=np.uint8)
