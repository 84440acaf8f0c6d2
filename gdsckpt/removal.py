"""Freeing retired steps' space on a thread of its own.

Retention and rollback first retire a step (StepLayout.retire: renamed out of the step names at
once, so it no longer counts and a kill leaves a leftover the next manager removes); the bytes go
here. On a file system mounted with `discard` an unlink trims the blocks before it returns (1.0 s
for a 4 GB step on the H100 machines' ext4): done on the save's writer thread, the uploader's or
the memory tier's, it would delay the next write or upload by as much."""

from __future__ import annotations

import logging
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from pathlib import Path

log = logging.getLogger("gdsckpt.manager")


def remove(path: Path) -> None:
    """Remove a retired step or a leftover: a file, or a directory and what it holds."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class Removals:
    """Paths removed in order, one at a time, off the caller's thread; wait() until all are gone."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gdsckpt-remove")
        self._lock = threading.Lock()
        self._pending: list[Future] = []

    def submit(self, path: Path) -> None:
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(self._pool.submit(self._remove, path))

    @staticmethod
    def _remove(path: Path) -> None:
        try:
            remove(path)
        except OSError as e:  # the step no longer counts; the next manager removes what is left
            log.warning("gdsckpt: could not remove %s: %s", path, e)

    def wait(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        wait_all(pending)

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)
