"""CPU test of gdsckpt-bench --train and --cost: a tiny training loop with three methods."""

import json

import pytest

from gdsckpt.bench.cli import main


def test_train_and_cost(tmp_path, capsys):
    out = tmp_path / "train.json"
    assert main(["--train", "--size", "tiny", "--device", "cpu", "--steps", "6", "--interval", "2",
                 "--repeats", "2", "--methods", "none,torch,save,async", "--directory", str(tmp_path / "d"),
                 "--output", str(out), "--cost", "--gpus", "8", "--gpu-hour", "3", "--ckpt-every", "60",
                 "--retention", "2", "--tb-month", "20"]) == 0
    printed = capsys.readouterr().out
    assert "overhead/ckpt" in printed and "cost per month" in printed
    r = json.loads(out.read_text())
    assert r["mode"] == "train" and r["device"]["kind"] == "cpu" and r["checkpoints_per_loop"] == 2
    assert r["state"]["logical_bytes"] > 100_000 and r["step_s"] > 0
    rows = {m["name"]: m for m in r["methods"]}
    assert list(rows) == ["none", "torch.save", "gdsckpt.save", "gdsckpt.save_async"]
    for name in ("torch.save", "gdsckpt.save", "gdsckpt.save_async"):
        m = rows[name]
        assert m["status"] == "ok", m
        assert len(m["loops_s"]) == 2 and len(m["drain_s"]) == 2 and len(m["overhead_per_ckpt_s"]["each"]) == 2
        assert len(m["blocked_s"]["each"]) == 4 and len(m["completion_s"]["each"]) == 4
        assert m["first_save"]["completion_s"] > 0 and m["stored_bytes"] > 0
        # the hypervisor's steal during each loop, where /proc/stat has it (the drift between loops follows it)
        assert all(raw["steal_cpu_s"] is None or raw["steal_cpu_s"] >= 0 for raw in m["raw"]), m["raw"]
        # per-step figures: the k-th step after a checkpoint, and its wait for the device, k = 1..interval
        assert len(m["steps_after_ckpt_extra_s"]) == len(m["gpu_wait_after_ckpt_extra_s"]) == 2
        # a checkpoint completes after (or when) the caller is released (each rounded to 0.1 ms)
        assert all(c >= b - 2e-4 for b, c in zip(m["blocked_s"]["each"], m["completion_s"]["each"]))
    assert rows["gdsckpt.save"]["io_path"] == "cpu"
    # the stall-free targets, checked: the background method only, against this run's gdsckpt.save
    (t,) = r["targets"]
    assert t["method"] == "gdsckpt.save_async" and t["rank"] is None
    # no GPU memory target on the CPU
    assert set(t["checks"]) == {"idle_s", "blocked_s", "durable_x_sync", "first_blocked_beyond_steady_s"}
    assert t["checks"]["idle_s"]["target"] == 0.05  # issue 22, target 1 (the DCP rows: 0.10)
    assert "by_medians" in t["checks"]["idle_s"]  # the window by per-step medians, beside the estimate
    # save_async reserved its pool in its setup, before its first save (issue 22, target 3), and says so
    a = rows["gdsckpt.save_async"]
    res = a["reserve"]
    assert res["when"].startswith("setup: before the first save and the loops") and res["where"] == "pool cpu"
    assert res["seconds"] > 0 and 0 < res["held_bytes"] <= res["limit_bytes"] and res["slots"] == 0
    assert rows["gdsckpt.save"]["reserve"] is None and rows["torch.save"]["reserve"] is None
    f = t["checks"]["first_blocked_beyond_steady_s"]
    assert f["target"] == 0.30
    assert abs(f["measured"] - (a["first_save"]["blocked_s"] - a["blocked_s"]["mean"])) < 1e-3
    # where the first save's call went, for that target: its snapshot's stages and the pool's growth (the default
    # save_async overlaps: the loop's state dicts are the stepped optimizer's memory)
    first = a["first_save"]["stats"]
    assert first["mode"] == "overlap" and first["snapshot_s"] > 0 and first["stages"] and first["pool_alloc_s"] >= 0
    assert rows["gdsckpt.save"]["first_save"]["stats"] is None
    assert "reserved before its first save and the loops" in printed
    a = rows["gdsckpt.save_async"]
    c = t["checks"]["durable_x_sync"]
    assert abs(c["measured"] - a["completion_s"]["mean"] / rows["gdsckpt.save"]["blocked_s"]["mean"]) < 1e-3
    b = t["checks"]["blocked_s"]
    assert b["target"] == 0.15 and b["met"] == (b["measured"] <= 0.15) and b["short_by"] == round(max(0, b["measured"] - 0.15), 4)
    assert "targets (met, or short by)" in printed
    # it leads with what a checkpoint cost the loop against torch.save + fsync
    assert printed.startswith("Each checkpoint of the ") and "cost the training loop" in printed.splitlines()[0]
    assert "with torch.save + fsync; gdsckpt.save" in printed.splitlines()[0]
    # each loop's figures, as measured, in a JSON line beside --output (one per method and repeat)
    lines = [json.loads(x) for x in out.with_suffix(".jsonl").read_text().splitlines()]
    assert r["jsonl"] == str(out.with_suffix(".jsonl"))
    assert [x["kind"] for x in lines].count("first_save") == 3 and lines[0]["kind"] == "run"
    loops = [(x["method"], x["repeat"]) for x in lines if x["kind"] == "loop"]
    assert loops == [(m, k) for k in (0, 1) for m in rows], loops
    for x in lines:
        if x["kind"] == "loop" and x["method"] != "none":
            summed = rows[x["method"]]["overhead_per_ckpt_s"]["each"][x["repeat"]]
            assert abs(x["overhead_per_ckpt_s"] - summed) < 1e-4 and len(x["blocked_s"]) == 2 and x["rank"] is None
    cost = {c["name"]: c for c in r["cost"]["methods"]}
    assert r["cost"]["checkpoints_per_month"] == 30 * 24
    c = cost["gdsckpt.save"]
    from gdsckpt.bench.targets import idle_estimate
    idle = max(0.0, idle_estimate(rows["gdsckpt.save"])[0])
    assert abs(c["idle_usd_month"] - 720 * idle / 3600 * 8 * 3) < 1e-9
    assert abs(c["storage_usd_month"] - 2 * rows["gdsckpt.save"]["stored_bytes"] * 8 / 1e12 * 20) < 1e-9


