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
