"""Write failures and concurrent writers (issue 5).

A full disk or an I/O error during save gives a clear OSError naming the checkpoint, removes the
temporary file and leaves the previous checkpoint intact: injected with a patched os.pwrite /
os.fsync / os.replace, and for real with RLIMIT_FSIZE in a subprocess (SIGXFSZ ignored, so the
write fails with EFBIG as it would with ENOSPC). Two writers to one path, as threads and as
processes, both complete; a reader running alongside only ever sees a whole checkpoint.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import gdsckpt
from gdsckpt.core.storage import TMP_MARK
from conftest import assert_same
from ckpt_tools import make_state

TESTS = Path(__file__).parents[1]
ROOT = TESTS.parent
CHUNK = 128 << 10


def _temps(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if TMP_MARK in p.name)


@pytest.fixture(scope="module")
def states():
    return {k: make_state(k, 1.0) for k in range(3)}


@pytest.fixture
def old(tmp_path, states):
    p = tmp_path / "ckpt.gdsckpt"
    gdsckpt.save(states[0], p, chunk_bytes=CHUNK)
    return p


def _written_by_save(states, tmp_path, monkeypatch) -> int:
    """Bytes a save of states[1] writes through os.pwrite (less than the file size: the padding
    between 4 KiB aligned records is never written)."""
    real, n = os.pwrite, [0]

    def counting(fd, data, offset):
        k = real(fd, data, offset)
        n[0] += k
        return k

    monkeypatch.setattr(os, "pwrite", counting)
    p = tmp_path / "probe.gdsckpt"
    gdsckpt.save(states[1], p, chunk_bytes=CHUNK)
    monkeypatch.undo()
    p.unlink()
    return n[0]


def _size_of(states, tmp_path) -> int:
    p = tmp_path / "probe.gdsckpt"
    gdsckpt.save(states[1], p, chunk_bytes=CHUNK)
    n = p.stat().st_size
    p.unlink()
    return n


# ---------------------------------------------------------------- injected failures


def _disk_that_fills_after(monkeypatch, budget: int, err=errno.ENOSPC):
    """os.pwrite writes until `budget` bytes are used (a short write at the boundary, as a
    real full disk does), then fails with `err`. Through an O_DIRECT descriptor the short write
    is whole 4 KiB blocks, as on a real disk: a cut at any byte would be EINVAL, and the backend
    would rewrite that chunk buffered without its padding, needing fewer bytes than measured
    (the ring writes the index while the last chunk may still wait for the lock)."""
    real = os.pwrite
    used = [0]
    lock = threading.Lock()

    def pwrite(fd, data, offset):
        with lock:
            room = budget - used[0]
            if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
                room -= room % 4096
            if room <= 0:
                raise OSError(err, os.strerror(err))
            n = real(fd, memoryview(data)[:room], offset)
            used[0] += n
            return n

    monkeypatch.setattr(os, "pwrite", pwrite)


@pytest.mark.parametrize("where", ["header", "first-chunk", "mid-chunks", "last-chunk", "index", "footer"])
def test_full_disk_during_save(tmp_path, states, old, monkeypatch, where):
    size = _written_by_save(states, tmp_path, monkeypatch)
    budget = {"header": 100, "first-chunk": 4096 + 1000, "mid-chunks": size // 2, "last-chunk": size - 20_000,
              "index": size - 600, "footer": size - 10}[where]
    _disk_that_fills_after(monkeypatch, budget)
    with pytest.raises(OSError) as ei:
        gdsckpt.save(states[1], old, chunk_bytes=CHUNK)
    assert ei.value.errno == errno.ENOSPC
    assert str(old) in str(ei.value) and "No space left" in str(ei.value), str(ei.value)
    monkeypatch.undo()
    assert _temps(old.parent) == [], "the temporary was left behind"
    assert_same(gdsckpt.load(old), states[0])


@pytest.mark.parametrize("call,err", [("fsync", errno.EIO), ("replace", errno.EACCES), ("pwrite", errno.EIO)])
def test_io_error_during_save(tmp_path, states, old, monkeypatch, call, err):
    def fail(*a, **k):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, call, fail)
    with pytest.raises(OSError) as ei:
        gdsckpt.save(states[1], old, chunk_bytes=CHUNK)
    assert ei.value.errno == err and str(old) in str(ei.value), str(ei.value)
    monkeypatch.undo()
    assert _temps(old.parent) == []
    assert_same(gdsckpt.load(old), states[0])


def test_directory_fsync_failure_after_rename(tmp_path, states, old, monkeypatch):
    """The rename happened, the directory fsync failed: an error, and the file at the path is a
    whole checkpoint (the new one), with no temporary left."""
    import gdsckpt.core.storage as storage

    def fail(d):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(storage, "fsync_dir", fail)
    with pytest.raises(OSError):
        gdsckpt.save(states[1], old, chunk_bytes=CHUNK)
    monkeypatch.undo()
    assert _temps(old.parent) == []
    assert_same(gdsckpt.load(old), states[1])


def test_failure_in_the_codec_removes_the_temporary(tmp_path, states, old, monkeypatch):
    from gdsckpt.engine.backend import CpuBackend

    calls = [0]
    real = CpuBackend.encode

    def encode(self, *a):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("codec exploded")
        return real(self, *a)

    monkeypatch.setattr(CpuBackend, "encode", encode)
    with pytest.raises(RuntimeError, match="codec exploded"):
        gdsckpt.save(states[1], old, chunk_bytes=CHUNK)
    assert _temps(old.parent) == []
    assert_same(gdsckpt.load(old), states[0])


_FSIZE_CHILD = r"""
import json, os, resource, signal, sys
sys.path.insert(0, sys.argv[3])
import gdsckpt
from ckpt_tools import make_state
path, limits = sys.argv[1], json.loads(sys.argv[2])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
_, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
new, out = make_state(1, 1.0), []
for lim in limits:
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim, hard))
    try:
        gdsckpt.save(new, path, chunk_bytes=128 << 10)
        r = {"limit": lim, "ok": True}
    except Exception as e:
        r = {"limit": lim, "type": type(e).__name__, "errno": getattr(e, "errno", None), "msg": str(e)}
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    r["left"] = sorted(os.listdir(os.path.dirname(path)))
    out.append(r)