def test_train_loop_reads_its_loss_every_n_steps(tmp_path, capsys, monkeypatch):
    """--sync-every N: loss.item() after every N-th step only (the host ahead of the device between), and
    every run of steps the estimates sum ends with one; an N that does not divide interval // 4 is refused."""
    from gdsckpt.bench import train_loop
    reads = []
    real = train_loop.train_step

    def counted(*a, **kw):
        out = real(*a, **kw)
        reads.append(out[0] is not None)
        return out
    monkeypatch.setattr(train_loop, "train_step", counted)
    out = tmp_path / "train.json"
    assert main(["--train", "--size", "tiny", "--device", "cpu", "--steps", "16", "--interval", "8", "--repeats", "1",
                 "--sync-every", "2", "--methods", "none,async", "--directory", str(tmp_path / "d"),
                 "--output", str(out)]) == 0
    assert "the loss read every 2 steps" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["sync_every"] == 2
    assert reads == [False, True] * 8 * 2  # each method's loop: steps 2, 4, ..., 16 read the loss
    rows = {m["name"]: m for m in r["methods"]}
    assert rows["gdsckpt.save_async"]["status"] == "ok" and rows["gdsckpt.save_async"]["overhead_local_per_ckpt_s"]["n"] == 1
    with pytest.raises(SystemExit) as e:  # a usage error, before anything runs
        main(["--train", "--size", "tiny", "--device", "cpu", "--steps", "16", "--interval", "8",
              "--sync-every", "3", "--methods", "none", "--directory", str(tmp_path / "e")])
    assert e.value.code == 2 and "--sync-every: 3: must divide --interval // 4 (2)" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


def test_cost_from_file_and_unavailable_modes(tmp_path, capsys):
    """--cost reads a --train JSON; a save_async mode the installed library lacks is reported, not fatal."""
    src = {"mode": "train", "date": "2026-11-23", "device": {"name": "H100"}, "interval": 40, "step_s": 0.126,
           "state": {"logical_bytes": 4_000_000_000},
           "methods": [{"name": "none", "status": "ok"},
                       {"name": "a", "status": "ok", "overhead_per_ckpt_s": {"mean": 2.0},
                        "blocked_s": {"mean": 2.0}, "stored_bytes": 3_000_000_000},
                       {"name": "b", "status": "unavailable", "error": "save_async does not accept overlap"}]}
    f = tmp_path / "in.json"
    f.write_text(json.dumps(src))
    assert main(["--cost", "--cost-from", str(f), "--gpus", "1000", "--gpu-hour", "2", "--ckpt-every", "30",
                 "--state-per-gpu", "8000000000", "--output-format", "json"]) == 0
    c = json.loads(capsys.readouterr().out)
    a = c["methods"][0]
    # 1440 checkpoints x 4 s (scaled 2x) x 1000 GPUs / 3600 x $2
    assert abs(a["idle_usd_month"] - 1440 * 4.0 * 1000 / 3600 * 2) < 1e-6
    assert a["checkpoint_bytes"] == 6_000_000_000 * 1000 and c["inputs"]["scaled"]
    assert "error" in c["methods"][1]

    from gdsckpt.bench import train_methods
    names = {m.name: m.available() for m in train_methods.all_methods().values()}
    assert names["none"] is None and names["gdsckpt.save_async"] is None


