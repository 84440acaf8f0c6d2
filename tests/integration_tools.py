"""Shared by tests/test_integrations_*.py: each runs training in child processes (the test file
itself, run as a script) and compares what the children report. A child prints one JSON line
prefixed RESULT; tensors are compared by a digest of their bytes, so that "bit-identical" means
bit-identical and no pickle is needed to carry them between processes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
PREFIX = "RESULT "
GDSCKPT_MAGIC = b"GDSCKPT\x00"


def child_pythonpath() -> str:
    """This tree first, then the caller's PYTHONPATH (a GPU host's packages may live on it)."""
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def run_child(script: Path, *args: str, timeout: float = 300, env: dict | None = None) -> dict:
    """Run `python script args...` with this tree's gdsckpt first on the path and one compute
    thread (the same floating-point order in every child); the child's RESULT line, parsed."""
    full_env = {**os.environ, "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled", **(env or {})}
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=REPO)
    lines = [l for l in proc.stdout.splitlines() if l.startswith(PREFIX)]
    assert proc.returncode == 0 and lines, (
        f"child {script.name} {' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
        f"--- stderr\n{proc.stderr[-8000:]}")
    return json.loads(lines[-1][len(PREFIX):])


def report(result: dict) -> None:
    """In a child: hand `result` to the parent."""
    print(PREFIX + json.dumps(result), flush=True)


def digests(state, prefix: str = "") -> dict[str, str]:
    """{key path: sha256 of dtype, shape and bytes} of every tensor in a nested state."""
    out: dict[str, str] = {}
    if isinstance(state, torch.Tensor):
        t = state.detach().cpu().contiguous()
        h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        out[prefix] = h.hexdigest()
    elif isinstance(state, dict):
        for k, v in state.items():
            out.update(digests(v, f"{prefix}/{k}" if prefix else str(k)))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(digests(v, f"{prefix}/{i}" if prefix else str(i)))
    return out


def gdsckpt_files_only(root: Path, allowed_other: tuple[str, ...] = ()) -> list[str]:
    """Every file under `root` that is neither a gdsckpt file nor one of `allowed_other` (by name
    suffix): what must be empty when a checkpoint may hold no pickle or torch.save file."""
    bad = []
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.name.endswith(allowed_other):
            with open(p, "rb") as f:
                if f.read(8) != GDSCKPT_MAGIC:
                    bad.append(str(p.relative_to(root)))
    return bad
