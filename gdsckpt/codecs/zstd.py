"""zstd: a chunk is a run of standard zstd frames (the framed layout, codecs/base.py), optionally
over the chunk's bytes byte-shuffled first (FORMAT.md's "shuffle", CPU only). The CPU coder is
zstandard's (codecs/zstd_cpu.py); nvCOMP writes and reads the same frames through its RAW
bitstream, so unshuffled zstd is the portable codec."""

from __future__ import annotations

from gdsckpt.core.defaults import CPU_AUTO_LEVEL, ZSTD_FRAME_BYTES, ZSTD_LEVEL
from ..errors import CodecUnavailableError
from .base import SHUFFLE_WIDTH, Codec, Threads, frame_bounds, frame_offsets, is_int
from .zstd_cpu import ZstdCpu

# The frame sizes a reader accepts: from 4 KiB to the largest chunk the format allows (2 GiB).
FRAME_BYTES_RANGE = (4 << 10, 1 << 31)
ZSTD_HEADER_MAX = 18  # magic + the longest frame header


class Zstd(Codec):
    name = "zstd"
    # zstd's densest block (RLE) is 4 bytes for 128 KiB.
    max_expansion = 1 << 15
    framed = True
    shuffles = True
    cpu_encodes = True
    nvcomp_algorithm = "Zstd"

    def spec(self, dtype: str, *, side: str, nvcomp_version: str | None) -> dict:
        return {"name": "zstd", "level": ZSTD_LEVEL, "frame_bytes": ZSTD_FRAME_BYTES[side]}

    def fields_problem(self, spec: dict) -> str | None:
        lo, hi = FRAME_BYTES_RANGE
        if not (is_int(spec.get("frame_bytes")) and lo <= spec["frame_bytes"] <= hi):
            return "zstd codec without a valid frame size"
        return None

    def frames_problem(self, spec: dict, length: int, stored: int, frames) -> str | None:
        n_frames = -(-length // spec["frame_bytes"])
        if not (isinstance(frames, list) and len(frames) == n_frames
                and all(is_int(f) and f > 0 for f in frames) and frame_offsets(frames)[-1] == stored):
            return "zstd frame lengths do not match the chunk"
        return None

    def check_stored(self, stored, spec: dict, length: int, frames) -> None:
        """Every frame's header, as check_zstd_header checks it."""
        bounds = frame_bounds(length, spec["frame_bytes"])
        if len(frames) != len(bounds):
            raise ValueError(f"{len(frames)} zstd frames recorded for {len(bounds)} frame bounds")
        for (_, n), pos, clen in zip(bounds, frame_offsets(frames), frames):
            check_zstd_header(stored[pos:pos + min(clen, ZSTD_HEADER_MAX)], n)

    def cpu_decodes(self, spec: dict) -> bool:
        return True

    def gpu_decodes(self, spec: dict) -> bool:
        """nvCOMP decodes the frames, but the unshuffle is CPU code."""
        return "shuffle" not in spec

    def cpu_coder(self, threads: Threads) -> ZstdCpu:
        return ZstdCpu(threads)

    def no_decoder(self, spec: dict, path) -> CodecUnavailableError:
        if "shuffle" in spec:
            return CodecUnavailableError(
                f"{str(path)!r} holds byte-shuffled zstd chunks (codec='auto' on the CPU writes them), which only "
                "the CPU backend decodes; open it with backend='cpu' (device='cuda' still puts the tensors on the GPU)")
        return super().no_decoder(spec, path)


def cpu_auto_spec(dtype: str) -> dict:
    """codec="auto" on the CPU: zstd at a fast level over byte-shuffled chunks (defaults.py says
    why). Shuffled zstd decodes on the CPU only; the GPU side refuses it (Zstd.gpu_decodes)."""
    spec = {"name": "zstd", "level": CPU_AUTO_LEVEL, "frame_bytes": ZSTD_FRAME_BYTES["cpu"]}
    width = SHUFFLE_WIDTH.get(dtype, 1)
    if width > 1:
        spec["shuffle"] = width
    return spec


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
