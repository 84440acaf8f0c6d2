"""Retention (the Checkpointer's and `gdsckpt prune`'s) never deletes the newest intact step: a
damaged step (a flipped chunk byte, a file truncated to 0) does not count toward `keep`, and is
reported as local damage."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from gdsckpt.manager.checkpointer import Checkpointer, step_name
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
    caplog.set_level(logging.WARNING, logger="gdsckpt.manager.checkpointer")
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



def test_retention_runs_off_the_saving_threads(tmp_path, monkeypatch):
    """Retention runs on a thread of its own (an unlink on a `discard`-mounted disk takes ~1 s for
    4 GB, which must not delay the next write or upload): save_async does not wait for a deletion
    in progress, and wait() returns once the retention the last save started is done."""
    from gdsckpt.manager.steps import FileSteps
    held, entered = threading.Event(), threading.Event()
    deleted_on = []
    real_delete = FileSteps.delete

    def held_delete(self, step):
        deleted_on.append(threading.current_thread().name)
        entered.set()
        assert held.wait(30)
        real_delete(self, step)
    monkeypatch.setattr(FileSteps, "delete", held_delete)
    ck = Checkpointer(tmp_path, keep=1, save_options=OPTS)
    ck.save(1, state_for(1))
    ck.save_async(2, state_for(2)).result()
    assert entered.wait(30)  # its retention is held in step 1's deletion, on the retention thread
    ck.save_async(3, state_for(3)).result()  # the saves go on meanwhile
    fut = ck.save_async(4, state_for(4))
    held.set()
    ck.wait()
    assert fut.done()
    assert [p.name for p in tmp_path.iterdir() if p.name != ".gdsckpt-manager.lock"] == [step_name(4, False)]
    assert set(deleted_on) and all(name.startswith("gdsckpt-retention") for name in deleted_on), deleted_on
    ck.close()
