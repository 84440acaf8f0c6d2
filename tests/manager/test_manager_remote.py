"""The Checkpointer's object-store tier against a real S3 server (SeaweedFS, tests/s3_server.py):
uploads verified before they count, the policy (keep, keep_remote, every_remote, coalescing,
never the only copy), restore from the store when no local copy is left, and the faults of
issue 14: the server killed mid-upload, wrong credentials, a missing bucket, partial or corrupt
objects, SIGKILL during an upload and during pruning."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import gdsckpt
from gdsckpt.errors import BucketNotFoundError, NoCheckpointError, RemoteAccessError
from gdsckpt.manager.checkpointer import Checkpointer, step_name
from gdsckpt.options import KeepEvery, LatestN, RemoteOptions
from gdsckpt.manager.remote.marker import MARKER
from gdsckpt.manager.remote.verify import verify_object
from gdsckpt.stores import Store, open_store
from gdsckpt.stores.s3 import S3Store
from conftest import assert_same
from s3_server import SeaweedS3
from test_manager import OPTS, corrupt_chunk, state_for

TESTS = Path(__file__).parents[1]
ROOT = TESTS.parent
FAST = {"max_retries": 2, "timeout": 10}


def remote_names(store: Store) -> list[str]:
    return sorted(store.list())


def test_uploads_verified_and_policy(tmp_path, s3_env):
    bucket = s3_env.new_bucket()
    url = f"s3://{bucket}/run1"
    with Checkpointer(tmp_path, keep=1, remote=url, keep_remote=2, save_options=OPTS) as ck:
        for s in (1, 2, 3, 4):
            ck.save(s, state_for(s))
            ck.wait(uploads=True, timeout=60)
        st = ck.status()
        assert st["uploaded"] == [3, 4] and st["queue_depth"] == 0 and st["errors"] == [], st
        assert st["uploads"] == 4 and st["uploaded_bytes"] > 0 and st["MBps"] > 0
        assert st["last_upload"]["step"] == 4 and st["last_upload"]["verify_seconds"] > 0
        assert ck.steps() == [3, 4]
    store = open_store(url)
    names = remote_names(store)
    assert names == [step_name(3, False), step_name(3, False) + MARKER,
                     step_name(4, False), step_name(4, False) + MARKER], names
    assert sorted(os.listdir(tmp_path)) == [".gdsckpt-manager.lock", step_name(4, False)]
    # the object is the local file, byte for byte
    assert store.get_bytes(step_name(4, False)) == (tmp_path / step_name(4, False)).read_bytes()


def test_remote_retention_policy_keeps_every_nth_for_good(tmp_path, s3_env):
    """keep_remote= takes a retention policy as keep= does (gdsckpt.options): the store keeps the
    newest step and every other one for good, the directory only the newest."""
    url = f"s3://{s3_env.new_bucket()}/run1"
    with Checkpointer(tmp_path, keep=1, remote=RemoteOptions(url, keep=LatestN(1) | KeepEvery(2)),
                      save_options=OPTS) as ck:
        for s in (1, 2, 3, 4, 5):
            ck.save(s, state_for(s))
            ck.wait(uploads=True, timeout=60)
        assert ck.status()["uploaded"] == [2, 4, 5] and ck.remote_steps().keys() == {2, 4, 5}
        assert ck.layout.local_steps() == [5]
        r = ck.restore(step=2)
        assert r.source == "remote"
        assert_same(r.state, state_for(2))


def test_restore_from_the_store_without_a_local_copy(tmp_path, s3_env):
    url = f"s3://{s3_env.new_bucket()}/r"
    with Checkpointer(tmp_path / "a", keep=1, remote=url, save_options=OPTS) as ck:
        for s in (5, 6):
            ck.save(s, state_for(s))
            ck.wait(uploads=True, timeout=60)
    shutil.rmtree(tmp_path / "a")  # the node is gone; a new one restores from the store
    with Checkpointer(tmp_path / "b", remote=url) as ck:
        assert ck.steps() == [5, 6] and ck.latest_step() == 6
        r = ck.restore()
        assert r.step == 6 and r.source == "remote" and r.path == f"{url}/{step_name(6, False)}"
        assert_same(r.state, state_for(6))
        target = state_for(0)
        ck.restore(target, step=5)
        for k in ("model", "optim"):
            assert_same(target[k], state_for(5)[k])
        # training continues from there, in the new directory
        ck.save(7, state_for(7))
        ck.wait(uploads=True, timeout=60)
        assert ck.status()["uploaded"] == [5, 6, 7]


def test_a_step_saved_again_under_a_number_the_store_has_replaces_it(tmp_path, s3_env, caplog):
    """A new node resumes from step 5 (the store's step 6 diverged) and saves step 6 again: the
    store's step 6 is not the local one (by identity), so it is replaced, marker first; local
    retention lets the local copy go only once the new one is uploaded."""
    url = f"s3://{s3_env.new_bucket()}/u"
    raw = {**OPTS, "codec": "raw"}  # the same size for the same shapes: only the identity tells them apart
    with Checkpointer(tmp_path / "a", keep=2, remote=url, save_options=raw) as ck:
        for s in (5, 6):
            ck.save(s, state_for(s, n=2000))
            ck.wait(uploads=True, timeout=60)
    shutil.rmtree(tmp_path / "a")
    with caplog.at_level(logging.WARNING, logger="gdsckpt.manager.checkpointer"):
        with Checkpointer(tmp_path / "b", remote=url, keep=1, save_options=raw) as ck:
            ck.restore(state_for(0, n=2000), step=5)
            ck.save(6, state_for(60, n=2000))
            ck.wait(uploads=True, timeout=60)
            st = ck.status()
            assert st["uploads"] == 1 and st["uploaded"] == [5, 6] and st["errors"] == [], st
            ck.save(7, state_for(7, n=2000))
            ck.wait(uploads=True, timeout=60)
            assert ck.layout.local_steps() == [7]
    assert f"step 6 on {url} is not the step 6 saved in {tmp_path / 'b'}" in caplog.text, caplog.text
    with Checkpointer(tmp_path / "c", remote=url) as ck:
        assert_same(ck.restore(step=6).state, state_for(60, n=2000))  # the step saved again, not the old one


def test_every_remote_and_coalescing(tmp_path, s3_env, monkeypatch):
    url = f"s3://{s3_env.new_bucket()}/r"
    gate = threading.Event()
    real = S3Store.put_file

    def slow_upload(self, path, name):
        gate.wait(60)  # the store is slow: saves pile up behind the first upload
        return real(self, path, name)

    monkeypatch.setattr(S3Store, "put_file", slow_upload)
    with Checkpointer(tmp_path, keep=2, remote=url, every_remote=2, save_options=OPTS) as ck:
        for s in range(1, 10):  # uploads chosen: 1, 3, 5, 7, 9; 3, 5, 7 overtaken while 1 is in flight
            ck.save(s, state_for(s, n=2000))
        st = ck.status()
        assert st["in_flight"] == 1 and st["queued"] == [3, 5, 7, 9] and st["queue_depth"] == 4, st
        # nothing is deleted although keep=2: no step (nor a newer one) has reached the store yet
        assert ck.steps() == list(range(1, 10))
        gate.set()
        ck.wait(uploads=True, timeout=60)
        st = ck.status()
        assert st["uploaded"] == [1, 9] and st["skipped"] == [3, 5, 7], st
        assert st["local_steps"] == [8, 9]  # all older than an uploaded step


@pytest.mark.parametrize("fault", ["wrong-secret", "unknown-key", "missing-bucket"])
def test_refused_store_local_checkpointing_goes_on(tmp_path, s3_env, monkeypatch, caplog, fault):
    bucket = s3_env.new_bucket()
    if fault == "wrong-secret":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-xyz")
    elif fault == "unknown-key":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody-key-xyz")
    else:
        bucket = "no-such-bucket-gdsckpt"
    caplog.set_level(logging.WARNING, logger="gdsckpt.manager.checkpointer")
    with Checkpointer(tmp_path, keep=1, remote=f"s3://{bucket}/p", remote_options=FAST,
                      save_options=OPTS) as ck:
        for s in (1, 2, 3):
            ck.save(s, state_for(s, n=2000))
            ck.wait(uploads=True, timeout=30)
        st = ck.status()
        assert st["failures"] >= 1 and st["uploaded"] in (None, [])
        err = st["errors"][-1]["error"]
        assert f"bucket {bucket!r}" in err, err
        kind = BucketNotFoundError if fault == "missing-bucket" else RemoteAccessError
        assert err.startswith(kind.__name__), err
        # local checkpointing went on, and nothing was deleted: no step has a second copy
        assert ck.steps() == [1, 2, 3] or ck.status()["local_steps"] == [1, 2, 3]
        assert ck.restore().step == 3
        with pytest.raises(gdsckpt.UploadIncompleteError, match="step 3 never reached"):
            ck.close(timeout=1)
    logged = caplog.text
    assert bucket in logged and "local copy is kept" in logged
    for secret in ("not-the-secret-xyz", "gdsckpt-test-secret"):
        assert secret not in logged and secret not in json.dumps(st)


def test_server_killed_mid_upload_then_back(tmp_path, monkeypatch):
    """A server of its own, killed while a multipart upload is in flight: the upload fails
    clearly, the local copy is kept, nothing counts on the store; once the server is back the
    retried upload succeeds and verifies."""
    server = SeaweedS3().start()
    try:
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        url = f"s3://{server.new_bucket()}/p"
        started = threading.Event()
        real = S3Store.put_file

        def watched(self, path, name):
            started.set()
            return real(self, path, name)

        monkeypatch.setattr(S3Store, "put_file", watched)
        opts = {"part_bytes": 5 << 20, "concurrency": 2, **FAST}
        ck = Checkpointer(tmp_path, keep=1, remote=url, remote_options=opts, save_options=OPTS)
        ck.save(1, state_for(1, n=6_000_000))  # ~36 MB: several parts
        assert started.wait(30)
        time.sleep(0.2)
        server.kill()
        ck.wait(uploads=True, timeout=60)
        st = ck.status()
        assert st["failures"] >= 1 and not st["uploaded"], st
        assert "RemoteUnavailableError" in st["errors"][-1]["error"] or "RemoteStoreError" in st["errors"][-1]["error"]
        assert (tmp_path / step_name(1, False)).is_file()
        ck.save(2, state_for(2, n=2000))  # local checkpointing goes on; step 1 is not deleted (only copy)
        assert ck.status()["local_steps"] == [1, 2]
        server.start()
        deadline = time.monotonic() + 120
        while ck.status()["uploaded"] != [2] and time.monotonic() < deadline:
            time.sleep(0.5)
        st = ck.status()
        assert st["uploaded"] == [2] and st["skipped"] == [1], st  # step 1's retry was overtaken by step 2
        ck.wait(uploads=True, timeout=60)  # and the retention the upload requested (a thread of its own)
        assert ck.status()["local_steps"] == [2]
        ck.close()
        with Checkpointer(tmp_path / "fresh", remote=url) as ck2:
            assert ck2.steps() == [2]
            assert_same(ck2.restore().state, state_for(2, n=2000))
    finally:
        server.stop()


def test_partial_or_corrupt_objects_never_count(tmp_path, s3_env):
    url = f"s3://{s3_env.new_bucket()}/p"
    with Checkpointer(tmp_path / "a", keep=3, remote=url, save_options=OPTS) as ck:
        for s in (1, 2, 3, 4):
            ck.save(s, state_for(s))
            ck.wait(uploads=True, timeout=60)
    store = open_store(url)
    local = tmp_path / "a"
    # step 5: an object with no marker (an upload killed before its verify): does not count
    store.put_file(local / step_name(4, False), step_name(5, False))
    # step 4: its object replaced by a truncated one: the marker's size no longer matches
    data = (local / step_name(4, False)).read_bytes()
    store.put_bytes(step_name(4, False), data[:len(data) // 2])
    # step 3: same size, one flipped bit in a chunk: counts as listed, fails on restore
    p3 = tmp_path / "s3copy"
    shutil.copy(local / step_name(3, False), p3)
    corrupt_chunk(p3)
    store.put_bytes(step_name(3, False), p3.read_bytes())
    # the verify of an upload catches it too
    with pytest.raises(gdsckpt.ChecksumError, match=step_name(3, False)):
        verify_object(store, step_name(3, False))
    shutil.rmtree(local)
    with Checkpointer(tmp_path / "b", remote=url) as ck:
        assert ck.steps() == [1, 2, 3]
        with pytest.warns(UserWarning, match="restored step 2"):
            r = ck.restore()
        assert r.step == 2 and r.source == "remote" and [(s, w) for s, w, _ in r.skipped] == [(3, "remote")]
        assert "checksum" in r.skipped[0][2]
        assert_same(r.state, state_for(2))


_UPLOAD_KILL_CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[3]); sys.path.insert(0, sys.argv[4])
import gdsckpt.manager.checkpointer as m
import gdsckpt.manager.remote.tier as tier
from gdsckpt.stores.s3 import S3Store
from test_manager import state_for
mode = sys.argv[5]
if mode == "upload":  # killed while the multipart upload runs
    real = S3Store.put_file
    def upload(self, path, name):
        print("uploading", name, flush=True)
        return real(self, path, name)
    S3Store.put_file = upload
elif mode == "verify":  # killed with the object complete on the store, before its verify and marker
    real_verify = tier.verify_object
    def verify(store, name, **kw):
        print("uploading", name, flush=True)
        time.sleep(30)
        return real_verify(store, name, **kw)
    tier.verify_object = verify
else:  # prune: stop between the marker's removal and the object's (the remote retention)
    real_delete = S3Store.delete
    def delete(self, name):
        real_delete(self, name)
        if name.endswith(tier.MARKER):
            print("pruning", name, flush=True)
            time.sleep(30)
    S3Store.delete = delete
ck = m.Checkpointer(sys.argv[1], keep=1, remote=sys.argv[2], keep_remote=1,
                    remote_options={"part_bytes": 5 << 20, "concurrency": 2},
                    save_options={"chunk_bytes": 64 << 10})
step = (ck.latest_step() or 0) + 1
n = 2000 if mode == "prune" else 3_000_000
while True:
    ck.save(step, state_for(step, n=n))
    print("saved", step, flush=True)
    ck.wait(uploads=True, timeout=60)
    step += 1
"""


@pytest.mark.parametrize("mode", ["upload", "verify", "prune"])
def test_sigkill_during_upload_or_pruning(tmp_path, s3_env, mode):
    url = f"s3://{s3_env.new_bucket()}/p"
    # step 1 uploaded and verified first
    with Checkpointer(tmp_path / "seed", remote=url, save_options=OPTS) as ck:
        ck.save(1, state_for(1, n=2000 if mode == "prune" else 3_000_000))
        ck.wait(uploads=True, timeout=60)
        assert ck.status()["uploaded"] == [1]
    shutil.copy(tmp_path / "seed" / step_name(1, False), tmp_path / "x")
    local = tmp_path / "run"
    local.mkdir()
    shutil.copy(tmp_path / "x", local / step_name(1, False))
    want = "pruning" if mode == "prune" else "uploading step_00000002"
    p = subprocess.Popen([sys.executable, "-c", _UPLOAD_KILL_CHILD, str(local), url, str(ROOT), str(TESTS), mode],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=os.environ.copy())
    try:
        while True:
            line = p.stdout.readline()
            assert line, p.stderr.read()
            if line.startswith(want):
                break
        time.sleep(0.3 if mode != "upload" else 0.0)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    with Checkpointer(tmp_path / "fresh", remote=url) as ck:  # the store alone, before anyone re-uploads
        r = ck.restore()
        assert r.skipped == [] and r.source == "remote"
        assert_same(r.state, state_for(r.step, n=2000 if mode == "prune" else 3_000_000))
        if mode == "verify":
            assert r.step == 1  # step 2's object was complete but unverified: it never counted
    with Checkpointer(local, remote=url) as ck:  # the lock died with the process
        r = ck.restore()
        assert r.skipped == [] and r.source == "local"
        assert_same(r.state, state_for(r.step, n=2000 if mode == "prune" else 3_000_000))
        ck.wait(uploads=True, timeout=60)  # a restarted manager uploads its newest step if the store lacks it
        assert ck.status()["uploaded"][-1] == ck.status()["local_steps"][-1]
    # and its remote retention removed what the kill left: every step object has its marker
    names = set(open_store(url).list())
    assert all(n + MARKER in names for n in names if not n.endswith(MARKER)), names


def test_cli_ls_restore_test_prune(tmp_path, s3_env, capsys):
    from gdsckpt.cli import main
    url = f"s3://{s3_env.new_bucket()}/cli"
    d = tmp_path / "run"
    with Checkpointer(d, keep=5, remote=url, every_remote=2, save_options=OPTS) as ck:
        for s in (1, 2, 3, 4):
            ck.save(s, state_for(s, n=2000))
            ck.wait(uploads=True, timeout=60)
    capsys.readouterr()
    assert main(["ls", str(d), "--remote", url]) == 0
    out = capsys.readouterr().out
    lines = {int(l.split()[0]): l for l in out.splitlines()[1:]}
    assert sorted(lines) == [1, 2, 3, 4]
    assert "local+remote" in lines[1] and "local+remote" in lines[3] and "remote" not in lines[2].split()[1]
    assert "local: ok; remote: ok" in lines[3], out
    assert main(["ls", url, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["remote_state"]) for r in rows] == [(1, "ok"), (3, "ok")]

    assert main(["restore-test", str(d), "--remote", url]) == 0
    assert "restore() would use step 4" in capsys.readouterr().out
    corrupt_chunk(d / step_name(4, False))
    assert main(["ls", str(d), "--verify"]) == 0
    assert "DAMAGED: ChecksumError" in capsys.readouterr().out
    assert main(["restore-test", str(d), "--remote", url]) == 1
    out = capsys.readouterr().out
    assert "step 4: local: DAMAGED" in out and "restore() would use step 3, not the newer step 4" in out

    # prune: steps 1-2 may go (step 3, newer, is uploaded); 4 and 3 kept (keep=2); remote keeps 1
    assert main(["prune", str(d), "--keep", "2", "--remote", url, "--keep-remote", "1"]) == 0
    assert "would remove: local steps [1, 2]; remote steps [1]" in capsys.readouterr().out
    with Checkpointer(d):  # a running manager holds the lock: prune refuses
        assert main(["prune", str(d), "--keep", "1", "--yes"]) == 1  # 1: failed (the lock is held)
        assert "in use by another Checkpointer" in capsys.readouterr().err
    assert main(["prune", str(d), "--keep", "2", "--remote", url, "--keep-remote", "1", "--yes"]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) == [step_name(3, False),
                                                                               step_name(4, False)]
    assert main(["ls", url, "--json"]) == 0
    assert [r["step"] for r in json.loads(capsys.readouterr().out)] == [3]
