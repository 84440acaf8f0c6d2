"""Checkpointer.rollback(step): every newer step is removed here and on the store (a real S3
server, tests/s3_server.py), so that nothing brings it back, and save(step + k) then works;
recorded first, so that a rollback killed part-way, or whose store was down, is finished."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gdsckpt.errors import NoCheckpointError
from gdsckpt.manager.checkpointer import Checkpointer, step_name
from gdsckpt.stores import Store, open_store
from gdsckpt.manager.rollback import JOURNAL_NAME
from conftest import assert_same
from s3_server import SeaweedS3
from test_manager import OPTS, state_for

TESTS = Path(__file__).parents[1]
ROOT = TESTS.parent
FAST = {"max_retries": 2, "timeout": 10}


def _steps_on(store: Store) -> list[str]:
    return sorted({n.split("/", 1)[0] for n in store.list()})


def _uploaded(*steps: int) -> list[str]:
    """The top-level names on the store of `steps`, uploaded and verified."""
    return sorted([step_name(s, False) for s in steps] + [step_name(s, False) + ".uploaded.json" for s in steps])


def test_rollback_is_not_undone_by_the_store(tmp_path, s3_env):
    """The finding: keep=1, steps 1-4 uploaded, back to step 2, step 3 saved again: a fresh
    manager restores the new step 3, never the abandoned step 4."""
    url = f"s3://{s3_env.new_bucket()}/r"
    with Checkpointer(tmp_path / "a", keep=1, remote=url, save_options=OPTS) as ck:
        for s in (1, 2, 3, 4):
            ck.save(s, state_for(s))
            ck.wait(uploads=True, timeout=60)
        r = ck.restore(step=2)
        assert r.source == "remote"
        assert ck.rollback(2) == [3, 4]
        assert ck.steps() == [1, 2] and ck.latest_step() == 2
        ck.save(3, state_for(33))
        ck.wait(uploads=True, timeout=60)
        assert ck.steps() == [1, 2, 3] and ck.status()["rollback_pending"] is None
    assert not (tmp_path / "a" / JOURNAL_NAME).exists()
    store = open_store(url)
    assert _steps_on(store) == _uploaded(1, 2, 3)
    with Checkpointer(tmp_path / "fresh", remote=url) as ck:
        assert ck.steps() == [1, 2, 3]
        r = ck.restore()
        assert r.step == 3 and r.source == "remote"
        assert_same(r.state, state_for(33))


def test_rollback_local_only(tmp_path):
    with Checkpointer(tmp_path, keep=5, save_options=OPTS) as ck:
        for s in (1, 2, 3, 4):
            ck.save(s, state_for(s))
        with pytest.raises(ValueError, match="^step must be an int, got str '2'"):
            ck.rollback("2")
        with pytest.raises(NoCheckpointError, match=f"^no step 7 to roll back to in {str(tmp_path)!r}$"):
            ck.rollback(7)
        assert ck.rollback(2) == [3, 4]
        assert ck.steps() == [1, 2]
        ck.save(3, state_for(33))
        assert_same(ck.restore().state, state_for(33))
        assert ck.rollback(3) == [] and ck.steps() == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".gdsckpt-manager.lock"] + \
        [step_name(s, False) for s in (1, 2, 3)]


def test_rollback_with_the_store_down_is_finished_before_any_upload(tmp_path, monkeypatch):
    server = SeaweedS3().start()
    try:
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        url = f"s3://{server.new_bucket()}/p"
        ck = Checkpointer(tmp_path, keep=4, remote=url, remote_options=FAST, save_options=OPTS)
        for s in (1, 2, 3, 4):
            ck.save(s, state_for(s, n=2000))
            ck.wait(uploads=True, timeout=60)
        server.kill()
        assert ck.rollback(2) == [3, 4]  # the local ones: the store is not reached
        st = ck.status()
        assert st["rollback_pending"] == 2 and st["errors"][-1]["error"].startswith("rollback: "), st
        assert (tmp_path / JOURNAL_NAME).exists()
        ck.save(3, state_for(33, n=2000))  # checkpointing goes on; its upload waits for the removal
        server.start()
        deadline = time.monotonic() + 120
        while ck.status()["rollback_pending"] is not None or 3 not in (ck.status()["uploaded"] or []):
            assert time.monotonic() < deadline, ck.status()
            time.sleep(0.5)
        ck.close()
        assert not (tmp_path / JOURNAL_NAME).exists()
        assert _steps_on(open_store(url)) == _uploaded(1, 2, 3)
        with Checkpointer(tmp_path / "fresh", remote=url) as ck2:
            assert_same(ck2.restore().state, state_for(33, n=2000))
    finally:
        server.stop()


_KILLED_ROLLBACK = r"""
import sys, time
sys.path.insert(0, sys.argv[3]); sys.path.insert(0, sys.argv[4])
from gdsckpt.manager.checkpointer import Checkpointer
from gdsckpt.stores.s3 import S3Store
real = S3Store.delete
def delete(self, name):  # killed after the store's first removal
    real(self, name)
    print("deleted", name, flush=True)
    time.sleep(60)
S3Store.delete = delete
Checkpointer(sys.argv[1], remote=sys.argv[2], keep=4).rollback(2)
"""


def test_a_killed_rollback_is_finished_by_the_next_manager(tmp_path, s3_env):
    url = f"s3://{s3_env.new_bucket()}/k"
    with Checkpointer(tmp_path, keep=4, remote=url, save_options=OPTS) as ck:
        for s in (1, 2, 3, 4):
            ck.save(s, state_for(s, n=2000))
            ck.wait(uploads=True, timeout=60)
    p = subprocess.Popen([sys.executable, "-c", _KILLED_ROLLBACK, str(tmp_path), url, str(ROOT), str(TESTS)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=os.environ.copy())
    try:
        line = p.stdout.readline()
        assert line.startswith("deleted"), line + p.stderr.read()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert (tmp_path / JOURNAL_NAME).exists()
    store = open_store(url)
    assert step_name(4, False) in _steps_on(store)  # the kill left the store's part unfinished
    with Checkpointer(tmp_path, remote=url) as ck:  # finishes it as it opens, before any upload
        assert ck.steps() == [1, 2] and ck.status()["rollback_pending"] is None
    assert not (tmp_path / JOURNAL_NAME).exists()
    assert _steps_on(store) == _uploaded(1, 2)


def test_a_damaged_rollback_record_is_refused_naming_it(tmp_path):
    import gdsckpt
    with Checkpointer(tmp_path, save_options=OPTS) as ck:
        ck.save(1, state_for(1, n=100))
    (tmp_path / JOURNAL_NAME).write_text('{"local_to": "2"}')
    with pytest.raises(gdsckpt.CheckpointFormatError, match="a rollback's record is damaged") as e:
        Checkpointer(tmp_path)
    assert str(tmp_path / JOURNAL_NAME) in str(e.value)
    (tmp_path / JOURNAL_NAME).unlink()
    with Checkpointer(tmp_path) as ck:  # the failed open released the lock
        assert ck.steps() == [1]
