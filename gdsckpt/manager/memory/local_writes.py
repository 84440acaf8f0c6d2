"""The memory tier's writes to the local directory (Checkpointer(memory=True, every_local=N)):
a memory copy of every N-th step is written to its step file from shared memory
(memory_snapshot.local_write: the background writer, fsync, atomic rename).

Throughput-aware: one write at a time, and at most one step waiting behind it. A step that
becomes due while another waits takes its place: the waiting one is coalesced (never written;
its memory copy stays while the tier keeps it), because the disk cannot keep up with the saves,
and queueing would only make every later step reach the disk later. The disk's throughput is
measured on every write (bytes / seconds from its start to its commit), and status() says what
was coalesced and why, with the rates and intervals that made it so.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

from .snapshot import local_write
from .tier import MemoryTier

log = logging.getLogger("gdsckpt.manager.checkpointer")


class LocalWrites:
    """Writes `tier`'s copies to `path_of(step)`; `on_written(step)` runs (on the writer's thread)
    once a step is committed in the directory."""

    def __init__(self, tier: MemoryTier, path_of: Callable[[int], Path], on_written: Callable[[int], None]):
        self.tier, self.path_of, self.on_written = tier, path_of, on_written
        self._cond = threading.Condition(threading.RLock())
        self._in_flight: dict | None = None  # {"step", "bytes", "started"}
        self._waiting: int | None = None
        self._last_due: float | None = None
        self._interval: float | None = None  # seconds between the last two steps due
        self.written: deque = deque(maxlen=100)  # the last steps written
        self.coalesced: deque = deque(maxlen=100)  # the last steps coalesced, and why
        self.coalesced_count = 0
        self.errors: deque = deque(maxlen=10)
        self._bytes = 0
        self._seconds = 0.0
        self.last: dict | None = None
        self._watched: dict[int, Future] = {}

    def when_written(self, step: int) -> Future:
        """A Future of `step`'s local write: its figures ({"step", "bytes", "seconds", "MBps"})
        once committed in the directory, None if it was coalesced, or the write's error. Ask
        before the step is due (its save_async returned) to be sure to see it."""
        with self._cond:
            return self._watched.setdefault(step, Future())

    def unwatch(self, step: int) -> None:
        """Forget `step`'s Future from when_written (a save that went to the directory another way)."""
        with self._cond:
            self._watched.pop(step, None)

    def _settle(self, step: int, result=None, error: BaseException | None = None) -> None:
        fut = self._watched.pop(step, None)
        if fut is not None:
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def submit(self, step: int) -> None:
        """`step` (committed in the tier) is due on disk: written now, or after the write in
        flight (replacing a step that was waiting for it)."""
        now = time.monotonic()
        with self._cond:
            if self._last_due is not None:
                self._interval = now - self._last_due
            self._last_due = now
            try:
                self.tier.hold(step)  # its copy stays until it is written or coalesced
            except KeyError as e:
                self._failed(step, e)
                self._settle(step, error=e)
                return
            if self._in_flight is None:
                self._start(step)
                return
            if self._waiting is not None:
                old, self._waiting = self._waiting, None
                self.coalesced.append({"step": old, "by": step, "why": self._why(old, step, now)})
                self.coalesced_count += 1
                self._settle(old)
                log.info("gdsckpt: local write of step %d coalesced into step %d's: %s", old, step,
                         self.coalesced[-1]["why"])
                self.tier.release(old)
            self._waiting = step

    def _why(self, old: int, new: int, now: float) -> str:
        f = self._in_flight
        rate = self.mbps()
        est = f"; at the {rate:.0f} MB/s measured so far a step takes {f['bytes'] / 1e6 / rate:.1f} s" if rate else ""
        every = f" and steps are due every {self._interval:.1f} s" if self._interval is not None else ""
        return (f"the disk is behind: step {f['step']}'s write ({f['bytes'] / 1e6:.0f} MB) has run "
                f"{now - f['started']:.1f} s{est}{every}; step {old} waited for it and step {new} is newer")

    def _start(self, step: int) -> None:
        try:
            nbytes = self.tier.copy(step).nbytes
            fut = local_write(self.tier, step, self.path_of(step))
        except Exception as e:  # noqa: BLE001 - its copy was dropped, a bad path: the next step goes on
            self._failed(step, e)
            self.tier.release(step)
            self._settle(step, error=e)
            return
        self._in_flight = {"step": step, "bytes": nbytes, "started": time.monotonic()}
        fut.add_done_callback(lambda f: self._finished(step, f))

    def _finished(self, step: int, fut) -> None:
        err = fut.exception()
        record = None
        with self._cond:
            f, self._in_flight = self._in_flight, None
            secs = time.monotonic() - f["started"]
            if err is None:
                self.written.append(step)
                self._bytes += f["bytes"]
                self._seconds += secs
                self.last = record = {"step": step, "bytes": f["bytes"], "seconds": secs,
                                      "MBps": f["bytes"] / secs / 1e6 if secs else 0.0}
            else:
                self._failed(step, err)
            self.tier.release(step)
            nxt, self._waiting = self._waiting, None
            if nxt is not None:
                self._start(nxt)
            self._cond.notify_all()
        if err is None:
            try:
                self.on_written(step)
            except Exception as e:  # noqa: BLE001 - retention must not stop the writes
                log.warning("gdsckpt: after writing step %d to the directory: %s: %s", step, type(e).__name__, e)
        with self._cond:
            self._settle(step, dict(record) if record else None, err)

    def _failed(self, step: int, err: BaseException) -> None:
        self.errors.append({"step": step, "error": f"{type(err).__name__}: {err}", "time": time.time()})
        log.warning("gdsckpt: writing step %d to the directory from memory failed (its memory copy is kept): "
                    "%s: %s", step, type(err).__name__, err)

    def mbps(self) -> float:
        return self._bytes / self._seconds / 1e6 if self._seconds else 0.0

    def busy(self) -> set[int]:
        """Steps being written or waiting to be."""
        with self._cond:
            return {s for s in (self._waiting, self._in_flight and self._in_flight["step"]) if s is not None}

    def wait(self, timeout: float | None = None) -> bool:
        """Until nothing is written or waiting; False if `timeout` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._in_flight is not None or self._waiting is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(1.0 if left is None else min(left, 1.0))
        return True

    def status(self) -> dict:
        with self._cond:
            f = self._in_flight
            return {"in_flight": f["step"] if f else None, "waiting": self._waiting, "written": list(self.written),
                    "coalesced": [dict(c) for c in self.coalesced], "coalesced_count": self.coalesced_count, "MBps": self.mbps(),
                    "interval_s": self._interval, "last_write": dict(self.last) if self.last else None,
                    "errors": list(self.errors)}
