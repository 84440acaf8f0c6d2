"""CPU test of gdsckpt-bench --train --memory: the memory tier beside save_async in a tiny training
loop, and the restores of the trained state in new processes (memory, cold local file), each
checked bit for bit."""

import json
import os


from gdsckpt.bench.cli import main



def test_train_memory(tmp_path, shm, capsys):
    out = tmp_path / "train.json"
    assert main(["--train", "--memory", "--size", "tiny", "--device", "cpu", "--steps", "10", "--interval", "2",
                 "--every-local", "2", "--repeats", "1", "--directory", str(tmp_path / "d"),
                 "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    rows = {m["name"]: m for m in r["methods"]}
    assert list(rows) == ["none", "gdsckpt.save_async", "gdsckpt Checkpointer memory"]
    m = rows["gdsckpt Checkpointer memory"]
    assert m["status"] == "ok", m
    assert len(m["blocked_s"]["each"]) == 4 and m["overhead_per_ckpt_s"]["mean"] is not None
    loop = r["memory"]["loop"]
    assert loop["every_local"] == 2 and loop["checkpoints"] == 4 and loop["local_writes"] == 2
    assert [c["step"] for c in loop["per_checkpoint"]] == [2, 3, 4, 5]  # after the first save's
    # the tier's slots reserved in its setup, before the first save; its first save checked against its loops'
    res = m["reserve"]
    assert res["slots"] == 2 and res["where"].startswith("memory ") and res["allocated_bytes"] > 0
    t = {e["method"]: e["checks"] for e in r["targets"]}
    assert set(t["gdsckpt Checkpointer memory"]) == {"first_blocked_beyond_steady_s"}
    assert "first_blocked_beyond_steady_s" in t["gdsckpt.save_async"]
    assert all(c["memory_s"] > 0 for c in loop["per_checkpoint"])
    assert all((c["durable_s"] is not None) or c["coalesced"] for c in loop["per_checkpoint"] if c["local"])
    rest = r["memory"]["restore"]
    assert rest["memory"]["source"] == "memory" and rest["memory"]["bit_exact"] is True
    assert rest["local_cold"]["source"] == "local" and rest["local_cold"]["bit_exact"] is True
    t = rest["targets"]["restore_from_memory_s"]
    assert abs(t["target"] - 0.5 * rest["local_cold"]["seconds"]) < 1e-9 and t["met"] == (t["measured"] <= t["target"])
    assert set(r["memory"]["targets"]) == {"idle_s_vs_save_async"}
    assert loop["fallbacks"] == [] and 0 < loop["held_bytes"] <= loop["cap_bytes"]
    assert "restore in a new process from memory" in printed
    assert os.listdir(shm) == []  # every copy the bench made is gone


def test_train_memory_replicas_under_torchrun(tmp_path, shm):
    """Two gloo ranks, each its own node (a memory root of its own under the tier's root): the
    memory tier alone and with replicas=1 in one run; each rank's row names its replication, every
    checkpoint replicated on the other rank, with its seconds, from status()."""
    import subprocess
    import sys
    out = tmp_path / "replicas.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "gdsckpt.bench", "--train", "--memory", "--replicas", "1", "--methods", "none", "--size", "tiny",
           "--device", "cpu", "--steps", "4", "--interval", "2", "--every-local", "100", "--repeats", "1",
           "--directory", str(tmp_path / "d"), "--output", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    name = "gdsckpt Checkpointer memory replicas=1"
    assert [m["name"] for m in r["methods"]] == ["none", "gdsckpt Checkpointer memory", name]
    for rank in r["ranks"]:
        per = {m["name"]: m for m in rank["methods"]}
        assert per["gdsckpt Checkpointer memory"]["status"] == "ok", per["gdsckpt Checkpointer memory"]
        row = per[name]
        assert row["status"] == "ok", row
        assert len(row["blocked_s"]["each"]) == 1 and row["overhead_per_ckpt_s"]["mean"] is not None
        rep = row["memory"]["replicas"]
        assert rep["replicas"] == 1 and rep["node"] == rank["rank"]  # each rank its own node
        assert rep["replicated"] == rep["checkpoints"] == 1 and rep["not_replicated"] == {}
        other = 1 - rank["rank"]
        for c in row["memory"]["per_checkpoint"]:
            assert c["replicated_on"] == [other] and c["replication"] == {str(other): "committed"}
            assert c["replication_s"] > 0 and c["replication_bytes"] > 0
        assert "replicas" not in per["gdsckpt Checkpointer memory"]["memory"]
    assert [x["node"] for x in r["memory"]["replicas"][name]] == [0, 1]
    t = r["memory"]["targets"]["replication_idle_extra_s (replicas=1)"]
    assert t["target"] == 0.02 and t["measured"] is not None
    assert "1/1 checkpoints replicated" in p.stdout
    assert os.listdir(shm) == []  # each rank's memory root, and every copy in it, is gone