def test_train_under_torchrun(tmp_path):
    """Two gloo ranks (FSDP2 on the CPU): every rank trains its shard and saves it through DCP;
    rank 0 writes one JSON with each rank's figures; a one-process method is reported, not run."""
    import subprocess
    import sys
    out = tmp_path / "ranks.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "gdsckpt.bench", "--train", "--size", "tiny", "--device", "cpu", "--steps", "4", "--interval", "2",
           "--repeats", "1", "--methods", "none,torch,dcp-thread,dcp-gdsckpt-sync,dcp-gdsckpt,dcp-gdsckpt-overlap",
           "--directory", str(tmp_path / "d"),
           "--output", str(out), "--cost"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("cost per month") == 1  # rank 0 reports, rank 1 does not
    r = json.loads(out.read_text())
    assert r["world_size"] == 2 and r["model"]["sharding"] == "FSDP2 over 2 ranks"
    assert 0 < r["state"]["per_rank_bytes"] < r["state"]["logical_bytes"]
    rows = {m["name"]: m for m in r["methods"]}
    assert rows["torch.save"]["status"] == "unavailable" and "torchrun" in rows["torch.save"]["error"]
    assert [x["rank"] for x in r["ranks"]] == [0, 1]
    # every rank's loops in the JSON lines beside --output, each as it finished
    lines = [json.loads(x) for x in out.with_suffix(".jsonl").read_text().splitlines()]
    got = {(x["method"], x["rank"]) for x in lines if x["kind"] == "loop"}
    assert {(m, k) for m in ("none", "dcp.async_save GdsckptWriter") for k in (0, 1)} <= got, got
    for rank in r["ranks"]:
        per = {m["name"]: m for m in rank["methods"]}
        for name in ("dcp.async_save pinned thread", "dcp.save GdsckptWriter", "dcp.async_save GdsckptWriter",
                     "dcp.async_save GdsckptWriter overlap"):
            assert per[name]["status"] == "ok", per[name]
            assert len(per[name]["blocked_s"]["each"]) == 1 and len(per[name]["completion_s"]["each"]) == 1
            assert per[name]["stored_bytes"] > 0
        # each rank reserved the pool its GdsckptWriter staging takes, as save_async's methods do (gdsckpt.dcp.reserve)
        assert per["dcp.async_save GdsckptWriter overlap"]["reserve"]["where"] == "pool cpu"
    # targets per rank; the DCP rows' background write against this run's synchronous dcp.save
    t = {(e["method"], e["rank"]): e["checks"] for e in r["targets"]}
    assert set(t) == {(m, k) for m in ("dcp.async_save GdsckptWriter", "dcp.async_save GdsckptWriter overlap")
                      for k in (0, 1)}
    assert t[("dcp.async_save GdsckptWriter overlap", 1)]["blocked_s"]["target"] == 0.02
    assert t[("dcp.async_save GdsckptWriter", 0)]["idle_s"]["target"] == 0.10
    assert "durable_x_sync" in t[("dcp.async_save GdsckptWriter", 1)]
    c = {m["name"]: m for m in r["cost"]["methods"]}
    assert r["cost"]["inputs"]["measured_state_bytes"] == r["state"]["per_rank_bytes"]
    # storage per GPU: the directory's bytes shared out over the ranks
    g = rows["dcp.async_save GdsckptWriter"]
    assert abs(c[g["name"]]["checkpoint_bytes"] - g["stored_bytes"] / 2 * r["cost"]["inputs"]["gpus"]) < 1


