"""ans-planes: byte-plane ANS. The chunk's bytes byte-shuffled (FORMAT.md's "shuffle": byte plane 0
of every element, then plane 1, ...), then nvCOMP's ANS over bytes, each 512 KiB piece of a plane
with its own frequency table. On AdamW's moments it stores less than typed ANS (exp_avg_sq 17.8%
saved against 15.0% on the H100); codec="auto" on the GPU picks it per stream where a sample says
so (gdsckpt/engine/codec_choice.py). Encoded and decoded on the GPU only: the shuffle and unshuffle are
kernels of gdsckpt/engine/gpu/kernels.py, around nvCOMP."""

from __future__ import annotations

from gdsckpt.core.defaults import ANS_INTERNAL_CHUNK
from .ans import Ans
from .base import SHUFFLE_WIDTH

BYTES = "|u1"  # the ANS symbol type: always bytes, the planes are what separates the byte positions


class AnsPlanes(Ans):
    name = "ans-planes"
    shuffles = True

    def spec(self, dtype: str, *, side: str, nvcomp_version: str | None) -> dict:
        """One-byte dtypes get no "shuffle" (one plane: ANS over bytes)."""
        spec = {"name": self.name, "data_type": BYTES, "nvcomp": nvcomp_version, "uncomp_chunk_size": ANS_INTERNAL_CHUNK}
        width = SHUFFLE_WIDTH.get(dtype, 1)
        if width > 1:
            spec["shuffle"] = width
        return spec

    def fields_problem(self, spec: dict) -> str | None:
        problem = super().fields_problem(spec)
        if problem is None and spec["data_type"] != BYTES:
            problem = f"ans-planes codec with symbol type {spec['data_type']!r}, not bytes ({BYTES!r})"
        return problem
