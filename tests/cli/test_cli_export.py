"""`gdsckpt export --to safetensors|torch` and `gdsckpt convert`: bit-exact, one tensor read at a
time, nothing left behind when they fail."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest
import torch
from safetensors import safe_open

import gdsckpt
from conftest import assert_same
from gdsckpt.reading.reader import Checkpoint
from test_cli import run_cli


def _state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 32))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt, "step": 12, "tied": model[0].weight, "half": torch.randn(7, 3).bfloat16(),
            "empty": torch.empty(0, 5), "scalar": torch.tensor(3.5), "np": np.arange(6, dtype=np.int32),
            "blob": b"\x00\x01\xff", "flags": torch.tensor([True, False])}


@pytest.fixture
def saved(tmp_path, monkeypatch):
    p = tmp_path / "s.gdsckpt"
    gdsckpt.save(_state(), p, codec="zstd")
    reads = []
    real = Checkpoint.read

    def counted(self, keys, device=None):  # the real read; records how many keys each call asks for
        keys = list(keys)
        reads.append(keys)
        return real(self, keys, device)
    monkeypatch.setattr(Checkpoint, "read", counted)
    return p, reads


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_export_safetensors_every_key_bit_exact_one_tensor_at_a_time(saved, tmp_path):
    p, reads = saved
    dst = tmp_path / "s.safetensors"
    rc, out, err = run_cli("export", p, dst, "--to", "safetensors", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    with gdsckpt.open(p) as ck, safe_open(str(dst), "pt") as st:
        assert sorted(st.keys()) == sorted(ck.keys()) and doc["tensors"] == len(ck.keys())
        for k in ck.keys():
            a, b = st.get_tensor(k), ck.get_tensor(k)
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b)), k
    assert doc["values_left_out"] > 0 and doc["bytes"] == dst.stat().st_size
    assert reads and all(len(keys) == 1 for keys in reads)


def test_export_torch_loads_with_weights_only_and_is_a_valid_zip(saved, tmp_path):
    p, reads = saved
    dst = tmp_path / "s.pt"
    assert run_cli("export", p, dst, "--to", "torch")[0] == 0
    assert all(len(keys) == 1 for keys in reads)
    assert zipfile.ZipFile(dst).testzip() is None  # every record's CRC-32 written
    got = torch.load(dst, weights_only=True)
    want = gdsckpt.load(p)
    want["np"], want["blob"] = torch.from_numpy(want["np"]), torch.frombuffer(bytearray(want["blob"]), dtype=torch.uint8)
    assert_same(got, want)
    assert got["tied"] is got["model"]["0.weight"]  # one storage, as torch.save keeps tied weights
    assert got["model"]._metadata == want["model"]._metadata


def test_convert_is_bit_exact_keeps_the_skeleton_and_reads_one_tensor_at_a_time(saved, tmp_path):
    p, reads = saved
    dst = tmp_path / "raw.gdsckpt"
    rc, out, _ = run_cli("convert", p, dst, "--codec", "raw", "--json")
    assert rc == 0 and json.loads(out)["codec"] == "raw"
    assert reads and all(len(keys) == 1 for keys in reads)
    got, want = gdsckpt.load(dst), gdsckpt.load(p)
    assert np.array_equal(got.pop("np"), want.pop("np"))
    assert_same(got, want)
    a, b = gdsckpt.open(p), gdsckpt.open(dst)
    assert a.index.skeleton == b.index.skeleton and a.index.devices == b.index.devices and a.keys() == b.keys()
    assert {s["codec"] for s in b.streams()} == {"raw"}
    assert sorted(x.name for x in tmp_path.iterdir()) == ["raw.gdsckpt", "s.gdsckpt"]  # the scratch is gone


def test_failures_leave_nothing(saved, tmp_path):
    p, _ = saved
    rc, _, err = run_cli("convert", p, tmp_path / "x.gdsckpt", "--codec", "ans")  # no GPU here
    assert rc == 1 and "nvCOMP" in err
    c = tmp_path / "c.gdsckpt"
    gdsckpt.save({"z": torch.zeros(3, dtype=torch.complex128)}, c)
    rc, _, err = run_cli("export", c, tmp_path / "c.safetensors", "--to", "safetensors")
    assert rc == 2 and "'z' is complex128" in err
    rc, _, err = run_cli("export", p, tmp_path / "no" / "dir.pt", "--to", "torch")
    assert rc == 3
    rc, _, _ = run_cli("export", tmp_path / "missing.gdsckpt", tmp_path / "m.pt", "--to", "torch")
    assert rc == 3
    m = tmp_path / "m.gdsckpt"  # safetensors reserves the key for its header's metadata
    gdsckpt.save({"w": torch.ones(3), "__metadata__": torch.arange(4)}, m)
    rc, _, err = run_cli("export", m, tmp_path / "m.safetensors", "--to", "safetensors")
    assert rc == 2 and "tensor '__metadata__'" in err
    source = p.read_bytes()
    for to in ("torch", "safetensors"):  # an export over its own source would replace it
        rc, _, err = run_cli("export", p, p, "--to", to)
        assert rc == 2 and "is the source checkpoint" in err
    assert p.read_bytes() == source
    assert sorted(x.name for x in tmp_path.iterdir()) == ["c.gdsckpt", "m.gdsckpt", "s.gdsckpt"]


def test_a_key_that_is_not_valid_unicode_is_refused_for_safetensors_and_shown_escaped(tmp_path):
    """A key with a lone surrogate (os.fsdecode of a file name that is not UTF-8): export --to
    safetensors refuses it (exit 2, naming it) instead of writing a header safetensors cannot
    parse; inspect shows it escaped where stdout's encoding is strict, not exit 2."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    p = tmp_path / "s.gdsckpt"
    gdsckpt.save({"w\udc80x": torch.ones(3), "ok": torch.zeros(2)}, p)
    out = tmp_path / "s.safetensors"
    rc, _, err = run_cli("export", p, out, "--to", "safetensors")
    assert rc == 2 and "not valid Unicode" in err and not out.exists()
    env = dict(os.environ, PYTHONIOENCODING="utf-8:strict", PYTHONPATH=str(Path(gdsckpt.__file__).parents[1]))
    r = subprocess.run([sys.executable, "-m", "gdsckpt", "inspect", str(p)], capture_output=True, text=True,
                       env=env, timeout=120, errors="replace")
    assert r.returncode == 0 and "w\\udc80x" in r.stdout, (r.returncode, r.stdout, r.stderr)
