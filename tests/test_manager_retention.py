"""Retention (the Checkpointer's and `gdsckpt prune`'s) never deletes the newest intact step: a
damaged step (a flipped chunk byte, a file truncated to 0) does not count toward `keep`, and is
reported as local damage."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import pytest
import torch

from gdsckpt.manager import Checkpointer, step_name
from conftest import assert_same
from test_cli import run_cli
from test_manager import OPTS, corrupt_chunk, state_for


def _damage(path, how):
    if how == "chunk":
        corrupt_chunk(path)
    elif how == "empty":
        os.truncate(path, 0)
    else:
        os.truncate(path, path.stat().st_size // 2)


def _names(d):
    return sorted(p.name for p in d.iterdir() if not p.name.startswith("."))


@pytest.mark.parametrize("how", ["chunk", "empty", "truncated"])
def test_prune_keeps_the_newest_intact_step(tmp_path, how):
    with Checkpointer(tmp_path, keep=3, save_options=OPTS) as ck:
        for s in (1, 2, 3):
            ck.save(s, state_for(s))
    _damage(tmp_path / step_name(3, False), how)
    rc, out, err = run_cli("prune", tmp_path, "--keep", "1", "--yes")
    assert rc == 0, err
    assert f"local step 3 is damaged (kept; it does not count toward --keep): DAMAGED: " in out, out
    assert "removed: local steps [1]; remote steps none" in out, out
    assert _names(tmp_path) == [step_name(2, False), step_name(3, False)]
    with Checkpointer(tmp_path) as ck, pytest.warns(UserWarning, match="restored step 2"):
        assert_same(ck.restore().state, state_for(2))


@pytest.mark.parametrize("how", ["chunk", "empty"])
def test_retention_after_a_save_keeps_the_newest_intact_step(tmp_path, how, caplog):
    """keep=1: a newest step damaged as written never costs the older intact one."""
    caplog.set_level(logging.WARNING, logger="gdsckpt.manager")
    with Checkpointer(tmp_path, keep=3, save_options=OPTS) as ck:
        for s in (1, 2):
            ck.save(s, state_for(s))
    _damage(tmp_path / step_name(2, False), how)
    with Checkpointer(tmp_path, keep=1, save_options=OPTS) as ck:
        assert ck.prune(dry_run=True) == {"local": [], "remote": [],
                                          "damaged": {2: ck.status()["local_damage"][2]}}
        assert ck.status()["local_damage"][2].startswith("DAMAGED: ChecksumError" if how == "chunk" else "DAMAGED: ")
        assert "local step 2 is damaged; it does not count toward keep=1" in caplog.text
        ck.save(3, state_for(3))  # intact: now steps 1 and 2 may go
        assert ck.steps() == [3]
        assert ck.status()["local_damage"] == {}


def test_keep_one_verifies_the_newest_before_the_last_older_step_goes(tmp_path):
    with Checkpointer(tmp_path, keep=1, save_options=OPTS) as ck:
        ck.save(1, state_for(1))
        ck.save(2, state_for(2))
        assert ck.steps() == [2]  # verified chunk by chunk, then step 1 went
    with Checkpointer(tmp_path, keep=2, save_options=OPTS) as ck:
        ck.save(3, state_for(3))
    corrupt_chunk(tmp_path / step_name(3, False))  # footer and index intact: only a full read finds it
    with Checkpointer(tmp_path, keep=1, save_options=OPTS) as ck:
        assert ck.prune() == {"local": [], "remote": [], "damaged": {3: ck.status()["local_damage"][3]}}
        assert "ChecksumError" in ck.status()["local_damage"][3]
        assert ck.steps() == [2, 3]


def test_a_retired_step_is_removed_off_the_saving_thread(tmp_path, monkeypatch):
    """The step retention lets go stops counting at once; its bytes go on a thread of its own (an
    unlink on a `discard`-mounted disk takes ~1 s for 4 GB, which must not delay the next write):
    the next saves do not wait for it, wait() returns once they are gone."""
    from gdsckpt import removal
    held = threading.Event()
    removed_on = []

    def held_remove(path):
        removed_on.append(threading.current_thread().name)
        assert held.wait(30)
        real_remove(path)
    real_remove = removal.remove
    monkeypatch.setattr(removal, "remove", held_remove)
    ck = Checkpointer(tmp_path, keep=1, save_options=OPTS)
    ck.save(1, state_for(1))
    ck.save(2, state_for(2))  # returns while step 1's removal is held
    assert ck.steps() == [2]
    ck.save_async(3, state_for(3)).result()  # neither waits for it
    ck.save(4, state_for(4))
    assert ck.steps() == [4]
    for s in (1, 2, 3):
        retired = [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{step_name(s, False)}.gdsckpt-tmp.")]
        assert len(retired) == 1, sorted(p.name for p in tmp_path.iterdir())
    held.set()
    ck.wait()
    assert [p.name for p in tmp_path.iterdir() if p.name != ".gdsckpt-manager.lock"] == [step_name(4, False)]
    assert removed_on and removed_on[0].startswith("gdsckpt-remove")
    ck.close()


def test_a_removal_killed_part_way_is_finished_by_the_next_manager(tmp_path):
    """The process dies as the retired step's removal begins: the step no longer counts, and the
    next manager removes what is left."""
    code = ("import os, sys, torch, gdsckpt, gdsckpt.removal as r\n"
            "r.remove = lambda path: os._exit(0)\n"
            "ck = gdsckpt.Checkpointer(sys.argv[1], keep=1, save_options={'chunk_bytes': 65536})\n"
            "ck.save(1, {'w': torch.ones(1000)})\n"
            "ck.save(2, {'w': torch.full((1000,), 2.0)})\n"
            "ck.wait()\n"
            "sys.exit(3)\n")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(f".{step_name(1, False)}.gdsckpt-tmp."))
    assert len(left) == 1, sorted(p.name for p in tmp_path.iterdir())
    with Checkpointer(tmp_path) as ck:
        assert ck.steps() == [2]
        assert not (tmp_path / left[0]).exists()
        assert torch.equal(ck.restore().state["w"], torch.full((1000,), 2.0))


def test_a_retired_dcp_step_is_a_leftover_until_removed(tmp_path):
    """Under torch.distributed a step is a directory: retired by one rename, listed as a leftover
    (for a manager killed before its removal), never as a step."""
    from gdsckpt.steps import DCP_METADATA, DcpSteps
    layout = DcpSteps(tmp_path, {}, rank=0)
    step = tmp_path / step_name(3, True)
    step.mkdir()
    (step / DCP_METADATA).write_bytes(b"m")
    (step / "__0_0.gdsckpt").write_bytes(b"x" * 100)
    assert layout.local_steps() == [3]
    retired = layout.retire(3)
    assert retired.parent == tmp_path and retired.name.startswith(f".{step_name(3, True)}.retired.")
    assert layout.local_steps() == [] and layout.leftovers() == [retired]
    assert (retired / "__0_0.gdsckpt").read_bytes() == b"x" * 100
    assert layout.retire(3) is None
