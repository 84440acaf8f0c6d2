"""gdsckpt-bench's command line: every argument checked before anything runs, fio's --runtime and
--time_based, the text report's figures (GiB/s, mean ± std, CPU seconds per GB), terse fields in
--help, a plot title that fits. CPU, tiny states."""

from __future__ import annotations

import json

import pytest

from gdsckpt.bench.cli import main, plot_title
from gdsckpt.bench.options import TERSE_FIELDS

BAD = [
    (["--iodepth", "1,2"], "--iodepth"),  # a depth the save refuses: once ran the depth-2 job, then a traceback
    (["--iodepth", "2,x"], "--iodepth"),
    (["--size", "5XB"], "--size"),
    (["--size", "0"], "--size"),
    (["--bs", "1000"], "--bs"),  # not a multiple of 4096
    (["--bs", "64MiB,"], "--bs"),
    (["--bs", "4GiB"], "--bs"),  # above the format's 2 GiB chunk bound
    (["--loops", "0"], "--loops"),
    (["--runtime", "-1"], "--runtime"),
    (["--numjobs", "0"], "--numjobs"),
    (["--codec", "lz4"], "--codec"),
    (["--data", "bogus"], "--data"),
    (["--data", "file:/no/such/file"], "--data"),
    (["--device", "tpu"], "--device"),
    (["--time_based"], "--runtime"),
    (["--plot", "x.png"], "--plot"),
    (["--cost", "--cost-from", "r.json", "--state-per-gpu", "40XB"], "--state-per-gpu"),
    # below the realistic state's least (its embeddings and head): refused with it, not measured at 7.95 MB
    (["--size", "1KB"], "--size: '1KB' is below the smallest realistic state on cpu, 1.73 MB (1725716 bytes"),
    (["--size", "small-cpu"], "is one of --train's models"),  # once a traceback after the set-up
    (["--train", "--size", "8MB"], "--train takes a model by name"),  # once ignored: small-cpu trained
    (["--train", "--steps", "20", "--interval", "20"], "--steps: 20 steps at --interval 20"),
]


@pytest.mark.parametrize("argv,names", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments_are_usage_errors_before_anything_runs(argv, names, tmp_path, capsys):
    d = tmp_path / "never"
    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", "--directory", str(d), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert names in err and "Traceback" not in err, err
    assert not d.exists()  # nothing ran: not even the directory for the checkpoint


def test_help_lists_the_terse_fields(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert ";".join(TERSE_FIELDS) in capsys.readouterr().out


def test_train_help_shows_the_training_options(capsys):
    """--train --help: the loop's options and the shared ones, not the save/restore jobs' (it once
    printed the same 133 lines as --help)."""
    with pytest.raises(SystemExit) as e:
        main(["--train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: gdsckpt-bench --train")
    for name in ("--methods", "--steps", "--interval", "--repeats", "--jsonl", "--sync-every", "--size", "--output"):
        assert name in out, name
    assert "--iodepth" not in out and "--time_based" not in out and ";".join(TERSE_FIELDS) not in out
    assert len(out.splitlines()) < 80


def test_report_leads_with_torch_save_and_no_progress_is_left_on_its_line(tmp_path, capsys, monkeypatch):
    """The text report's first line compares with torch.save + fsync and torch.load (also in the
    JSON); on a terminal the progress line is cleared before the report (it was once left there,
    the report glued on)."""
    import io
    import re
    import sys

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    assert main(["--size", "1MiB", "--data", "random", "--device", "cpu", "--directory", str(tmp_path),
                 "--output", str(tmp_path / "r.json")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert re.fullmatch(r"gdsckpt saved the 1.0[56] MB state [0-9.]+x (faster|slower) than torch.save \+ fsync "
                        r"\([0-9.]+ s against [0-9.]+ s\) and restored it [0-9.]+x (faster|slower) than torch.load "
                        r"\([0-9.]+ s against [0-9.]+ s, cold reads\)\.", first), first
    v = json.loads((tmp_path / "r.json").read_text())["versus_torch"]
    assert v["save_x"] == pytest.approx(v["torch_save_s"] / v["save_s"]) and v["sentence"] == first
    assert "probing the disk" in err.getvalue() and err.getvalue().endswith("\r\x1b[K")  # cleared


def _jobs(capsys) -> list[dict]:
    return json.loads(capsys.readouterr().out)["jobs"]


def test_runtime_caps_the_loops_and_time_based_repeats_them(capsys):
    base = ["--size", "1MiB", "--data", "random", "--device", "cpu", "--target", "null", "--output-format", "json"]
    assert main([*base, "--loops", "50", "--runtime", "0.000001"]) == 0  # fio: runtime caps a job...
    assert _jobs(capsys)[0]["loops"] == 1  # ...but one loop always runs, whole
    assert main([*base, "--loops", "1", "--runtime", "0.3", "--time_based"]) == 0  # repeats until 0.3 s passed
    job = _jobs(capsys)[0]
    assert job["loops"] > 1 and len(job["per_loop_gbps"]) == job["loops"]
    assert main([*base, "--loops", "3"]) == 0
    assert _jobs(capsys)[0]["loops"] == 3


def test_text_report_shows_gib_per_s_spread_and_cpu_seconds(tmp_path, capsys):
    assert main(["--size", "1MiB", "--data", "random", "--device", "cpu", "--loops", "3", "--directory",
                 str(tmp_path), "--no-disk-probe", "--output", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert out.count("GiB/s") >= 2 and "mean ± std of 3 loops" in out, out
    assert "cpu: user" in out and "s/GB, system" in out, out
    for job in json.loads((tmp_path / "r.json").read_text())["jobs"]:
        assert job["cpu"]["user_s"] > 0 and job["cpu"]["user_s_per_gb"] > 0 and job["cpu"]["sys_s_per_gb"] >= 0
        assert job["logical_gibps"] == pytest.approx(job["logical_gbps"] * 1e9 / 2**30)
        assert job["logical_gbps_std"] >= 0 and min(job["per_loop_gbps"]) <= job["logical_gbps_mean"]


def test_plot_title_fits_the_figure(tmp_path, capsys):
    result = {"date": "2026-11-24T00:00:00+00:00", "device": {"name": "NVIDIA H100 80GB HBM3"},
              "data": {"description": "GPT-2-shaped model after AdamW training under bf16 autocast, size 4GiB " * 2,
                       "logical_bytes": 4_370_000_000}}
    title = plot_title(result, width_in=7, fontsize=8)
    assert len(title.splitlines()) > 1 and all(len(l) * 8 * 0.6 <= 7 * 72 for l in title.splitlines()), title
    png = tmp_path / "sweep.png"
    assert main(["--size", "1MiB", "--data", "random", "--device", "cpu", "--target", "null", "--bs", "64KiB,256KiB",
                 "--plot", str(png), "--output-format", "terse"]) == 0
    assert png.stat().st_size > 10_000


def test_the_train_models_are_sizes_by_name():
    """--train --size gpt2-medium / gpt2-large (the training loop's models) parse as sizes, as a
    byte count does; a 2-GPU round failed on it once the sizes were checked up front."""
    from gdsckpt.bench.options import size
    from gdsckpt.bench.train_loop import TRAIN_SIZES
    for name in [*TRAIN_SIZES, "auto", "4GiB"]:
        assert size(name) == name
