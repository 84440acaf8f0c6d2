"""The Checkpointer's retention after each commit and upload, on a thread of its own.

Retention checks the local steps (footer and index, and every chunk of a step about to be the
only intact one: a full read) and deletes those the policy lets go. On a file system mounted
with `discard` an unlink trims the blocks before it returns (1.0 s for a 4 GB step on the H100
machines' ext4). Run where the commit or upload ends (the save's writer thread, the uploader's,
the memory tier's), it delays the next write or upload by as much; here it delays nothing.
Requests coalesce: one run that has not started yet serves every request made before it starts.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

log = logging.getLogger("gdsckpt.manager.checkpointer")


class RetentionThread:
    def __init__(self, retain: Callable[[], None]):
        self._retain = retain
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gdsckpt-retention")
        self._lock = threading.Lock()
        self._last: Future | None = None  # runs go in order: the last one done, all are
        self._closed = False

    def request(self) -> None:
        """Run retention soon: after this call, a run starts that sees everything committed before it."""
        with self._lock:
            last = self._last
            if last is not None and not last.running() and not last.done():
                return  # not started yet: it will see this request's commit
            if self._closed:  # a commit after the manager closed: the next manager's retention sees it
                return
            self._last = self._pool.submit(self._run)

    def _run(self) -> None:
        try:
            self._retain()
        except Exception as e:  # a failed deletion must not end the thread; the next run tries again
            log.warning("gdsckpt: retention: %s: %s", type(e).__name__, e)

    def wait(self) -> None:
        with self._lock:
            last = self._last
        if last is not None:
            last.result()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.wait()
        self._pool.shutdown(wait=True)
