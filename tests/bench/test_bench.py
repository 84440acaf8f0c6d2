"""CPU smoke test of gdsckpt-bench's JSON output (the schema is documented in gdsckpt/bench/cli.py)."""

import json

from gdsckpt.bench.cli import main
from gdsckpt.bench.options import TERSE_FIELDS


def test_bench_json_schema(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["--size", "tiny", "--device", "cpu", "--output-format", "json", "--output", str(out),
                 "--directory", str(tmp_path / "d"), "--bs", "1M,4M", "--no-disk-probe"]) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads(out.read_text())
    assert printed["jobs"] == saved["jobs"]
    assert saved["schema"] == 1 and saved["device"]["kind"] == "cpu"
    assert saved["data"]["kind"] == "realistic" and saved["data"]["logical_bytes"] > 1_000_000
    assert {"bfloat16", "float32"} <= set(saved["data"]["by_dtype"])
    kinds = [(j["rw"], j["bs"]) for j in saved["jobs"]]
    assert kinds == [("write", 1 << 20), ("read", 1 << 20), ("write", 4 << 20), ("read", 4 << 20)]
    for j in saved["jobs"]:
        assert j["io_path"] == "cpu" and 0 < j["ratio"] < 1 and j["logical_gbps"] > 0
        assert set(j["lat_ms"]) == {"p50", "p90", "p99", "p99.9"}
        assert j["iops"] > 0 and j["stages"]
    assert all(j["verified"] for j in saved["jobs"] if j["rw"] == "read")


def test_bench_null_target_and_terse(tmp_path, capsys):
    assert main(["--size", "tiny", "--device", "cpu", "--target", "null", "--output-format", "terse"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[0].split(";")
    assert line[0] == "gdsckpt" and line[3] == "write" and line[4] == "null"
    assert len(line) == len(TERSE_FIELDS)  # every field --help lists, in its place
    fields = dict(zip(TERSE_FIELDS, line))
    assert float(fields["cpu_user_s_per_gb"]) > 0 and float(fields["logical_gbps"]) > 0


def test_bench_zeros_are_labelled(tmp_path, capsys):
    assert main(["--data", "zeros", "--size", "4M", "--device", "cpu", "--output-format", "json",
                 "--directory", str(tmp_path), "--no-disk-probe"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["data"]["kind"] == "zeros" and "ZEROS" in d["data"]["description"]


def test_workload_sizes_below_and_above_the_base_state():
    """Scale runs need states of the asked size on both sides of the trained base state: a
    shallower or deeper GPT, its AdamW state matching parameter for parameter, holding the bytes
    asked (short by less than one row of a tensor: 4 x 192 elements of 14 bytes here). `8MB` once
    measured 14.2 MB (whole blocks, rounded up), `1KB` 7.95 MB."""
    import pytest

    from gdsckpt.bench.states import nbytes
    from gdsckpt.bench.workload import make_state, min_bytes
    from gdsckpt.core.units import parse_size
    base = make_state("tiny", device="cpu")
    for size in ("8MB", "8MiB", "26MB", "40MB", str(min_bytes("cpu")), str(min_bytes("cpu") + 20)):
        state = make_state(size, device="cpu")
        want = parse_size(size)
        assert want - 14 * 4 * 192 - 4 < nbytes(state) <= want, (size, nbytes(state))
        assert len(state["optimizer"]["state"]) == len(state["master"]) == len(state["model"])
        assert state["optimizer"]["param_groups"][0]["params"] == list(range(len(state["master"])))
        for name, master in state["master"].items():  # a cut parameter is cut alike in all its tensors
            assert state["model"][name].shape == master.shape
            pid = list(state["master"]).index(name)
            assert state["optimizer"]["state"][pid]["exp_avg"].shape == master.shape
    assert len(make_state("8MiB", device="cpu")["master"]) < len(base["master"]) < len(make_state("40MB", device="cpu")["master"])
    # the smallest: the embeddings and the head, as min_bytes computes them from the shapes alone
    assert nbytes(make_state(str(min_bytes("cpu")), device="cpu")) == min_bytes("cpu")
    with pytest.raises(ValueError, match=r"'1KB': the realistic state on cpu is at least 1.73 MB"):
        make_state("1KB", device="cpu")


def test_synthetic_states_hold_the_size_asked():
    """--data random/zeros: at least the bytes asked, over by less than one row (1-D tensors
    included: `--size 1KB` once gave 10.7 kB)."""
    from gdsckpt.bench.states import nbytes
    from gdsckpt.bench.workload import random_state, zeros_state
    for n in (1, 1000, 10**6, 3 * 10**6 + 7):
        for make in (random_state, zeros_state):
            assert n <= nbytes(make(n, "cpu")) < n + 14 * 768 + 4, (n, make)


def test_state_walks_count_what_a_save_stores_or_every_place():
    """nbytes and to_device go through gdsckpt.format.tree.flatten (a tied tensor is one leaf);
    every_tensor / placed_bytes see every place a tensor sits, as the baselines write it."""
    import torch

    from gdsckpt.bench import states
    w = torch.arange(6, dtype=torch.float32)
    state = {"wte": w, "lm_head": w, "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}
    assert states.nbytes(state) == 24 and states.placed_bytes(state) == 48
    pairs, others = states.every_tensor(state)
    assert [k for k, _ in pairs] == ["wte", "lm_head"] and others == 3
    moved = states.to_device(state, "cpu")
    assert moved["wte"] is moved["lm_head"] and moved["groups"][0]["betas"] == (0.9, 0.99)
    assert states.local_tensors(state)["lm_head"] is w and states.local_bytes(state) == 48
