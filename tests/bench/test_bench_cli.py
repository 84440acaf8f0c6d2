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
