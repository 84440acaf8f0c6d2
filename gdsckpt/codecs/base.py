"""What a codec is to gdsckpt (`Codec`), the byte layout of a framed chunk, and the interfaces of
a codec's CPU coder.

A codec declares: the spec the index records for its streams (`spec`), what a reader accepts of
such a spec and of its chunk records (`spec_problem`, `max_expansion`, `max_stored`,
`frames_problem`), and where it encodes and decodes: the CPU through its own CPU coder
(`cpu_coder`), the GPU through the nvCOMP algorithm it names (`nvcomp_algorithm`, which
gdsckpt/engine/gpu/codecs.py maps onto nvCOMP). Each codec is a subclass in its own module; the registry
(codecs/__init__.py) lists them.
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Callable, ClassVar, Protocol

from ..errors import CodecUnavailableError

# ---------------------------------------------------------------- the layout of a framed chunk
# A framed codec's chunk (zstd's) is its logical bytes cut into `frame_bytes` pieces, each
# compressed on its own; the compressed frames follow each other at FRAME_ALIGN boundaries and
# the chunk record lists their lengths (FORMAT.md, "Codecs").

FRAME_ALIGN = 16  # nvCOMP reads each frame from a 16-byte aligned address


def frame_bounds(length: int, frame_bytes: int):
    """(offset, length) of each uncompressed frame of a chunk."""
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


# ---------------------------------------------------------------- spec fields any spec may carry
# A reader checks a field it knows wherever it appears, so that a damaged or forged spec cannot
# carry one past it on a codec that ignores the field.

SHUFFLE_WIDTHS = (2, 4, 8)  # the values FORMAT.md allows for a spec's optional "shuffle" (zstd, ans-planes)
# Byte-shuffle width per dtype: the size of one scalar (a complex number is two), so that each
# plane holds one byte position of every element and the exponent bytes of floats sit together.
# Dtypes not named here are one byte wide: no shuffle.
SHUFFLE_WIDTH = {"float16": 2, "bfloat16": 2, "int16": 2, "uint16": 2, "complex32": 2,
                 "float32": 4, "int32": 4, "uint32": 4, "complex64": 4,
                 "float64": 8, "int64": 8, "uint64": 8, "complex128": 8}


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def chunk_size_problem(spec: dict) -> str | None:
    """nvCOMP's internal chunk size (ans's "uncomp_chunk_size"), where a spec gives one."""
    ucs = spec.get("uncomp_chunk_size")
    if ucs is not None and not (is_int(ucs) and 4 << 10 <= ucs <= 16 << 20 and ucs & (ucs - 1) == 0):
        return f"nvCOMP chunk size {ucs!r} is not a power of two in [4 KiB, 16 MiB]"
    return None


# ---------------------------------------------------------------- the CPU side


class Threads(Protocol):
    """The CPU backend's codec threads, over which a CPU coder spreads one chunk's work."""

    count: int
    pool: Executor | None  # None: a single thread, the work runs in the caller

    def map(self, fn: Callable, items) -> list:
        """[fn(x) for x in items], spread over the threads."""
        ...


class CpuCoder(Protocol):
    """A codec's encoder and decoder on host memory (numpy uint8 arrays)."""

    def encode(self, spec: dict, src, out) -> tuple[int, list | None]:
        """(stored length, frame lengths or None) with the stored bytes in `out`, or (-1, None):
        the chunk would not shrink, store it raw."""
        ...

    def decode(self, spec: dict, stored, out, frames: list | None) -> None:
        """`out` (the chunk's logical length) gets the chunk's logical bytes."""
        ...


# ---------------------------------------------------------------- the codec


class Codec:
    """One codec. Subclasses set the class attributes and override the methods that differ."""

    name: ClassVar[str]  # its name in the index ({"name": ...}) and in save(codec=...)
    # Logical bytes one stored byte can decode to, at most: a chunk record claiming more is
    # refused, as it would make the reader allocate tensors that the chunk cannot fill.
    max_expansion: ClassVar[int]
    always_raw: ClassVar[bool] = False  # every chunk is stored as its logical bytes ("raw": true)
    framed: ClassVar[bool] = False  # chunks are frames laid out as above; records list their lengths
    shuffles: ClassVar[bool] = False  # its spec may carry FORMAT.md's byte shuffle ("shuffle")
    cpu_encodes: ClassVar[bool] = False  # a save on the CPU backend can write it
    nvcomp_algorithm: ClassVar[str | None] = None  # nvCOMP's name for it; None: nvCOMP has no coder for it
    # Its stored bytes are nvCOMP's native bitstream, which only nvCOMP of the major version that
    # wrote it (the spec's "nvcomp") reads.
    nvcomp_native: ClassVar[bool] = False

    def spec(self, dtype: str, *, side: str, nvcomp_version: str | None) -> dict:
        """The spec of a stream of `dtype` saved on `side` ("cpu" or "gpu")."""
        raise NotImplementedError

    def spec_problem(self, spec: dict) -> str | None:
        """Why a reader refuses `spec` (this codec's), or None: its own fields first, then the
        optional fields any spec may carry."""
        problem = self.fields_problem(spec) or chunk_size_problem(spec)
        if problem is None and "shuffle" in spec:
            w = spec["shuffle"]
            if not self.shuffles:
                problem = f"byte shuffle on a {self.name!r} stream, whose codec has no byte planes"
            elif not (is_int(w) and w in SHUFFLE_WIDTHS):
                problem = f"byte shuffle {w!r} is not 2, 4 or 8"
        return problem

    def fields_problem(self, spec: dict) -> str | None:
        """Why a reader refuses this codec's own fields of `spec`, or None."""
        return None

    def max_stored(self, length: int) -> int:
        """The most stored bytes a compressed chunk of `length` logical bytes may claim: above
        both zstd's and nvCOMP's worst cases (the writer stores a chunk raw before that)."""
        return length + (length >> 3) + (1 << 20)

    def frames_problem(self, spec: dict, length: int, stored: int, frames) -> str | None:
        """A framed codec: why a compressed chunk's record `frames` is refused, or None."""
        return None

    def check_stored(self, stored, spec: dict, length: int, frames) -> None:
        """What a reader checks of a compressed chunk's stored bytes before any decoder sees them
        (after its checksum); raises ValueError. Nothing, for a codec whose decoder checks its
        own input."""

    def cpu_decodes(self, spec: dict) -> bool:
        """Whether the CPU backend reads this stream's chunks."""
        return False

    def gpu_decodes(self, spec: dict) -> bool:
        """Whether the GPU backend reads this stream's chunks."""
        return self.nvcomp_algorithm is not None

    def cpu_coder(self, threads: Threads) -> CpuCoder | None:
        """Its CPU encoder and decoder, on the CPU backend's `threads`; None: it has none."""
        return None

    def no_decoder(self, spec: dict, path) -> CodecUnavailableError:
        """The error for chunks of `spec` that the backend chosen for them cannot decode."""
        return CodecUnavailableError(f"{str(path)!r} holds {self.name!r} chunks, which no decoder here reads")
