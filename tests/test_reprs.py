"""What a first look shows: print() of a save's Stats, a save_async's AsyncStats and a restore's
Restored is one short line of the key figures (every detail stays an attribute, and in
to_dict()); Checkpointer.restore logs the step it took and where from."""

from __future__ import annotations

import logging
import re

import torch

import gdsckpt
from test_manager import OPTS, state_for


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(12)])  # 24 tensors: 12 streams' worth of stages
    return {"model": model.state_dict(), "extra": {f"t{i}": torch.randn(100).half() for i in range(8)}, "step": 3}


def test_stats_is_one_short_line_and_keeps_every_detail(tmp_path):
    stats = gdsckpt.save(_state(), tmp_path / "a.gdsckpt", codec="zstd")
    text = repr(stats)
    assert "\n" not in text and len(text) - len(str(tmp_path)) <= 120 and str(stats) == text, text
    m = re.fullmatch(r"Stats\(save '(.+)': (.+) -> (.+) stored \(ratio (\d\.\d\d)\), (\d+\.\d{3}) s, ([\d.e-]+) GB/s, "
                     r"cpu backend, io cpu\)", text)
    assert m and m.group(1) == str(tmp_path / "a.gdsckpt") and float(m.group(4)) == round(stats.ratio, 2), text
    assert m.group(2) == gdsckpt.core.units.format_bytes(stats.logical_bytes) and float(m.group(5)) == round(stats.seconds, 3)
    d = stats.to_dict()
    assert d["stages"] and d["streams"] and d["chunks"] == stats.chunks and "latencies" not in d
    assert "stages" not in text and "streams" not in text  # the details: attributes and to_dict()
    with gdsckpt.open(tmp_path / "a.gdsckpt") as ck:
        ck.read(ck.keys())
        assert repr(ck.last_stats).startswith(f"Stats(load '{tmp_path / 'a.gdsckpt'}': ")


def test_async_stats_is_one_line_with_the_callers_stall(tmp_path):
    stats = gdsckpt.save_async(_state(), tmp_path / "a.gdsckpt", codec="zstd").result()
    text = repr(stats)
    assert "\n" not in text and len(text) - len(str(tmp_path)) <= 160 and text.startswith(f"AsyncStats(save '{tmp_path / 'a.gdsckpt'}': "), text
    assert text.endswith(f"; {stats.mode} mode, blocked {stats.blocked_s:.3f} s)"), text
    assert set(stats.to_dict()) >= {"blocked_s", "pool_bytes", "write_s", "fsync_s", "stages", "ratio", "gbps"}


def test_restored_shows_step_source_and_keys_not_the_state_and_restore_logs_them(tmp_path, caplog):
    with gdsckpt.Checkpointer(tmp_path, save_options=OPTS) as ck:
        ck.save(7, state_for(7, n=200_000))
        with caplog.at_level(logging.INFO, logger="gdsckpt"):
            r = ck.restore()
    text = repr(r)
    path = str(tmp_path / gdsckpt.manager.checkpointer.step_name(7, False))
    assert text == f"Restored(step=7, source='local', keys={len(r.state)}, path={path!r})", text
    assert "tensor(" not in text and r.state and r.stats is not None  # the state itself: an attribute
    logged = [rec for rec in caplog.records if rec.name.startswith("gdsckpt")]
    assert [(rec.levelno, rec.getMessage()) for rec in logged] == [(logging.INFO, f"restored step 7 from local ({path})")]
