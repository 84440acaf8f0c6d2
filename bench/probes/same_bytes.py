"""Byte identity on the GPU across a refactoring: the same fixed state (tests/writer_golden.py's,
on the GPU) saved by two source trees with each GPU codec, through save and save_async, and the
files compared as tests/writing/test_writer_bytes.py compares them (every byte before the index, the
index less its `created` time, the footer less the two checksums that cover `created`).

    python bench/probes/same_bytes.py BEFORE_ROOT AFTER_ROOT OUT.json

Each tree saves in a child process with only that tree on PYTHONPATH (ahead of any install).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = {  # name -> (how, codec)
    "ans": ("save", "ans"), "bitcomp": ("save", "bitcomp"), "zstd": ("save", "zstd"), "auto": ("save", "auto"),
    "raw": ("save", "raw"), "per-dtype": ("save", {"float32": "ans", "bfloat16": "bitcomp", "int64": "zstd"}),
    "async-auto": ("save_async", "auto"),
}

CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[3])
from writer_golden import golden_state
import gdsckpt
from gdsckpt.format.tree import flatten, unflatten
cases, out = json.loads(sys.argv[1]), sys.argv[2]
skeleton, leaves = flatten(golden_state())
state = unflatten(skeleton, [l.tensor.cuda() for l in leaves])
for name, (how, codec) in cases.items():
    path = f"{out}/{name}.gdsckpt"
    if how == "save":
        st = gdsckpt.save(state, path, codec=codec, chunk_bytes=8192)
    else:
        st = gdsckpt.save_async(state, path, codec=codec, chunk_bytes=8192).result()
    print(name, st.io_path, st.stored_bytes, flush=True)
"""


def _parts(data: bytes):
    from gdsckpt.format import file as fmt
    size = fmt.FOOTER_SIZE
    magic, major, minor, flags, off, length, _ck, file_len, reserved = fmt._FOOTER.unpack(data[-size:-8])
    index = json.loads(data[off:off + length])
    index.pop("created")
    index.pop("library")
    return data[:off], index, (magic, major, minor, flags, off, length, file_len, reserved)


def main() -> int:
    before, after, out_json = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve(), Path(sys.argv[3])
    tests = Path(__file__).resolve().parents[2] / "tests"
    dirs = {}
    for label, root in (("before", before), ("after", after)):
        d = Path(tempfile.mkdtemp(prefix=f"same-bytes-{label}-"))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(CASES), str(d), str(tests)], env=env,
                           capture_output=True, text=True, timeout=600)
        print(label, r.stdout, r.stderr[-3000:], flush=True)
        if r.returncode:
            raise SystemExit(f"{label} failed")
        dirs[label] = d
    results = {}
    for name in CASES:
        a = (dirs["before"] / f"{name}.gdsckpt").read_bytes()
        b = (dirs["after"] / f"{name}.gdsckpt").read_bytes()
        pa, pb = _parts(a), _parts(b)
        results[name] = {"bytes": len(b), "same_length": len(a) == len(b), "same_head": pa[0] == pb[0],
                         "same_index": pa[1] == pb[1], "same_footer": pa[2] == pb[2]}
        results[name]["identical"] = all(results[name][k] for k in ("same_length", "same_head", "same_index",
                                                                       "same_footer"))
        print(name, results[name], flush=True)
    out_json.write_text(json.dumps({"cases": {k: str(v) for k, v in CASES.items()}, "results": results}, indent=1))
    return 0 if all(r["identical"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
