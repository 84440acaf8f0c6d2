"""raw: the logical bytes themselves. Every chunk is stored with "raw": true, which any backend
reads with a copy; no coder is involved on either side."""

from __future__ import annotations

from .base import Codec


class Raw(Codec):
    name = "raw"
    max_expansion = 1
    always_raw = True
    cpu_encodes = True

    def spec(self, dtype: str, *, side: str, nvcomp_version: str | None) -> dict:
        return {"name": "raw"}

    def cpu_decodes(self, spec: dict) -> bool:
        return True

    def gpu_decodes(self, spec: dict) -> bool:
        return True
