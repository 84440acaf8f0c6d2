"""The dense torch dtypes gdsckpt stores, by the names the file uses for them."""

from __future__ import annotations

import torch

# The file names dtypes by these strings; a reader accepts nothing else.
_NAMES = [
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
]
BY_NAME: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _NAMES if hasattr(torch, n)}
NAME_OF: dict[torch.dtype, str] = {d: n for n, d in BY_NAME.items()}
ITEMSIZE: dict[str, int] = {n: d.itemsize for n, d in BY_NAME.items()}


def name_of(dtype: torch.dtype) -> str | None:
    return NAME_OF.get(dtype)


def ans_data_type(dtype_name: str) -> str:
    """nvCOMP ANS symbol type for a stream: typed ANS sees float structure, bytes otherwise."""
    if dtype_name in ("float16", "bfloat16"):
        return "<f2"
    if dtype_name == "float32":
        return "<f4"
    return "|u1"


# The dtypes NumPy has as well, by the same names: what a NumPy array or scalar in the state may
# hold (tree.flatten stores it as a tensor of that dtype; format.py refuses other dtypes there).
NUMPY_NAMES = ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
               "float16", "float32", "float64", "complex64", "complex128")
