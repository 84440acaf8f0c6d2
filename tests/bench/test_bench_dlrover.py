"""gdsckpt-bench --train's DLRover flash checkpoint baseline (--methods dlrover-flash): measured in
the same run as gdsckpt's memory tier where DLRover is installed; where it cannot run, its row
says why in one line, and the run goes on."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from gdsckpt.bench.cli import main


@pytest.mark.skipif(importlib.util.find_spec("dlrover") is None, reason="needs gdsckpt[bench-dlrover]")
def test_dlrover_flash_beside_the_memory_tier(tmp_path, shm):
    """One process: DLRover's engine starts its own saver process (no dlrover-run); every checkpoint
    goes to its shared memory, every 2nd also to the directory, whose write completes the checkpoint."""
    before = set(os.listdir("/dev/shm"))
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "gdsckpt.bench", "--train", "--memory", "--methods", "none,dlrover-flash",
           "--size", "tiny", "--device", "cpu", "--steps", "6", "--interval", "2", "--every-local", "2",
           "--repeats", "1", "--directory", str(tmp_path / "d"), "--output", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    rows = {m["name"]: m for m in r["methods"]}
    assert list(rows) == ["none", "dlrover flash checkpoint", "gdsckpt Checkpointer memory"]
    d = rows["dlrover flash checkpoint"]
    assert d["status"] == "ok", d
    assert len(d["blocked_s"]["each"]) == 2 and d["overhead_per_ckpt_s"]["mean"] is not None
    assert d["first_save"]["completion_s"] >= d["first_save"]["blocked_s"] > 0  # step 1: to the directory too
    assert d["stored_bytes"] > 0 and "DLRover 0.6.1" in d["notes"]
    assert rows["gdsckpt Checkpointer memory"]["status"] == "ok"
    assert "[INFO]" not in p.stderr  # DLRover's loggers quiet, the root logger as it was
    assert not list(tmp_path.glob("gdsckpt-bench-dlrover-*"))  # its directory removed
    assert not [n for n in set(os.listdir("/dev/shm")) - before if "ckpt_shm" in n]  # and its shared memory


def test_dlrover_flash_that_cannot_run_says_why(tmp_path, monkeypatch):
    """DLRover missing (its import fails): the row is unavailable, with the exception's type and
    reason in one line, and the other methods' figures are there."""
    monkeypatch.setitem(sys.modules, "dlrover", None)  # import dlrover... raises ImportError
    out = tmp_path / "r.json"
    assert main(["--train", "--methods", "none,dlrover-flash", "--size", "tiny", "--device", "cpu", "--steps", "4",
                 "--interval", "2", "--repeats", "1", "--directory", str(tmp_path / "d"), "--output", str(out)]) == 0
    rows = {m["name"]: m for m in json.loads(out.read_text())["methods"]}
    d = rows["dlrover flash checkpoint"]
    assert d["status"] == "unavailable" and rows["none"]["status"] == "ok"
    assert d["error"].startswith("DLRover's flash checkpoint cannot be imported (ModuleNotFoundError: ")
    assert "\n" not in d["error"] and "gdsckpt[bench-dlrover]" in d["error"]
