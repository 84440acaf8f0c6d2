"""One Checkpointer per directory: an flock on DIR/.gdsckpt-manager.lock, naming its holder.

A directory that cannot be written (read-only mount, another user's) has no lock to take:
try_lock() says so, and its manager works read-only. A lock whose named holder is dead on this
host is held by a process it forked (a DataLoader worker, say), which inherited the open file:
the error names both."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

from gdsckpt.errors import CheckpointLockedError
from .storage import process_alive

LOCK_NAME = ".gdsckpt-manager.lock"
# What opening the lock file for writing fails with when the directory cannot be written.
_READ_ONLY = (errno.EACCES, errno.EPERM, errno.EROFS)


class DirectoryLock:
    """Held from construction until release(); a second holder, in this process or another,
    gets CheckpointLockedError naming the first. PermissionError (or EROFS) if the directory
    cannot be written."""

    def __init__(self, directory: Path):
        self.path = directory / LOCK_NAME
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            raise CheckpointLockedError(f"{str(directory)!r} is in use by another Checkpointer ({holder}"
                                        f"{_stale(holder, self.path)}); one manager per directory") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


def try_lock(directory: Path) -> DirectoryLock | None:
    """The directory's lock, or None if the directory cannot be written (nothing to guard)."""
    try:
        return DirectoryLock(directory)
    except OSError as e:
        if e.errno in _READ_ONLY:
            return None
        raise


def _stale(holder: str, path: Path) -> str:
    """Why a lock whose holder ("pid N on HOST") is dead on this host is still held, or ""."""
    words = holder.split()
    if len(words) != 4 or words[0] != "pid" or words[2] != "on" or words[3] != socket.gethostname():
        return ""
    if not words[1].isdigit() or process_alive(int(words[1])):
        return ""
    holders = _processes_holding(path)
    return (f", which is no longer running: a stale lock, still held by a process it started that inherited "
            f"the open lock file ({', '.join(f'pid {p}' for p in holders) if holders else 'not found'}); "
            "end that process")


def _processes_holding(path: Path) -> list[int]:
    """The pids of this host that have `path` open (those whose /proc we may read)."""
    want = os.path.realpath(path)
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                if os.readlink(fd.path) == want:
                    out.append(int(entry.name))
                    break
        except OSError:
            continue
    return sorted(out)
