"""`gdsckpt inspect` and `gdsckpt verify` of a file and of a DCP step folder (GdsckptWriter's):
the folder's .metadata, the keys it names and every rank file; damage exits 1 and says where."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import gdsckpt
from ckpt_tools import flip_chunk_byte
from gdsckpt.dcp import GdsckptWriter
from test_cli import run_cli


def _dcp_folder(d):
    state = {"w": torch.randn(64, 32), "b": torch.arange(10.0).bfloat16(), "step": 7, "extra": {"lr": 0.1}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=GdsckptWriter(d), no_dist=True)
    return d


def test_inspect_and_verify_a_dcp_folder(tmp_path):
    d = _dcp_folder(tmp_path / "step_100")
    rank_files = sorted(p.name for p in d.glob("*.gdsckpt"))
    rc, out, err = run_cli("inspect", d)
    assert rc == 0 and "DCP checkpoint" in out and all(f in out for f in rank_files), (out, err)
    rc, out, _ = run_cli("inspect", d, "--json")
    doc = json.loads(out)
    assert doc["kind"] == "dcp" and sorted(doc["dcp"]["files"]) == rank_files
    assert doc["dcp"]["tensors"] == 2 and doc["dcp"]["logical_bytes"] == 64 * 32 * 4 + 10 * 2
    assert {"w@0,0", "b@0"} <= set(doc["files"][0]["tensors"])  # item keys: FQN@offset (dcp.item_key)
    rc, out, _ = run_cli("verify", d, "--deep")
    assert rc == 0 and out.splitlines()[-1] == f"{d}: OK", out
    rc, out, _ = run_cli("verify", d, "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["ok"] and doc["kind"] == "dcp" and doc["metadata"]["ok"]
    assert [f["ok"] for f in doc["files"]] == [True] * len(rank_files)


def test_inspect_shows_plain_values(tmp_path):
    """step, lr, a name: the values beside the tensors, by key path; a list of values (betas, an
    optimizer's parameter ids) as one entry, a long one shortened in the table (whole in --json)."""
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(20)])
    opt = torch.optim.AdamW(model.parameters(), betas=(0.8, 0.9))
    model(torch.randn(1, 2)).sum().backward()
    opt.step()
    p = tmp_path / "a.gdsckpt"
    gdsckpt.save({"model": model, "optim": opt, "step": 1200, "lr": 3e-4, "run": "gpt2-medium", "note": None,
                  "schedule": {"warmup": 100, "decay": [0.5, 0.25]}}, p)
    rc, out, _ = run_cli("inspect", p)
    assert rc == 0, out
    values = out.split("\nvalue\n", 1)[1].splitlines()
    rows = {line.split()[0]: line.split(None, 1)[1] for line in values}
    assert rows["step"] == "1200" and rows["lr"] == "0.0003" and rows["run"] == "'gpt2-medium'", rows
    assert rows["note"] == "None" and rows["schedule/warmup"] == "100" and rows["schedule/decay"] == "[0.5, 0.25]"
    assert rows["optim/param_groups/0/betas"] == "(0.8, 0.9)", rows
    assert rows["optim/param_groups/0/params"] == "[0, 1, 2, ..., 39] (40 values)", rows
    rc, out, _ = run_cli("inspect", p, "--json")
    doc = json.loads(out)["values"]
    assert doc["step"] == 1200 and doc["run"] == "gpt2-medium" and doc["optim/param_groups/0/params"] == list(range(40))
    rc, out, _ = run_cli("inspect", p, "--summary")
    assert "\nvalue\n" not in out  # streams only


