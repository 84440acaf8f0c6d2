"""A Checkpointer's lifetime: a failed save_async raised once, not again after the caller saw it;
close() and the directory lock (never released while the uploader runs); a read-only directory
opened to restore; a stale lock named as such."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gdsckpt.errors import CheckpointLockedError
from gdsckpt.manager import Checkpointer
from gdsckpt.remote import ObjectStore
from s3_server import s3_env, s3_server  # noqa: F401 - fixtures
from test_manager import OPTS, state_for

TESTS = Path(__file__).parent
ROOT = TESTS.parent

_FAILED_SAVE_CHILD = r"""
import json, os, resource, signal, sys
sys.path.insert(0, sys.argv[2]); sys.path.insert(0, sys.argv[3])
from gdsckpt.manager import Checkpointer
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
    real = ObjectStore.upload

    def held_upload(self, path, name):
        started.set()
        gate.wait(60)
        return real(self, path, name)

    monkeypatch.setattr(ObjectStore, "upload", held_upload)
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
