"""bitcomp: nvCOMP's Bitcomp, typed by the stream's dtype where Bitcomp has the type, bytes
otherwise."""

from __future__ import annotations

from .native import NvcompNative

_DATA_TYPES = {"float16": "<f2", "bfloat16": "<u2", "float32": "<f4", "float64": "<f8",
               "int16": "<i2", "int32": "<i4", "int64": "<i8", "uint16": "<u2", "uint32": "<u4",
               "uint64": "<u8", "int8": "|i1"}


class Bitcomp(NvcompNative):
    name = "bitcomp"
    nvcomp_algorithm = "Bitcomp"

    def spec(self, dtype: str, *, side: str, nvcomp_version: str | None) -> dict:
        return {"name": "bitcomp", "data_type": _DATA_TYPES.get(dtype, "|u1"), "nvcomp": nvcomp_version}
