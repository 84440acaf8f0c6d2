"""A Checkpointer's lifetime: a failed save_async raised once, not again after the caller saw it;
close() and the directory lock (never released while the uploader runs); a read-only directory
opened to restore; a stale lock named as such."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gdsckpt.errors import CheckpointLockedError
from gdsckpt.manager.checkpointer import Checkpointer
from gdsckpt.stores.s3 import S3Store
from test_manager import OPTS, state_for

TESTS = Path(__file__).parents[1]
ROOT = TESTS.parent

_FAILED_SAVE_CHILD = r"""
import json, os, resource, signal, sys
sys.path.insert(0, sys.argv[2]); sys.path.insert(0, sys.argv[3])
from gdsckpt.manager.checkpointer import Checkpointer
from test_manager import state_for
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
_, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
seen = sys.argv[4] == "seen"
out = {}
ck = Checkpointer(sys.argv[1], keep=2, save_options={"chunk_bytes": 64 << 10})
ck.save(1, state_for(1))
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
fut = ck.save_async(2, state_for(2, n=400_000))
if seen:
    try:
        fut.result()
    except OSError as e:
        out["seen"] = e.errno
else:  # waited for, never looked at
    import concurrent.futures
    concurrent.futures.wait([fut])
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
for what in ("restore", "close"):
    try:
        if what == "restore":
            out["restored"] = ck.restore().step
        else:
            ck.close()
            out["closed"] = True
    except Exception as e:
        out.setdefault("raised", []).append([what, type(e).__name__])
        if what == "restore":
            out["restored"] = ck.restore().step  # raised once only
print(json.dumps(out))
"""


def _failed_save(tmp_path, mode):
    r = subprocess.run([sys.executable, "-c", _FAILED_SAVE_CHILD, str(tmp_path), str(ROOT), str(TESTS), mode],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def test_a_failed_save_async_seen_by_the_caller_is_not_raised_again(tmp_path):
    out = _failed_save(tmp_path, "seen")
    assert out == {"seen": 27, "restored": 1, "closed": True}, out  # EFBIG


def test_a_failed_save_async_nobody_looked_at_is_raised_once(tmp_path):
    out = _failed_save(tmp_path, "unseen")
    assert out == {"raised": [["restore", "OSError"]], "restored": 1, "closed": True}, out


def test_close_without_waiting_keeps_the_lock_while_an_upload_runs(tmp_path, s3_env, monkeypatch):
    """close(wait_uploads=False) returns within its timeout, but the directory stays locked
    until the upload in flight ends: a second manager must not prune or upload beside it."""
    gate, started = threading.Event(), threading.Event()
    real = S3Store.put_file

    def held_upload(self, path, name):
        started.set()
        gate.wait(60)
        return real(self, path, name)

    monkeypatch.setattr(S3Store, "put_file", held_upload)
    url = f"s3://{s3_env.new_bucket()}/p"
    ck = Checkpointer(tmp_path, remote=url, save_options=OPTS)
    ck.save(1, state_for(1, n=2000))
    assert started.wait(30)
    t = time.monotonic()
    ck.close(wait_uploads=False, timeout=0.5)
    assert time.monotonic() - t < 5
    uploader = [th for th in threading.enumerate() if th.name == "gdsckpt-uploader"]
    assert len(uploader) == 1 and uploader[0].is_alive()
    with pytest.raises(CheckpointLockedError, match="in use by another Checkpointer"):
        Checkpointer(tmp_path)
    gate.set()
    uploader[0].join(60)
    assert not uploader[0].is_alive()
    with Checkpointer(tmp_path, remote=url) as ck2:  # released as the upload ended
        assert ck2.remote_steps().keys() == {1}


_READ_ONLY_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[2]); sys.path.insert(0, sys.argv[3])
import gdsckpt
from gdsckpt.manager.checkpointer import Checkpointer
from conftest import assert_same
from test_manager import state_for
out = {}
with Checkpointer(sys.argv[1]) as ck:
    out["read_only"] = ck.read_only
    out["steps"] = ck.steps()
    out["latest"] = ck.latest_step()
    r = ck.restore()
    assert_same(r.state, state_for(r.step))
    out["restored"] = r.step
    out["dry_run"] = ck.prune(dry_run=True)
    for what in ("save", "save_async", "prune"):
        try:
            if what == "prune":
                ck.prune()
            else:
                getattr(ck, what)(9, state_for(9))
        except gdsckpt.ReadOnlyCheckpointerError as e:
            out[what] = str(e)
print(json.dumps(out))
"""


def _as_unprivileged() -> list[str]:
    """A command prefix that makes root obey file modes, as any other user does."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root, and no setpriv to drop CAP_DAC_OVERRIDE")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search",
            "--inh-caps=-dac_override,-dac_read_search"]


@pytest.mark.parametrize("lock_file", ["left", "none"])
def test_a_read_only_directory_is_opened_to_restore(tmp_path, lock_file):
    d = tmp_path / "run"
    with Checkpointer(d, keep=2, save_options=OPTS) as ck:
        for s in (1, 2, 3):
            ck.save(s, state_for(s))
    if lock_file == "none":
        (d / ".gdsckpt-manager.lock").unlink()
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    for p in d.iterdir():
        p.chmod(0o444)
    d.chmod(0o555)
    try:
        r = subprocess.run([*_as_unprivileged(), sys.executable, "-c", _READ_ONLY_CHILD, str(d), str(ROOT),
                            str(TESTS)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    finally:
        d.chmod(0o755)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    why = f"{str(d)!r} cannot be written (read-only), so this Checkpointer only restores"
    assert out == {"read_only": True, "steps": [2, 3], "latest": 3, "restored": 3,
                   "dry_run": {"local": [], "remote": [], "damaged": {}}, "save": f"cannot save step 9: {why}",
                   "save_async": f"cannot save step 9: {why}", "prune": f"cannot prune: {why}"}, out
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before  # nothing written, nothing removed


_FORKED_HOLDER = r"""
import os, sys, time
sys.path.insert(0, sys.argv[2])
from gdsckpt.manager.checkpointer import Checkpointer
ck = Checkpointer(sys.argv[1])
child = os.fork()
if child == 0:  # a forked worker (a DataLoader's, say): it inherits the open lock file
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)  # not the parent's pipes: the test reads them to their end
    time.sleep(120)
    os._exit(0)
print(child, flush=True)
os._exit(0)  # the manager's process dies; its worker lives on
"""


def test_a_stale_lock_is_named_as_such(tmp_path):
    r = subprocess.run([sys.executable, "-c", _FORKED_HOLDER, str(tmp_path), str(ROOT)], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    worker = int(r.stdout.split()[0])
    try:
        with pytest.raises(CheckpointLockedError) as e:
            Checkpointer(tmp_path)
        msg = str(e.value)
        dead = msg.split("(pid ", 1)[1].split()[0]
        assert f"(pid {dead} on {socket.gethostname()}, which is no longer running: a stale lock, still held by " \
               f"a process it started that inherited the open lock file (pid {worker}); end that process)" in msg, msg
    finally:
        os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:
        try:
            Checkpointer(tmp_path).close()
            break
        except CheckpointLockedError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