def test_local_overhead_ignores_drift_between_and_within_loops():
    """The local estimate: a checkpoint's call and the steps it slowed, whatever the loops' drift;
    a write that outlasted the steps it counts: every step up to the next checkpoint; none where
    a write outlasted that too (its tail would be missed)."""
    from gdsckpt.bench.targets import idle_estimate
    from gdsckpt.bench.train_loop import Loop
    from gdsckpt.bench.train_report import _local_per_ckpt, _local_summary, _median_overhead

    interval, steps = 40, 120
    ckpts = [40, 80]

    def loop(base: float, drift: float, cost: dict, call: float = 0.0, done: float = 1.0) -> Loop:
        s = [base + drift * i + cost.get(i, 0.0) for i in range(steps)]
        return Loop(sum(s), calls=[call] * len(ckpts), completion=[done] * len(ckpts), steps=s,
                    ckpt_steps=ckpts if call else [])
    none = loop(0.100, 0.0, {})
    # 5% slower overall and drifting within the loop; each checkpoint: a 20 ms call, +50 ms on
    # the step after it, +1 ms on each of the next 20 (the write)
    slowed = {c + k: (0.050 if k == 0 else 0.001) for c in ckpts for k in range(21)}
    method = loop(0.105, 1e-5, slowed, call=0.020)
    assert [round(x, 9) for x in _local_per_ckpt(method, none, interval)] == [0.090, 0.090]
    summary = _local_summary([method, method], [none], interval)
    assert abs(summary["mean"] - 0.090) < 1e-9 and summary["n"] == 4 and summary["se"] < 1e-9
    # the loop's own estimate reads the drift as overhead
    assert (method.seconds - none.seconds) / len(ckpts) > 0.3
    # a write that outlasted the 30 steps counted: the 40 to the next checkpoint, the 10 before
    # it the base (a cost on the last 10 steps of the interval counts too)
    slow_disk = loop(0.1, 0.0, {**slowed, 115: 0.004}, call=0.02, done=3.5)
    assert [round(x, 9) for x in _local_per_ckpt(slow_disk, none, interval)] == [0.090, 0.094]
    # one that outlasted the interval as well: no local estimate
    assert _local_per_ckpt(loop(0.1, 0.0, slowed, call=0.02, done=4.5), none, interval) is None
    assert _local_summary([loop(0.1, 0.0, slowed, call=0.02, done=4.5)], [none], interval)["mean"] is None
    # by medians: a slow step every 17 (the H100 host's come every ~16, in every loop) moves it
    # less than the means; 4 checkpoints, each meeting the slow steps at other positions
    cks4 = [40, 80, 120, 160]
    cost4 = {c + k: (0.050 if k == 0 else 0.001) for c in cks4 for k in range(21)}
    spikes = [0.04 if i % 17 == 3 else 0.0 for i in range(200)]
    spiky = Loop(0, calls=[0.02] * 4, completion=[1.0] * 4, ckpt_steps=cks4,
                 steps=[0.1 + cost4.get(i, 0.0) + spikes[i] for i in range(200)])
    flat = Loop(0, steps=[0.1 + spikes[(i + 6) % 200] for i in range(200)])  # its own, elsewhere
    assert abs(_median_overhead([spiky], [flat], interval) - 0.090) < 1e-9
    assert abs(_local_summary([spiky], [flat], interval)["mean"] - 0.090) > 0.005
    assert _median_overhead([loop(0.1, 0.0, slowed, call=0.02, done=4.5)], [none], interval) is None
    row = {"overhead_per_ckpt_s": {"mean": 0.4}, "overhead_local_per_ckpt_s": {"mean": 0.09}}
    assert idle_estimate(row) == (0.09, "local")
    assert idle_estimate({"overhead_per_ckpt_s": {"mean": 0.4}, "overhead_local_per_ckpt_s": {"mean": None}}) == (0.4, "loop")


def test_interrupted_run_reports_and_keeps_what_it_measured(tmp_path, capsys, monkeypatch):
    """Ctrl-C in the second repeat: the loops done are in the JSON lines as they finished, and the
    report covers them (a stopped run once printed nothing and kept nothing)."""
    from gdsckpt.bench import train
    real, calls = train.run_loop, []

    def stopped(*a, **kw):
        calls.append(a[1].name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)
    monkeypatch.setattr(train, "run_loop", stopped)
    jl = tmp_path / "loops.jsonl"
    assert main(["--train", "--size", "tiny", "--device", "cpu", "--steps", "4", "--interval", "2", "--repeats", "2",
                 "--methods", "none,torch", "--directory", str(tmp_path / "d"), "--jsonl", str(jl)]) == 0
    out, err = capsys.readouterr()
    assert "interrupted" in err and str(jl) in err
    assert "(Interrupted: from the loops that finished.)" in out.splitlines()[0]
    loops = [(x["method"], x["repeat"]) for x in map(json.loads, jl.read_text().splitlines()) if x["kind"] == "loop"]
    assert loops == [("none", 0), ("torch.save", 0)]


