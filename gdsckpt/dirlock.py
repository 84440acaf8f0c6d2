"""One Checkpointer per directory: an flock on DIR/.gdsckpt-manager.lock, naming its holder."""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from .errors import CheckpointLockedError

LOCK_NAME = ".gdsckpt-manager.lock"


class DirectoryLock:
    """Held from construction until release(); a second holder, in this process or another,
    gets CheckpointLockedError naming the first."""

    def __init__(self, directory: Path):
        self.path = directory / LOCK_NAME
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            raise CheckpointLockedError(f"{str(directory)!r} is in use by another Checkpointer ({holder}); one "
                                        "manager per directory") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1