def test_verify_finds_a_damaged_rank_file_a_missing_one_and_damaged_metadata(tmp_path):
    d = _dcp_folder(tmp_path / "a")
    rank = next(d.glob("*.gdsckpt"))
    flip_chunk_byte(rank, 5, 0x10)
    rc, out, err = run_cli("verify", d)
    assert rc == 1 and f"{rank}: DAMAGED: ChecksumError" in out and "chunk 0" in out, (out, err)
    assert out.splitlines()[-1] == f"{d}: DAMAGED"
    assert out.count("chunk 0") == 1 and err == ""  # one message per failure: the report's DAMAGED line
    rc, out, err = run_cli("verify", d, "--json")  # stdout is the document: the message on stderr too
    assert rc == 1 and err.count("chunk 0") == 1 and err.startswith("gdsckpt verify: error: "), err

    d = _dcp_folder(tmp_path / "b")
    rank = next(d.glob("*.gdsckpt"))
    rank.unlink()
    rc, out, _ = run_cli("verify", d, "--json")
    doc = json.loads(out)
    assert rc == 1 and not doc["ok"] and doc["files"][0]["error"]["type"] == "FileNotFoundError", doc

    d = _dcp_folder(tmp_path / "c")
    md = d / ".metadata"
    data = bytearray(md.read_bytes())
    data[40] ^= 0x01
    md.write_bytes(bytes(data))
    rc, out, _ = run_cli("verify", d)
    assert rc == 1 and "/.metadata: DAMAGED: CheckpointFormatError" in out and "checksum" in out, out


def test_a_folder_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    for cmd in ("inspect", "verify"):
        rc, out, err = run_cli(cmd, tmp_path)
        assert rc == 1 and "not a DCP step folder" in err and out == "", (cmd, out, err)
    rc, _, err = run_cli("verify", tmp_path / "missing")
    assert rc == 3 and err == (f"gdsckpt verify: error: {tmp_path / 'missing'}: No such file or directory "
                               "(expected a gdsckpt checkpoint file or a DCP step folder)\n"), err


def test_verify_of_a_missing_store_object_is_not_found(tmp_path, s3_env):
    """Exit 3, as for a missing local file: not 1 (damage), and with the object named."""
    from gdsckpt.stores import open_store
    bucket = s3_env.new_bucket()
    url = f"s3://{bucket}/x/step.gdsckpt"
    for cmd in ("verify", "inspect"):
        rc, out, err = run_cli(cmd, url)
        assert rc == 3 and out == "" and "no such object" in err and "'x/step.gdsckpt'" in err, (cmd, rc, out, err)
    rc, out, _ = run_cli("verify", url, "--json")
    assert rc == 3 and json.loads(out)["error"]["type"] == "RemoteNotFoundError", out
    gdsckpt.save({"x": torch.ones(4)}, tmp_path / "a.gdsckpt")
    open_store(f"s3://{bucket}/x").put_file(tmp_path / "a.gdsckpt", "step.gdsckpt")
    assert run_cli("verify", url)[0] == 0


def test_verify_json_of_a_file(tmp_path):
    p = tmp_path / "a.gdsckpt"
    gdsckpt.save({"x": torch.randn(1000), "y": torch.ones(3, dtype=torch.int64)}, p, codec="zstd")
    rc, out, _ = run_cli("verify", p, "--deep", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc == {"path": str(p), "kind": "file", "deep": True, "isolated": False, "ok": True,
                               "metadata": None, "files": [{"path": str(p), "ok": True, "chunks": 2, "tensors": 2,
                                                            "stored_bytes": doc["files"][0]["stored_bytes"],
                                                            "error": None}]}
    flip_chunk_byte(p, 3, 0x01)
    rc, out, err = run_cli("verify", p, "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["files"][0]["error"]["type"] == "ChecksumError" and "tensor 'x'" in err


class _Counter:
    """Stands in for the terminal's progress bar: counts what the command reports."""

    def __init__(self, total):
        self.total, self.n, self.closed = total, 0, False

    def update(self, n=1):
        self.n += n

    def close(self):
        self.closed = True


@pytest.mark.parametrize("deep", [False, True])
def test_verify_progress_counts_every_stored_byte_once_per_pass(tmp_path, deep, monkeypatch):
    """What the progress bar counts: the stored bytes, once for the checksums and once more to decode."""
    from gdsckpt.cli import files
    bars = []
    monkeypatch.setattr(files, "progress", lambda total, desc, unit="B": bars.append(_Counter(total)) or bars[-1])
    p = tmp_path / "a.gdsckpt"
    gdsckpt.save({f"t{i}": torch.randn(5000) for i in range(4)}, p, codec="zstd", chunk_bytes=8192)
    stored = sum(r.stored for r in gdsckpt.open(p).index.records)
    assert run_cli("verify", p, *(["--deep"] if deep else []))[0] == 0
    passes = 2 if deep else 1
    (bar,) = bars
    assert bar.closed and bar.total == p.stat().st_size * passes and bar.n == stored * passes