print(json.dumps(out))
"""


def test_file_size_limit_in_a_subprocess(tmp_path, states, old):
    """A real kernel-enforced limit (RLIMIT_FSIZE): the write fails part-way with EFBIG."""
    size = _size_of(states, tmp_path)
    limits = [100, 4096, 4096 + 5000, size // 3, size - 30_000, size - 500, size - 1]
    r = subprocess.run([sys.executable, "-c", _FSIZE_CHILD, str(old), json.dumps(limits), str(TESTS)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout.splitlines()[-1])
    for res in results:
        assert res.get("type") == "OSError" and res["errno"] == errno.EFBIG, res
        assert str(old) in res["msg"], res
        assert res["left"] == [old.name], res
    assert_same(gdsckpt.load(old), states[0])


# ---------------------------------------------------------------- concurrent writers


def _reader(path, states, stop: threading.Event, seen: list, errors: list):
    while not stop.is_set():
        try:
            out = gdsckpt.load(path)
            assert_same(out, states[out["id"]])
            seen.append(out["id"])
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
            return


def test_two_writer_threads_and_a_reader(tmp_path, states, old):
    stop, seen, errors = threading.Event(), [], []
    rd = threading.Thread(target=_reader, args=(old, states, stop, seen, errors))
    rd.start()

    def writer(k):
        try:
            for _ in range(6):
                gdsckpt.save(states[k], old, chunk_bytes=CHUNK)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ws = [threading.Thread(target=writer, args=(k,)) for k in (1, 2)]
    for w in ws:
        w.start()
    for w in ws:
        w.join()
    time.sleep(0.05)
    stop.set()
    rd.join()
    assert not errors, errors
    assert len(seen) >= 3, seen
    assert _temps(old.parent) == []
    out = gdsckpt.load(old)
    assert out["id"] in (1, 2)
    assert_same(out, states[out["id"]])


_WRITER_CHILD = r"""
import sys
sys.path.insert(0, sys.argv[3])
import gdsckpt
from ckpt_tools import make_state
path, k = sys.argv[1], int(sys.argv[2])
state = make_state(k, 1.0)
print("ready", flush=True)
sys.stdin.readline()
for _ in range(15):
    gdsckpt.save(state, path, chunk_bytes=128 << 10)
print("done", flush=True)
"""


def test_two_writer_processes_and_a_reader(tmp_path, states, old):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER_CHILD, str(old), str(k), str(TESTS)], cwd=ROOT,
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for k in (1, 2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        seen, errors = [], []
        while any(p.poll() is None for p in procs) and not errors:
            try:
                out = gdsckpt.load(old)
                assert_same(out, states[out["id"]])
                seen.append(out["id"])
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert not errors, errors
    assert all(p.returncode == 0 for p in procs), outs
    assert len(seen) >= 3 and set(seen) & {1, 2}, seen
    assert _temps(old.parent) == []
    out = gdsckpt.load(old)
    assert_same(out, states[out["id"]])
