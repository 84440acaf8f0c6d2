"""The Checkpointer's object-store tier (gdsckpt/manager/remote/tier.py) against a real S3 server
(SeaweedFS, tests/s3_server.py) and a server that never answers: markers parsed against a schema,
each uploaded file's identity recorded and checked on restore, bounded waits when the store hangs,
close() naming the steps never uploaded, local damage reported as such and skipped for the older
intact step, orphan objects removed, download temporaries named as the library's temporaries."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import pytest

import gdsckpt
from gdsckpt.errors import NoCheckpointError
from gdsckpt.manager.checkpointer import Checkpointer, step_name
from gdsckpt.manager.remote.marker import MARKER
from gdsckpt.stores import open_store
from conftest import assert_same
from test_manager import OPTS, corrupt_chunk, state_for

RAW = {**OPTS, "codec": "raw"}  # equal sizes for equal shapes: a replaced object keeps its size
N = 2000


def _name(step: int) -> str:
    return step_name(step, False)


def _upload_steps(directory: Path, url: str, steps, **kw) -> None:
    with Checkpointer(directory, keep=len(steps), remote=url, save_options=kw.pop("save_options", OPTS), **kw) as ck:
        for s in steps:
            ck.save(s, state_for(s, n=N))
            ck.wait(uploads=True, timeout=60)
        assert ck.status()["uploaded"][-len(steps):] == list(steps), ck.status()


# ---------------------------------------------------------------- finding 7: markers against a schema


def _marker_doc(files, **more) -> bytes:
    return json.dumps({"format": "gdsckpt-upload-marker", "version": 2, "step": 2, "files": files, **more}).encode()


BAD_MARKERS = {
    "files-empty-list": b'{"files": []}',
    "files-string": b'{"files": "step_00000002.gdsckpt"}',
    "files-int": b'{"files": 5}',
    "files-null": b'{"files": null}',
    "no-files": b'{"step": 2}',
    "not-json": b"{not json",
    "json-list": b"[1, 2]",
    "older-marker": b'{"step": 2, "files": {"step_00000002.gdsckpt": 1}}',
    "schema-files-list": _marker_doc([]),
    "schema-size-string": _marker_doc({"step_00000002.gdsckpt": {"size": "big", "index_checksum": "0" * 16,
                                                                 "footer_checksum": "0" * 16}}),
    "schema-no-checksums": _marker_doc({"step_00000002.gdsckpt": {"size": 10}}),
    "schema-another-steps-object": _marker_doc({"step_00000001.gdsckpt": {"size": 10, "index_checksum": "0" * 16,
                                                                          "footer_checksum": "0" * 16}}),
    "uploaded-overflows-a-float": _marker_doc({"step_00000002.gdsckpt": {"size": 10, "index_checksum": "0" * 16,
                                                                         "footer_checksum": "0" * 16}},
                                              uploaded=10 ** 400),
    "schema-wrong-step": json.dumps({"format": "gdsckpt-upload-marker", "version": 2, "step": 9, "files": {}}).encode(),
}


@pytest.mark.parametrize("bad", sorted(BAD_MARKERS))
def test_a_malformed_marker_skips_its_step_with_a_warning(tmp_path, s3_env, caplog, capsys, bad):
    from gdsckpt.cli import main
    url = f"s3://{s3_env.new_bucket()}/m"
    _upload_steps(tmp_path / "a", url, (1, 2))
    open_store(url).put_bytes(_name(2) + MARKER, BAD_MARKERS[bad])
    capsys.readouterr()
    assert main(["ls", url, "--json"]) == 0
    assert [r["remote_state"] for r in json.loads(capsys.readouterr().out)] == [
        "ok", "incomplete (no verified-upload marker)"]
    caplog.set_level(logging.WARNING, logger="gdsckpt.manager.checkpointer")
    with Checkpointer(tmp_path / "b", remote=url, save_options=OPTS) as ck:
        assert ck.steps() == [1] and ck.latest_step() == 1 and ck.steps() == [1]
        r = ck.restore()
        assert r.step == 1 and r.source == "remote" and r.skipped == []
        assert_same(r.state, state_for(1, n=N))
        warned = [rec.getMessage() for rec in caplog.records if "is not valid" in rec.getMessage()]
        assert len(warned) == 1 and f"{url}/{_name(2)}{MARKER}" in warned[0], warned  # once, naming it
        # the uploader carries on with the next step
        ck.save(3, state_for(3, n=N))
        ck.wait(uploads=True, timeout=60)
        st = ck.status()
        assert st["uploaded"] == [1, 3] and st["errors"] == [], st
    with Checkpointer(tmp_path / "c", remote=url) as ck:
        assert ck.steps() == [1, 3]


# ---------------------------------------------------------------- finding 3: the file's identity


def test_marker_records_each_files_identity(tmp_path, s3_env):
    from gdsckpt.manager.remote.marker import file_identity
    url = f"s3://{s3_env.new_bucket()}/i"
    _upload_steps(tmp_path / "a", url, (1,))
    doc = json.loads(open_store(url).get_bytes(_name(1) + MARKER))
    want = file_identity(tmp_path / "a" / _name(1), _name(1))
    assert doc["files"] == {_name(1): {"size": want.size, "index_checksum": want.index_checksum,
                                       "footer_checksum": want.footer_checksum}}
    assert len(want.index_checksum) == len(want.footer_checksum) == 16


def test_an_object_replaced_by_a_valid_checkpoint_of_the_same_size_is_refused(tmp_path, s3_env, capsys):
    url = f"s3://{s3_env.new_bucket()}/i"
    _upload_steps(tmp_path / "a", url, (3, 4), save_options=RAW)
    store = open_store(url)
    step3 = (tmp_path / "a" / _name(3)).read_bytes()
    assert store.size(_name(4)) == len(step3)  # same size: the marker's size check cannot tell
    store.put_bytes(_name(4), step3)  # step 3's valid checkpoint where step 4's was
    shutil.rmtree(tmp_path / "a")
    with Checkpointer(tmp_path / "b", remote=url) as ck:
        assert ck.steps() == [3, 4]
        with pytest.warns(UserWarning, match="restored step 3"):
            r = ck.restore()
        assert r.step == 3 and r.source == "remote" and [(s, w) for s, w, _ in r.skipped] == [(4, "remote")]
        why = r.skipped[0][2]
        assert "not the file uploaded as step 4" in why and "index_checksum" in why and f"{url}/{_name(4)}" in why
        assert_same(r.state, state_for(3, n=N))
        with pytest.raises(gdsckpt.NoCheckpointError, match="not the file uploaded as step 4"):
            ck.restore(step=4)
        assert [p.name for p in (tmp_path / "b").iterdir() if not p.name.startswith(".gdsckpt-manager")] == []
    # the CLI's checks are restore()'s: step 4 is not intact, step 3 is what restore() uses
    from gdsckpt.cli import main
    capsys.readouterr()
    assert main(["restore-test", url, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert (doc["step"], doc["newest"]) == (3, 4), doc
    assert "not the file uploaded as step 4" in doc["checked"][0]["remote_state"], doc
    assert main(["ls", url, "--verify", "--json"]) == 0
    states = [r["remote_state"] for r in json.loads(capsys.readouterr().out)]
    assert states[0] == "ok" and states[1].startswith("DAMAGED: CheckpointFormatError: ") and \
        "index_checksum" in states[1] and f"{url}/{_name(4)}" in states[1], states


# ---------------------------------------------------------------- finding 8: a store that hangs


def _uploader_alive() -> bool:
    import threading
    return any(t.name == "gdsckpt-uploader" and t.is_alive() for t in threading.enumerate())


def test_a_hanging_store_answers_from_local_steps_within_the_bound(tmp_path, silent_endpoint, caplog):
    with Checkpointer(tmp_path, keep=2, save_options=OPTS) as ck:  # local steps, made without the store
        for s in (1, 2):
            ck.save(s, state_for(s, n=N))
    caplog.set_level(logging.WARNING, logger="gdsckpt.manager.checkpointer")
    bound = 2.0 + 1.5
    t = time.monotonic()
    ck = Checkpointer(tmp_path, keep=2, remote="s3://bkt/p", remote_options={"timeout": 2}, save_options=OPTS)
    try:
        assert time.monotonic() - t < 1.0  # construction does not wait for the store
        for call, want in ((ck.latest_step, 2), (ck.steps, [1, 2])):
            t = time.monotonic()
            assert call() == want
            assert time.monotonic() - t < bound, call
        t = time.monotonic()
        r = ck.restore()
        assert time.monotonic() - t < bound
        assert r.step == 2 and r.source == "local"
        assert_same(r.state, state_for(2, n=N))
        assert "cannot list s3://bkt/p" in caplog.text and "did not answer within 2 s" in caplog.text
    finally:
        t = time.monotonic()
        ck.close(wait_uploads=False)
        assert time.monotonic() - t < bound
        assert not _uploader_alive()  # the lock went only after the uploader stopped


# ---------------------------------------------------------------- finding 9: close() and steps never uploaded


def test_close_names_the_steps_never_uploaded(tmp_path, s3_env, monkeypatch):
    url = f"s3://{s3_env.new_bucket()}/c"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-abc")  # the store refuses every request
    ck = Checkpointer(tmp_path, keep=1, remote=url, remote_options={"timeout": 5}, save_options=OPTS)
    ck.save(1, state_for(1, n=N))
    ck.save(2, state_for(2, n=N))
    t = time.monotonic()
    with pytest.raises(gdsckpt.UploadIncompleteError) as e:
        ck.close()
    assert time.monotonic() - t < 10
    msg = str(e.value)
    assert e.value.steps == [2] and f"step 2 never reached {url}" in msg and "are kept" in msg, msg
    assert "RemoteAccessError" in msg and "not-the-secret-abc" not in msg
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == [_name(1), _name(2)]
    Checkpointer(tmp_path).close()  # the lock was released
    ck.close()  # closed already: nothing more


def test_close_without_waiting_for_uploads_does_not_raise(tmp_path, silent_endpoint):
    ck = Checkpointer(tmp_path, remote="s3://bkt/p", remote_options={"timeout": 2}, save_options=OPTS)
    ck.save(1, state_for(1, n=N))
    t = time.monotonic()
    ck.close(wait_uploads=False)
    assert time.monotonic() - t < 3.5 and not _uploader_alive()


def test_close_raises_within_the_bound_when_the_store_hangs(tmp_path, silent_endpoint):
    ck = Checkpointer(tmp_path, remote="s3://bkt/p", remote_options={"timeout": 2}, save_options=OPTS)
    ck.save(1, state_for(1, n=N))
    time.sleep(2.5)  # the first attempt has failed: step 1 waits for its retry (backoff)
    t = time.monotonic()
    with pytest.raises(gdsckpt.UploadIncompleteError, match="RemoteTimeoutError"):
        ck.close()  # one more attempt at once, not after the backoff
    assert time.monotonic() - t < 3.5 and not _uploader_alive()


def test_close_keeps_the_lock_until_the_uploader_has_stopped(tmp_path, s3_env, monkeypatch):
    import threading
    from gdsckpt.stores.s3 import S3Store
    url = f"s3://{s3_env.new_bucket()}/c"
    entered, gate = threading.Event(), threading.Event()
    real = S3Store.put_file

    def slow_put(self, path, name):
        entered.set()
        gate.wait(60)  # a long upload in flight
        return real(self, path, name)

    monkeypatch.setattr(S3Store, "put_file", slow_put)
    ck = Checkpointer(tmp_path, remote=url, save_options=OPTS)
    ck.save(1, state_for(1, n=N))
    assert entered.wait(30)
    closer = threading.Thread(target=ck.close, kwargs={"wait_uploads": False})
    closer.start()
    closer.join(1.0)
    assert closer.is_alive() and _uploader_alive()
    with pytest.raises(gdsckpt.CheckpointLockedError):
        Checkpointer(tmp_path)  # still held: the uploader still runs
    gate.set()
    closer.join(30)
    assert not closer.is_alive() and not _uploader_alive()
    Checkpointer(tmp_path).close()
    assert _name(1) + MARKER in open_store(url).list()  # the upload in flight was finished


# ---------------------------------------------------------------- finding 10: local damage; the newest intact step


def _gated_uploads(monkeypatch):
    import threading
    from gdsckpt.stores.s3 import S3Store
    gate, entered = threading.Event(), threading.Event()
    real = S3Store.put_file

    def put_file(self, path, name):
        entered.set()
        gate.wait(60)
        return real(self, path, name)

    monkeypatch.setattr(S3Store, "put_file", put_file)
    return gate, entered


@pytest.mark.parametrize("damage", ["chunk", "truncated"])
def test_a_damaged_local_step_is_local_damage_and_the_older_intact_one_goes(tmp_path, s3_env, monkeypatch, damage):
    url = f"s3://{s3_env.new_bucket()}/d"
    gate, entered = _gated_uploads(monkeypatch)
    d = tmp_path / "run"
    with Checkpointer(d, keep=3, remote=url, save_options=OPTS) as ck:
        ck.save(1, state_for(1, n=N))
        assert entered.wait(30)  # step 1's upload is in flight, held
        ck.save(2, state_for(2, n=N))
        ck.save(3, state_for(3, n=N))
        if damage == "chunk":
            corrupt_chunk(d / _name(3))
        else:
            (d / _name(3)).write_bytes(b"")
        gate.set()
        ck.wait(uploads=True, timeout=60)
        ck.wait(uploads=True, timeout=60)  # step 2, queued once step 3 was found damaged
        st = ck.status()
        assert st["uploaded"] == [1, 2], st
        [err] = st["errors"]
        assert err["step"] == 3 and err["error"].startswith("local damage: ") and str(d / _name(3)) in err["error"]
        assert "s3://" not in err["error"], err
        time.sleep(2)  # not retried
        assert ck.status()["errors"] == [err] and ck.status()["queued"] == [] and ck.status()["in_flight"] is None
    store = open_store(url)
    assert sorted(n for n in store.list() if n.endswith(MARKER)) == [_name(1) + MARKER, _name(2) + MARKER]


def test_remote_retention_keeps_the_newest_intact_step(tmp_path, s3_env):
    url = f"s3://{s3_env.new_bucket()}/r"
    _upload_steps(tmp_path / "a", url, (1, 2), save_options=RAW)
    store = open_store(url)
    store.put_bytes(_name(2), (tmp_path / "a" / _name(1)).read_bytes())  # step 2's object is no longer step 2
    with Checkpointer(tmp_path / "b", remote=url, keep_remote=1, upload=False) as ck:
        gone = ck.prune()
        assert gone["local"] == [] and gone["remote"] == []
    assert sorted(store.list()) == [_name(1), _name(1) + MARKER, _name(2), _name(2) + MARKER]
    with Checkpointer(tmp_path / "c", remote=url, keep_remote=1, save_options=RAW) as ck:
        ck.save(3, state_for(3, n=N))  # a new intact step: now the older ones may go
        ck.wait(uploads=True, timeout=60)
    assert sorted(store.list()) == [_name(3), _name(3) + MARKER]


def test_remote_retention_does_not_count_a_newest_step_with_a_damaged_chunk(tmp_path, s3_env, capsys, caplog):
    """The newest step's object keeps its size, index and footer (its identity) but one chunk
    differs: retention reads it in full before counting it, so the only restorable step stays."""
    from gdsckpt.cli import main
    url = f"s3://{s3_env.new_bucket()}/r"
    _upload_steps(tmp_path / "a", url, (1, 2))
    store = open_store(url)
    bad = tmp_path / "copy"
    shutil.copy(tmp_path / "a" / _name(2), bad)
    corrupt_chunk(bad)
    store.put_bytes(_name(2), bad.read_bytes())
    shutil.rmtree(tmp_path / "a")
    (tmp_path / "b").mkdir()
    with caplog.at_level(logging.WARNING, logger="gdsckpt.manager.checkpointer"):
        assert main(["prune", str(tmp_path / "b"), "--remote", url, "--keep-remote", "1", "--yes"]) == 0
    assert "remote steps none" in capsys.readouterr().out
    assert f"step 2 on {url} cannot be restored (ChecksumError" in caplog.text, caplog.text
    assert sorted(store.list()) == [_name(1), _name(1) + MARKER, _name(2), _name(2) + MARKER]
    with Checkpointer(tmp_path / "c", remote=url, keep_remote=1, save_options=OPTS) as ck:
        with pytest.warns(UserWarning):
            r = ck.restore()
        assert r.step == 1
        assert_same(r.state, state_for(1, n=N))
        ck.save(3, state_for(3, n=N))  # a new step, verified as it is uploaded: now the older ones go
        ck.wait(uploads=True, timeout=60)
    assert sorted(store.list()) == [_name(3), _name(3) + MARKER]


def test_remote_retention_reads_the_newest_step_in_full_once(tmp_path, s3_env, monkeypatch):
    import gdsckpt.manager.remote.tier as rt
    import gdsckpt.manager.remote.verify as sv
    url = f"s3://{s3_env.new_bucket()}/r"
    _upload_steps(tmp_path / "a", url, (1, 2, 3))
    calls = []
    real = sv.verify_object
    def counted(store, name, **kw):
        calls.append(name)
        return real(store, name, **kw)

    for module in (rt, sv):  # the upload's read-back; retention's check
        monkeypatch.setattr(module, "verify_object", counted)
    with Checkpointer(tmp_path / "b", remote=url, keep_remote=2, upload=False) as ck:
        assert ck.prune(dry_run=True)["remote"] == [1]
        assert ck.prune(dry_run=True)["remote"] == [1]
        assert ck.prune()["remote"] == [1]
    assert calls == [_name(3)]  # the candidate only, and once: its identity has not changed
    with Checkpointer(tmp_path / "c", remote=url, keep_remote=1, save_options=OPTS) as ck:
        ck.save(4, state_for(4, n=N))
        ck.wait(uploads=True, timeout=60)
    assert calls == [_name(3), _name(4)]  # the upload's read-back; retention reads nothing again
    assert sorted(open_store(url).list()) == [_name(4), _name(4) + MARKER]


# ---------------------------------------------------------------- finding 13: orphan objects


def test_orphan_objects_are_removed_by_the_next_managers_retention(tmp_path, s3_env):
    url = f"s3://{s3_env.new_bucket()}/o"
    d = tmp_path / "run"
    _upload_steps(d, url, (1, 2))
    store = open_store(url)
    store.delete(_name(1) + MARKER)  # a remote prune killed after the marker's removal
    store.put_file(d / _name(2), _name(5))  # an upload killed before its marker
    store.put_bytes("notes.txt", b"the user's")  # not a step's object: never touched
    store.put_bytes("step_00000007", b"not this layout's")
    with Checkpointer(d, remote=url) as ck:  # restarted: uploads (or finds uploaded) its newest step, then retention
        ck.wait(uploads=True, timeout=60)
    assert sorted(store.list()) == ["notes.txt", _name(2), _name(2) + MARKER, "step_00000007"]


def test_a_step_in_upload_is_not_an_orphan(tmp_path, s3_env, monkeypatch):
    import threading
    from gdsckpt.stores.s3 import S3Store
    url = f"s3://{s3_env.new_bucket()}/o"
    uploaded, gate = threading.Event(), threading.Event()
    real = S3Store.put_file

    def put_then_hold(self, path, name):
        out = real(self, path, name)  # the object is on the store, its marker not yet
        uploaded.set()
        gate.wait(60)
        return out

    monkeypatch.setattr(S3Store, "put_file", put_then_hold)
    store = open_store(url)
    with Checkpointer(tmp_path, remote=url, keep_remote=1, save_options=OPTS) as ck:
        ck.save(1, state_for(1, n=N))
        assert uploaded.wait(30)
        ck.prune()  # remote retention from the caller's thread while step 1 is in upload
        assert _name(1) in store.list()
        gate.set()
        ck.wait(uploads=True, timeout=60)
        assert ck.status()["uploaded"] == [1]
    assert sorted(store.list()) == [_name(1), _name(1) + MARKER]


# ---------------------------------------------------------------- finding 12: download temporaries

_KILLED_DOWNLOAD_CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[3]); sys.path.insert(0, sys.argv[4])
from gdsckpt.manager.checkpointer import Checkpointer
from gdsckpt.stores.obstore_store import ObstoreStore
real = ObstoreStore.read
def held_read(self, name, offset, length):
    data = real(self, name, offset, length)
    if offset > 0 and length >= 1 << 20:  # the download's second part (not the footer's check)
        print("downloading", flush=True)
        time.sleep(60)
    return data
ObstoreStore.read = held_read
ck = Checkpointer(sys.argv[1], remote=sys.argv[2], remote_options={"part_bytes": 5 << 20, "concurrency": 1})
ck.restore()
"""


