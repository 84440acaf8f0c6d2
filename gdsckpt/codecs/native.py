"""What the codecs stored in nvCOMP's native bitstream (ans, bitcomp) share: one nvCOMP buffer per
chunk, with nvCOMP's own header; encoded and decoded by nvCOMP on a GPU only, of the same major
version as the writer's (nvCOMP 6 changed the ANS bitstream)."""

from __future__ import annotations

from ..errors import CodecUnavailableError
from .base import Codec


class NvcompNative(Codec):
    # nvCOMP's native bitstreams spend at least a size-table entry per 64 KiB piece.
    max_expansion = 1 << 16
    nvcomp_native = True

    def fields_problem(self, spec: dict) -> str | None:
        if not (isinstance(spec.get("nvcomp"), str) and isinstance(spec.get("data_type"), str)):
            return f"{spec['name']} codec without nvCOMP version or data type"
        return None

    def no_decoder(self, spec: dict, path) -> CodecUnavailableError:
        return CodecUnavailableError(
            f"{str(path)!r} holds {spec['name']!r} chunks, which only nvCOMP on a GPU can decode, and this "
            "process has no usable GPU. On a GPU machine, make a portable copy with "
            f"`gdsckpt convert {path} OUT --codec zstd` (zstd and raw chunks decode on any CPU)")
