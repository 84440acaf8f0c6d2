"""gdsckpt/core/storage.py: the temporary's name, which temporaries are stale, the one atomic commit,
and O_DIRECT with its fallback.

`stale_temporaries` (what `gdsckpt clean` removes, issue 20 finding 11) lists only files named
exactly as gdsckpt names its temporaries, and of those only the ones no writer will finish: a
user's `notes.gdsckpt-tmp.txt` never, another host's in-flight temporary never (its pid means
nothing here), this host's once its writer is gone, anyone's once untouched for
defaults.TEMP_STALE_AGE_S.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import gdsckpt
from gdsckpt.core import storage
from gdsckpt.core.defaults import TEMP_STALE_AGE_S
from gdsckpt.core.storage import HOST_ID, TMP_MARK, AtomicFile, atomic_file, stale_temporaries, temp_path_for

ROOT = Path(__file__).parents[2]
OLD = time.time() - TEMP_STALE_AGE_S - 60  # an mtime past the age threshold


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped) on this host."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    try:
        os.kill(p.pid, 0)
    except ProcessLookupError:
        return p.pid
    pytest.skip("the pid was reused at once")


def _touch(path: Path, mtime: float | None = None) -> Path:
    path.write_bytes(b"x" * 100)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def test_temporaries_are_hidden_beside_the_target_and_name_pid_and_host(tmp_path):
    target = tmp_path / "step_00000001.gdsckpt"
    a, b = temp_path_for(target), temp_path_for(target)
    assert a != b and a.parent == tmp_path
    m = re.fullmatch(r"\.step_00000001\.gdsckpt\.gdsckpt-tmp\.(\d+)\.([0-9a-f]{8})\.([0-9a-f]{8})", a.name)
    assert m and int(m[1]) == os.getpid() and m[2] == HOST_ID
    assert re.fullmatch(r"[0-9a-f]{8}", HOST_ID)


def test_stale_means_this_hosts_dead_writer_or_too_old(tmp_path, dead_pid):
    other = "0123abcd" if HOST_ID != "0123abcd" else "89abcdef"
    stale = [
        _touch(tmp_path / f".a.gdsckpt{TMP_MARK}{dead_pid}.{HOST_ID}.00000001"),  # this host, writer gone
        _touch(tmp_path / f".b.gdsckpt{TMP_MARK}{dead_pid}.{other}.00000002", OLD),  # another host's, untouched a day
        _touch(tmp_path / f".c.gdsckpt{TMP_MARK}{os.getpid()}.{HOST_ID}.00000003", OLD),  # alive, but untouched a day
        _touch(tmp_path / f".d.gdsckpt{TMP_MARK}{dead_pid}.0000000a", OLD),  # an earlier gdsckpt's name (no host), old
    ]
    kept = [
        _touch(tmp_path / f".e.gdsckpt{TMP_MARK}{os.getpid()}.{HOST_ID}.00000004"),  # this host, writer alive
        _touch(tmp_path / f".f.gdsckpt{TMP_MARK}{dead_pid}.{other}.00000005"),  # another host's, being written
        _touch(tmp_path / f".g.gdsckpt{TMP_MARK}{dead_pid}.0000000b"),  # no host: only the age can tell
        _touch(tmp_path / "step_00000001.gdsckpt"),
    ]
    assert stale_temporaries(tmp_path) == sorted(stale)
    assert all(p.exists() for p in stale + kept)  # listing removes nothing


def test_only_the_exact_temporary_pattern_is_ever_stale(tmp_path, dead_pid):
    """Names that merely contain the mark are the user's, however old; so are directories and
    symlinks named like a temporary."""
    names = ["notes.gdsckpt-tmp.txt", f"notes{TMP_MARK}{dead_pid}.{HOST_ID}.00000001",  # not hidden
             f".x{TMP_MARK}notapid.0", f".x{TMP_MARK}{dead_pid}.{HOST_ID}.00000001.bak",
             f".x{TMP_MARK}{dead_pid}.{HOST_ID}.0000000G", f".x{TMP_MARK}{dead_pid}.{HOST_ID.upper()}.ABCDEF01",
             f"{TMP_MARK}{dead_pid}.{HOST_ID}.00000001", f".x{TMP_MARK}{dead_pid}.{HOST_ID[:7]}"]
    for n in names:
        _touch(tmp_path / n, OLD)
    d = tmp_path / f".d{TMP_MARK}{dead_pid}.{HOST_ID}.00000002"
    d.mkdir()
    link = tmp_path / f".l{TMP_MARK}{dead_pid}.{HOST_ID}.00000003"
    link.symlink_to(tmp_path / "notes.gdsckpt-tmp.txt")
    os.utime(link, (OLD, OLD), follow_symlinks=False)
    assert stale_temporaries(tmp_path) == []


def test_a_killed_save_leaves_a_temporary_that_is_stale(tmp_path):
    """A real save SIGKILLed before its commit: its temporary is found, nothing else."""
    target = tmp_path / "x.gdsckpt"
    gdsckpt.save({"w": torch.ones(4)}, target)
    child = ("import os, sys, torch, gdsckpt.core.storage as s\n"
             "f = s.AtomicFile(s.Path(sys.argv[1])); f.create(); f.adopt_mode()\n"
             "os.write(f.fd, b'partial'); os.kill(os.getpid(), 9)\n")
    r = subprocess.run([sys.executable, "-c", child, str(target)], cwd=ROOT, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == -9
    temps = [p for p in tmp_path.iterdir() if TMP_MARK in p.name]
    assert len(temps) == 1 and stale_temporaries(tmp_path) == temps
    assert torch.equal(gdsckpt.load(target)["w"], torch.ones(4))


# ---------------------------------------------------------------- the atomic commit


def test_atomic_file_replaces_whole_and_keeps_the_mode(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    os.chmod(target, 0o600)
    with atomic_file(target) as f:
        storage.pwrite_all(f.fd, b"new contents", 0)
        assert target.read_bytes() == b"old" and f.tmp.exists()
    assert target.read_bytes() == b"new contents"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sorted(os.listdir(tmp_path)) == ["f.bin"]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_atomic_file_leaves_the_old_file_and_no_temporary_on_any_error(tmp_path, error):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    with pytest.raises(error):
        with atomic_file(target) as f:
            storage.pwrite_all(f.fd, b"half", 0)
            raise error("stopped mid-write")
    assert target.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["f.bin"]


def test_atomic_file_failures_of_fsync_and_rename(tmp_path, monkeypatch):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    for call in ("fsync", "replace"):
        def fail(*a, **kw):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        monkeypatch.setattr(os, call, fail)
        with pytest.raises(OSError):
            with atomic_file(target) as f:
                storage.pwrite_all(f.fd, b"new", 0)
        monkeypatch.undo()
        assert target.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["f.bin"], call


def test_a_name_another_writer_holds_is_never_removed(tmp_path, monkeypatch):
    target = tmp_path / "f.bin"
    theirs = _touch(tmp_path / f".f.bin{TMP_MARK}1.{HOST_ID}.00000000")
    monkeypatch.setattr(storage, "temp_path_for", lambda path: theirs)
    f = AtomicFile(target)
    with pytest.raises(FileExistsError):
        f.create()
    f.abort()
    assert theirs.read_bytes() == b"x" * 100


# ---------------------------------------------------------------- O_DIRECT


def test_pwrite_direct_falls_back_on_einval_only(tmp_path, monkeypatch):
    p = tmp_path / "d.bin"
    fd = os.open(p, os.O_WRONLY | os.O_CREAT)
    try:
        def einval(*a):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

        def eio(*a):
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(os, "pwritev", einval)
        monkeypatch.setattr(os, "pwrite", einval)
        assert storage.pwrite_direct(fd, [memoryview(bytes(4096))], 0) is False
        assert storage.pwrite_direct(fd, bytes(4096), 0) is False
        monkeypatch.setattr(os, "pwritev", eio)
        with pytest.raises(OSError) as info:
            storage.pwrite_direct(fd, [memoryview(bytes(4096))], 0)
        assert info.value.errno == errno.EIO
        monkeypatch.undo()
        assert storage.pwrite_direct(fd, [memoryview(b"a" * 4096), memoryview(b"b" * 4096)], 0) is True
    finally:
        os.close(fd)
    assert p.read_bytes() == b"a" * 4096 + b"b" * 4096


def test_open_direct_is_minus_one_where_refused(tmp_path, monkeypatch):
    p = _touch(tmp_path / "d.bin")
    real = os.open

    def refusing(path, flags, *a):  # tmpfs before Linux 6.6, and other file systems without O_DIRECT
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(path, flags, *a)

    fd = storage.open_direct(p)
    assert fd == -1 or fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
    if fd >= 0:
        os.close(fd)
    monkeypatch.setattr(os, "open", refusing)
    assert storage.open_direct(p) == -1


def test_a_reused_pid_does_not_keep_a_dead_writers_temporary(tmp_path):
    """The pid in a temporary's name may belong to a newer process by the time anyone looks (pid
    reuse under load): a process that started after the file was last written is not its writer."""
    from gdsckpt.core.storage import HOST_ID, TMP_MARK, stale_temporaries
    mine = tmp_path / f".c.gdsckpt{TMP_MARK}{os.getpid()}.{HOST_ID}.0badcafe"
    mine.write_bytes(b"x")
    assert stale_temporaries(tmp_path) == []  # this process wrote it and runs
    hour_ago = time.time() - 3600
    os.utime(mine, (hour_ago, hour_ago))  # written before this process started: another writer's
    assert stale_temporaries(tmp_path) == [mine]
