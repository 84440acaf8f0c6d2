"""The fixed states and options behind tests/data/writer_bytes/: files written once by the code
before the save seam (issue 19), which every later writer must reproduce byte for byte, apart
from the fields that differ on every save (test_writer_bytes.py says which).

Regenerate only when the format itself changes on purpose (and say so in the commit):

    PYTHONPATH=<tree> python tests/writer_golden.py tests/data/writer_bytes
"""

from __future__ import annotations

import json
import sys
from collections import OrderedDict
from pathlib import Path

import torch

CHUNK_BYTES = 8192  # several chunks from a small state, records that straddle tensors

# name -> (how it is saved, codec)
CASES = {
    "raw": ("save", "raw"),
    "zstd": ("save", "zstd"),
    "auto": ("save", "auto"),  # CPU auto: byte-shuffled zstd
    "per-dtype": ("save", {"float32": "zstd", "bfloat16": "raw", "int64": "auto"}),
    "async-zstd": ("save_async", "zstd"),  # the pool's writer: io_path "pool"
}


def golden_state() -> dict:
    """Every kind of node the tree stores: dtypes, an alias (tied weights), an OrderedDict with
    _metadata, a non-contiguous view, an empty tensor, plain values. Deterministic."""
    g = torch.Generator().manual_seed(1234)
    emb = torch.randn(16, 32, generator=g)
    model = OrderedDict([("emb.weight", emb), ("head.weight", emb),  # tied: stored once
                         ("ln.bias", torch.zeros(32)), ("ln.weight", torch.ones(32))])
    model._metadata = OrderedDict([("", {"version": 1}), ("ln", {"version": 2})])
    return {
        "model": model,
        "moments": {"m": (torch.randn(1500, generator=g) * 1e-3),
                    "v": torch.rand(900, generator=g).square() * 1e-6},
        "half": torch.randn(1200, generator=g).to(torch.bfloat16),
        "ids": torch.randint(-1000, 1000, (500,), generator=g),
        "mask": torch.rand(300, generator=g) > 0.5,
        "transposed": torch.arange(60, dtype=torch.float64).reshape(6, 10).t(),
        "empty": torch.empty(0, 4),
        "plain": [7, 2.5, "cosine", None, True, (1, 2)],
    }


def write_all(out: Path) -> dict:
    import zstandard

    import gdsckpt

    out.mkdir(parents=True, exist_ok=True)
    for name, (how, codec) in CASES.items():
        path = out / f"{name}.gdsckpt"
        if how == "save":
            gdsckpt.save(golden_state(), path, codec=codec, chunk_bytes=CHUNK_BYTES, backend="cpu")
        else:
            gdsckpt.save_async(golden_state(), path, codec=codec, chunk_bytes=CHUNK_BYTES, backend="cpu").result(60)
    env = {"zstd": ".".join(map(str, zstandard.ZSTD_VERSION)), "torch": torch.__version__,
           "gdsckpt": gdsckpt.__version__, "written_by": str(Path(gdsckpt.__file__).parent.parent)}
    (out / "ENV.json").write_text(json.dumps(env, indent=1) + "\n")
    return env


if __name__ == "__main__":
    print(write_all(Path(sys.argv[1])))