def test_default_methods_and_steps(monkeypatch):
    """No arguments: the methods a user weighs (no checkpoint, torch.save, DCP's async save,
    save_async, DCP through gdsckpt), `all` the whole table; on the CPU as many steps as fit
    about 2 minutes, three intervals a loop; on a GPU, or given either, 120 and 40."""
    import argparse

    from gdsckpt.bench import train
    from gdsckpt.bench.train_methods import METHODS, select
    assert [m.name for m in select(train.DEFAULT_METHODS)] == [
        "none", "torch.save", "dcp.async_save pinned thread", "gdsckpt.save_async", "dcp.async_save GdsckptWriter"]
    assert len(select("all")) == len(METHODS)

    def args(**kw):
        return argparse.Namespace(**{"steps": None, "interval": None, "sync_every": 1, **kw})
    assert train.plan(args(), "cuda", 0.1, 10) == (120, 40)
    assert train.plan(args(steps=60), "cpu", 0.1, 10) == (60, 40)
    assert train.plan(args(interval=10), "cpu", 0.1, 10) == (120, 10)
    for step_s in (0.001, 0.03, 0.1, 0.3, 3.0):
        steps, interval = train.plan(args(), "cpu", step_s, 10)
        assert steps == 3 * interval and 8 <= interval <= 40 and interval % 4 == 0, (step_s, interval)
        if 8 < interval < 40:  # fitted: the loops take about CPU_LOOPS_S at that rate
            assert 0.5 * train.CPU_LOOPS_S < 10 * steps * step_s * 1.3 <= train.CPU_LOOPS_S
    steps, interval = train.plan(args(sync_every=3), "cpu", 0.03, 10)
    assert interval % 12 == 0 and steps == 3 * interval


def test_dcp_save_process_logs_stay_out_of_the_output(tmp_path):
    """DCP's process-based async save logs INFO lines from the process it starts ("root - INFO -
    Checkpoint background process is running..."): not in the bench's output."""
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "gdsckpt.bench", "--train", "--size", "tiny", "--device", "cpu", "--steps", "4",
           "--interval", "2", "--repeats", "1", "--methods", "none,dcp-process", "--directory", str(tmp_path / "d"),
           "--output", str(tmp_path / "r.json")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {m["name"]: m for m in json.loads((tmp_path / "r.json").read_text())["methods"]}
    assert rows["dcp.async_save pinned process"]["status"] == "ok"
    assert " - INFO - " not in p.stderr + p.stdout, p.stderr


def test_headline_says_level_where_the_difference_is_within_the_noise():
    from gdsckpt.bench.train_report import headline

    def row(name, idle, se):
        return {"name": name, "status": "ok", "overhead_per_ckpt_s": {"mean": idle},
                "overhead_local_per_ckpt_s": {"mean": idle, "se": se, "n": 4}}
    result = {"state": {"logical_bytes": 22_800_000},
              "methods": [row("torch.save", 0.134, 0.070), row("gdsckpt.save_async", 0.227, 0.029),
                          row("dcp.async_save GdsckptWriter", 0.010, 0.002)]}
    text = headline(result)
    assert text.startswith("Each checkpoint of the 22.8 MB state cost the training loop 0.134 s with torch.save + fsync")
    # 0.093 s apart, twice the standard error of the difference 0.15 s: no ratio is claimed
    assert "gdsckpt.save_async 0.227 s (level with it: within the loops' noise)" in text
    # where the standard errors are small, the ratio stands
    result["methods"][0]["overhead_local_per_ckpt_s"]["se"] = 0.005
    result["methods"][1]["overhead_local_per_ckpt_s"]["se"] = 0.005
    text = headline(result)
    assert "gdsckpt.save_async 0.227 s (1.7x more)" in text
    assert "dcp.async_save GdsckptWriter 0.010 s (13.4x less)" in text
    # torch.save's idle not resolved (a short loop on a busy host: CI once measured it below zero):
    # the headline says so, with no ratio to it
    result["methods"][0]["overhead_local_per_ckpt_s"]["mean"] = -0.004
    text = headline(result)
    assert text.startswith("Each checkpoint of the 22.8 MB state cost the training loop nothing measurable "
                           "(-0.004 s: the loops' noise is larger) with torch.save + fsync; gdsckpt.save_async +0.227 s")
