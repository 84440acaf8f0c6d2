"""The committed steps of a Checkpointer's directory, kept in memory between calls, so that what a
save asks of the directory costs the same with 10 steps kept as with 3,000.

* The directory is listed again only when it changed: its identity and times (one stat) differ
  from those of the last look. Then only the names new since are looked at (the names gone are
  dropped), which takes no call per step.
* A listing is trusted for the next calls only once the directory's last change is older than
  a tick of the file system's clock, within which a change leaves its times as they were: ext4,
  XFS and tmpfs tick in milliseconds (SETTLED_NS); a file system whose times are whole seconds
  (ext3, Lustre, FAT) is given COARSE_SETTLED_NS. Until then the directory is listed on every call.
* A step-named entry that is not committed yet (a DCP step's directory before its .metadata, which
  does not change the directory itself) is looked at again on every call, until it is committed
  or gone.
* The owner's own changes (a step committed, a step removed: noted()) are recorded at once,
  without a listing; a change by another process made at the same moment may then go unseen
  until the next listing, at the latest RELIST_S later. Under torch.distributed the other ranks,
  whose directory rank 0 changes, record nothing of their own: they list it again after any change.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path
from typing import Callable

SETTLED_NS = 100_000_000
COARSE_SETTLED_NS = 2_100_000_000
RELIST_S = 60.0


def _signature(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_nlink


class StepListing:
    """steps(): the committed steps of `directory`, oldest first. parse(name): (step, whether it is
    a step of this layout) or None; committed(path): whether the step at `path` counts. records:
    whether noted() records this process's own changes (False: they are listed like any other)."""

    def __init__(self, directory: Path, parse: Callable[[str], int | None], committed: Callable[[Path], bool],
                 records: bool = True):
        self.directory = directory
        self._parse, self._committed, self._records = parse, committed, records
        self._lock = threading.Lock()
        self._sig: tuple | None = None  # the directory as last seen, when trusted
        self._listed_at = 0.0
        self._names: set[str] = set()  # every name at the last listing
        self._steps: dict[str, int] = {}  # the committed ones
        self._waiting: dict[str, int] = {}  # step-named, not committed (yet)
        self._sorted: list[int] = []

    def steps(self) -> list[int]:
        with self._lock:
            try:
                st = os.stat(self.directory)
            except FileNotFoundError:
                self._reset()
                return []
            if _signature(st) != self._sig or time.monotonic() - self._listed_at > RELIST_S:
                self._relist(st)
            for name, step in list(self._waiting.items()):
                if self._committed(self.directory / name):
                    del self._waiting[name]
                    self._add(name, step)
            return list(self._sorted)

    def noted(self, name: str) -> None:
        """This process has just committed or removed the step `name`: recorded without a listing
        (when records, and the last look is trusted; else the next call lists the directory)."""
        with self._lock:
            self._drop(name)  # looked at anew, by the next listing if not here
            if self._sig is None or not self._records:
                self._sig = None
                return
            try:
                st = os.stat(self.directory)
            except FileNotFoundError:
                self._reset()
                return
            step = self._parse(name)
            if os.path.lexists(self.directory / name):
                self._names.add(name)
                if step is not None:
                    if self._committed(self.directory / name):
                        self._add(name, step)
                    else:
                        self._waiting[name] = step
            self._sig = _signature(st)

    def _reset(self) -> None:
        self._sig, self._names, self._steps, self._waiting, self._sorted = None, set(), {}, {}, []

    def _relist(self, st: os.stat_result) -> None:
        try:
            names = set(os.listdir(self.directory))
        except FileNotFoundError:
            self._reset()
            return
        last = max(st.st_mtime_ns, st.st_ctime_ns)
        settled = time.time_ns() - last > (COARSE_SETTLED_NS if last % 1_000_000_000 == 0 else SETTLED_NS)
        self._sig = _signature(st) if settled else None
        self._listed_at = time.monotonic()
        for name in self._names - names:
            self._drop(name)
        for name in names - self._names:
            step = self._parse(name)
            if step is None:
                continue
            if self._committed(self.directory / name):
                self._add(name, step)
            else:
                self._waiting[name] = step
        self._names = names

    def _add(self, name: str, step: int) -> None:
        if name not in self._steps:
            self._steps[name] = step
            bisect.insort(self._sorted, step)

    def _drop(self, name: str) -> None:
        self._names.discard(name)
        self._waiting.pop(name, None)
        step = self._steps.pop(name, None)
        if step is not None:
            i = bisect.bisect_left(self._sorted, step)
            if i < len(self._sorted) and self._sorted[i] == step:
                del self._sorted[i]