def _killed_download(tmp_path, url) -> Path:
    import os
    import signal
    import subprocess
    import sys
    tests = Path(__file__).parents[1]
    d = tmp_path / "restore"
    p = subprocess.Popen([sys.executable, "-c", _KILLED_DOWNLOAD_CHILD, str(d), url, str(tests.parent), str(tests)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        line = p.stdout.readline()
        assert line.startswith("downloading"), p.stderr.read()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    return d


def test_a_download_killed_midway_leaves_a_temporary_that_clean_removes(tmp_path, s3_env, capsys):
    from gdsckpt.cli import main
    from gdsckpt.core.storage import TMP_MARK
    url = f"s3://{s3_env.new_bucket()}/k"
    with Checkpointer(tmp_path / "seed", remote=url, save_options=OPTS) as ck:
        ck.save(1, state_for(1, n=3_000_000))  # several 5 MiB parts
        ck.wait(uploads=True, timeout=60)
    d = _killed_download(tmp_path, url)
    left = [p for p in d.iterdir() if p.name != ".gdsckpt-manager.lock"]
    assert len(left) == 1 and TMP_MARK in left[0].name and left[0].name.startswith("."), left
    assert main(["clean", str(d), "--yes"]) == 0
    assert f"removing {left[0]}" in capsys.readouterr().out and not left[0].exists()


def test_a_download_killed_midway_leaves_nothing_after_the_next_manager(tmp_path, s3_env):
    url = f"s3://{s3_env.new_bucket()}/k"
    with Checkpointer(tmp_path / "seed", remote=url, save_options=OPTS) as ck:
        ck.save(1, state_for(1, n=3_000_000))
        ck.wait(uploads=True, timeout=60)
    d = _killed_download(tmp_path, url)
    Checkpointer(d).close()
    assert [p.name for p in d.iterdir()] == [".gdsckpt-manager.lock"]


# ---------------------------------------------------------------- session 25's audit of the S3 tier


def test_a_step_saved_again_whose_upload_fails_is_not_counted_as_uploaded(tmp_path, s3_env, monkeypatch):
    """A new node restores step 4, saves 5 (uploaded in place of the store's 5) and 6 while the store
    is down: close() names step 6 as never uploaded. The store's old step 6 (another run's) counted
    as this one's: close() returned, status() said uploaded, and a later restore took the old 6."""
    from gdsckpt.manager.remote import tier as remote_tier
    from gdsckpt.errors import RemoteUnavailableError
    url = f"s3://{s3_env.new_bucket()}/r"
    _upload_steps(tmp_path / "a", url, (4, 5, 6), save_options=RAW)
    shutil.rmtree(tmp_path / "a")
    ck = Checkpointer(tmp_path / "b", remote=url, keep=1, save_options=RAW)
    ck.restore(state_for(0, n=N), step=4)
    ck.save(5, state_for(50, n=N))
    ck.wait(uploads=True, timeout=60)
    assert ck.status()["uploaded"] == [4, 5, 6]

    def down(*a, **k):
        raise RemoteUnavailableError("the store is down (test)", bucket="b", code="Unavailable")
    monkeypatch.setattr(remote_tier, "load_marker", down)
    monkeypatch.setattr(ck.remote.store, "put_file", down)
    ck.save(6, state_for(60, n=N))
    ck.wait(uploads=True, timeout=5)
    st = ck.status()
    assert 6 not in st["uploaded"] and st["queued"] == [6], st
    assert ck.layout.local_steps() == [6]
    with pytest.raises(gdsckpt.UploadIncompleteError, match="step 6 never reached"):
        ck.close(timeout=2)


def test_a_replaced_object_of_the_newest_local_step_is_uploaded_again_at_restart(tmp_path, s3_env, caplog):
    """Step 2's object on the store replaced by another valid checkpoint of its size (its marker
    as it was): a restarted manager's uploader checks the objects too, not only the marker, and
    uploads the local step again, so the store holds an intact step 2 before keep=1 lets it go
    here. It used to count the store's step 2 as uploaded and skip it."""
    url = f"s3://{s3_env.new_bucket()}/x"
    _upload_steps(tmp_path / "a", url, (1, 2), save_options=RAW)
    store = open_store(url)
    other = tmp_path / "other.gdsckpt"
    gdsckpt.save(state_for(9, n=N), other, **RAW)
    assert other.stat().st_size == store.size(_name(2))
    store.put_file(other, _name(2))
    with caplog.at_level(logging.WARNING, logger="gdsckpt.manager.checkpointer"):
        with Checkpointer(tmp_path / "a", remote=url, keep=1, keep_remote=1, save_options=RAW) as ck:
            ck.wait(uploads=True, timeout=60)
            assert ck.status()["uploads"] == 1, ck.status()
    assert "an object was replaced since its upload" in caplog.text, caplog.text
    with Checkpointer(tmp_path / "c", remote=url) as ck:
        r = ck.restore(step=2)
        assert r.source == "remote" and r.skipped == []
        assert_same(r.state, state_for(2, n=N))


def test_a_marker_the_store_fails_to_give_is_not_taken_for_a_step_that_is_gone(tmp_path, s3_env, monkeypatch,
                                                                                caplog):
    """The store errs on step 6's marker (not 'not found'): steps() and restore() do not fall back
    to step 5 without a word; the store's failure is said, and restore() finds nothing it may
    take. A marker that is really gone still only drops its step."""
    from gdsckpt.manager.remote import marker as upload_marker
    from gdsckpt.errors import RemoteUnavailableError
    url = f"s3://{s3_env.new_bucket()}/m"
    _upload_steps(tmp_path / "a", url, (5, 6))
    shutil.rmtree(tmp_path / "a")
    load = upload_marker.load_marker

    def erring(store, name):
        if name.startswith(_name(6)):
            raise RemoteUnavailableError("503 Slow Down (test)", bucket="b", code="SlowDown")
        return load(store, name)
    monkeypatch.setattr(upload_marker, "load_marker", erring)
    with caplog.at_level(logging.WARNING, logger="gdsckpt.manager.checkpointer"):
        with Checkpointer(tmp_path / "b", remote=url) as ck:
            with pytest.raises(NoCheckpointError):
                ck.restore()  # step 5 was restored, silently
    assert f"cannot list {url}: 503 Slow Down" in caplog.text, caplog.text
    monkeypatch.setattr(upload_marker, "load_marker", load)
    open_store(url).delete(_name(6) + MARKER)
    with Checkpointer(tmp_path / "c", remote=url) as ck:
        assert ck.steps() == [5]
