"""ans: nvCOMP's ANS entropy coder, typed by the stream's dtype (float16/bfloat16 and float32
symbols; bytes otherwise). codec="auto" on the GPU writes it."""

from __future__ import annotations

from gdsckpt.core import dtypes
from gdsckpt.core.defaults import ANS_INTERNAL_CHUNK
from .native import NvcompNative


class Ans(NvcompNative):
    name = "ans"
    nvcomp_algorithm = "ANS"

    def spec(self, dtype: str, *, side: str, nvcomp_version: str | None) -> dict:
        return {"name": "ans", "data_type": dtypes.ans_data_type(dtype), "nvcomp": nvcomp_version,
                "uncomp_chunk_size": ANS_INTERNAL_CHUNK}
