"""The CLI's commands on a Checkpointer's directory (gdsckpt/cli.py): ls, restore-test, prune and
clean, on what a team finds after weeks: typos, damaged steps, leftovers of killed processes.
The commands against a real S3 server are in test_manager_remote.py."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from gdsckpt import cli
from gdsckpt.manager.checkpointer import Checkpointer, step_name
from gdsckpt.core.storage import HOST_ID, TMP_MARK, temp_path_for
from test_manager import OPTS, state_for

TESTS = Path(__file__).parents[1]
ROOT = TESTS.parent


def run_cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def test_prune_of_a_missing_directory_creates_nothing(tmp_path):
    typo = tmp_path / "no" / "such" / "run"
    for yes in ([], ["--yes"]):
        rc, out, err = run_cli("prune", typo, "--keep", "1", *yes)
        assert rc == 3 and out == "", (rc, out, err)  # 3: not found
        assert err == f"gdsckpt prune: error: {typo}: No such directory (expected a Checkpointer directory)\n"
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- clean

_KILLED_RESTORE = r"""
import sys, time
sys.path.insert(0, sys.argv[3]); sys.path.insert(0, sys.argv[4])
from gdsckpt import api
from gdsckpt.manager.checkpointer import Checkpointer
real = api.open
def slow_open(path, **kw):  # the step is downloaded: killed while loading it
    print("loading", path, flush=True)
    time.sleep(60)
    return real(path, **kw)
api.open = slow_open
Checkpointer(sys.argv[1], remote=sys.argv[2]).restore()
"""


def _killed_restore(d: Path, url: str) -> Path:
    """A restore from the store SIGKILLed after its download: the full-size file it leaves."""
    p = subprocess.Popen([sys.executable, "-c", _KILLED_RESTORE, str(d), url, str(ROOT), str(TESTS)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=os.environ.copy())
    try:
        line = p.stdout.readline()
        assert line.startswith("loading"), line + p.stderr.read()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    left = Path(line.split(None, 1)[1].strip())
    assert left.name.startswith(f".{step_name(2, False)}{TMP_MARK}{p.pid}.{HOST_ID}.") and left.parent == d, left
    return left


def test_a_killed_restores_download_is_removed_by_clean_and_the_next_manager(tmp_path, s3_env):
    url = f"s3://{s3_env.new_bucket()}/r"
    with Checkpointer(tmp_path / "a", remote=url, save_options=OPTS) as ck:
        ck.save(2, state_for(2))
        ck.wait(uploads=True, timeout=60)
    d = tmp_path / "b"
    d.mkdir()
    left = _killed_restore(d, url)
    assert left.stat().st_size == (tmp_path / "a" / step_name(2, False)).stat().st_size
    mine = temp_path_for(d / step_name(2, False))  # a restore of a live process: not touched
    mine.write_bytes(b"in flight")
    rc, out, _ = run_cli("clean", d)
    assert rc == 0 and out == f"stale: {left}\nre-run with --yes to remove them\n", out
    rc, out, _ = run_cli("clean", d, "--yes")
    assert rc == 0 and out == f"removing {left}\n" and not left.exists() and mine.exists()

    left = _killed_restore(d, url)
    with Checkpointer(d, remote=url) as ck:  # the next manager removes it as it opens
        assert not left.exists() and mine.exists()
        assert ck.restore().step == 2


def test_clean_removes_only_the_librarys_temporaries(tmp_path):
    user = tmp_path / "notes.gdsckpt-tmp.txt"
    user.write_text("mine")
    odd = tmp_path / ".x.gdsckpt-tmp.notapid.0"
    odd.write_text("mine too")
    rc, out, _ = run_cli("clean", tmp_path, "--yes")
    assert rc == 0 and user.exists() and odd.exists(), out


def test_ls_skips_a_step_that_retention_removes_while_it_lists(tmp_path, monkeypatch):
    """ls takes no lock: a running Checkpointer may delete a step between the listing and its
    stat; the step is left out, the rest listed, exit 0."""
    import gdsckpt.cli.views as views
    with Checkpointer(tmp_path, keep=3, save_options=OPTS) as ck:
        for s in (1, 2):
            ck.save(s, state_for(s, n=2000))
    real = os.listdir

    def listdir_then_retention(d):  # os.listdir everywhere: only the directory's listing lets step 1 go
        names = real(d)
        if Path(d) == tmp_path:
            assert step_name(1, False) in names
            (tmp_path / step_name(1, False)).unlink()
        return names

    monkeypatch.setattr(views.os, "listdir", listdir_then_retention)
    rc, out, err = run_cli("ls", tmp_path, "--json")
    assert rc == 0 and err == "", (rc, err)
    assert [(r["step"], r["local_state"]) for r in json.loads(out)] == [(2, "ok")]


# ---------------------------------------------------------------- a pending rollback

def _three_steps(d: Path) -> None:
    ck = Checkpointer(d, keep=5)
    for s in (1, 2, 3):
        ck.save(s, state_for(s))
    ck.close()


def test_prune_without_yes_changes_nothing_and_names_a_pending_rollbacks_steps(tmp_path):
    """A dry run opens the directory read-only: no lock file, no temporary removed, a pending
    rollback's steps left where they are but listed among those --yes removes; --yes removes them
    and says so."""
    d = tmp_path / "run"
    _three_steps(d)
    (d / ".gdsckpt-rollback.json").write_text('{"local_to": 1, "store_to": null}')
    stale = temp_path_for(d / step_name(4, False))
    stale.write_bytes(b"x")
    os.utime(stale, (1, 1))  # a killed save's, days old
    before = sorted(os.listdir(d))
    rc, out, _ = run_cli("prune", d, "--keep", "5")
    assert rc == 0 and sorted(os.listdir(d)) == before, out  # nothing removed, no lock file made
    assert "a pending rollback gives up local steps [2, 3]" in out and "would remove: local steps [2, 3]" in out
    rc, out, _ = run_cli("prune", d, "--keep", "5", "--yes", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["local"] == [2, 3] and doc["rollback"] == {"local": [2, 3], "remote": []}
    assert Checkpointer(d, read_only=True).steps() == [1]
    assert not (d / ".gdsckpt-rollback.json").exists()


def test_ls_and_restore_test_count_a_pending_rollback_as_restore_does(tmp_path):
    d = tmp_path / "run"
    _three_steps(d)
    (d / ".gdsckpt-rollback.json").write_text('{"local_to": 1, "store_to": null}')
    rc, out, _ = run_cli("ls", d, "--json")
    states = {r["step"]: r["local_state"] for r in json.loads(out)}
    assert rc == 0 and states[1] == "ok"
    assert states[2] == states[3] == "given up by a pending rollback to step 1"
    rc, out, _ = run_cli("restore-test", d)
    assert "restore() would use step 1" in out and rc == 1, out  # not the newest listed step
    ck = Checkpointer(d)
    assert ck.restore().step == 1  # what restore() does
    ck.close()
    (d / ".gdsckpt-rollback.json").write_text("{not json")
    rc, out, err = run_cli("ls", d)
    assert rc == 1 and "rollback's record is damaged" in err, (rc, out, err)


def test_prune_keep_remote_without_remote_is_a_usage_error(tmp_path):
    d = tmp_path / "run"
    _three_steps(d)
    rc, out, err = run_cli("prune", d, "--keep", "1", "--keep-remote", "1", "--yes")
    assert rc == 2 and "--remote" in err and Checkpointer(d, read_only=True).steps() == [1, 2, 3]
