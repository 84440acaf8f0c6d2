"""save_async's background writer: moves pool bytes into files, then fsyncs and commits each
file exactly as `save` does (storage.AtomicFile: temporary beside the target, fsync, rename,
directory fsync).

One thread per process, one file at a time, in the order the jobs were submitted: commits
never interleave and happen in call order. It does nothing but I/O: no GPU calls, no codecs,
and one os.pwritev per chunk record (its pool pieces; the call releases the GIL while the
kernel copies), so it does not compete with a training loop for the GPU, its streams or the
interpreter. The file is written with O_DIRECT where the file system allows it (records and
their zero padding are 4 KiB-aligned in the pool and in the file); the header, index and
footer, a few KiB, go through a second, buffered descriptor. The thread exits when idle and
is not a daemon, so the interpreter finishes pending saves before it exits.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from gdsckpt.format import file as fmt
from gdsckpt.core.defaults import POOL_DIRECT_IO
from gdsckpt.core.storage import AtomicFile, open_direct, pwrite_all, pwrite_direct, pwritev_all

IDLE_S = 0.5  # the thread exits after this long with nothing to write (and the interpreter may exit)


@dataclass
class WriteReport:
    """What the writer did for one file."""

    queued_s: float = 0.0  # submitted -> this file's turn (earlier files were still being written)
    background_s: float = 0.0  # this file's turn -> committed
    write_s: float = 0.0  # in pwritev of chunk records
    wait_s: float = 0.0  # waiting for the snapshot to hand over chunks
    fsync_s: float = 0.0
    commit_s: float = 0.0  # rename + directory fsync
    direct_io: bool = False
    bytes_written: int = 0


class _Seal:
    __slots__ = ("tail_offset", "tail")

    def __init__(self, tail_offset: int, tail: bytes):
        self.tail_offset, self.tail = tail_offset, tail


class _Abort:
    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


class Job:
    """One file: chunk records handed over by the snapshot as their bytes land in the pool
    (`put`), then `seal` with the index and footer, or `abort`. `done` completes with a
    WriteReport once the file is committed, or with the error."""

    def __init__(self, pool, label: str):
        self.pool = pool
        self.label = label
        self.path: Path | None = None
        self.done: Future = Future()
        self.aborted = False  # by the snapshot: its caller saw the error
        self.submitted = 0.0
        self._items: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, extent, offset: int) -> None:
        self._items.put((extent, offset))

    def seal(self, tail_offset: int, tail: bytes) -> None:
        self._items.put(_Seal(tail_offset, tail))

    def abort(self, error: BaseException) -> None:
        self.aborted = True
        self._items.put(_Abort(error))

    def drop(self) -> None:
        """Release what a job never submitted holds (a DCP staging nobody wrote); its snapshot
        has ended, so every item is queued."""
        while True:
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple):
                self.pool.release(item[0])


class _Writer:
    def __init__(self):
        self._jobs: deque[Job] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, job: Job, path: Path) -> None:
        job.path, job.submitted = Path(path), time.perf_counter()
        with self._cond:
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gdsckpt-writer", daemon=False)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    if not self._cond.wait(IDLE_S) and not self._jobs:
                        self._thread = None
                        return
                job = self._jobs.popleft()
            write_job(job)


_writer = _Writer()


def submit(job: Job, path) -> None:
    """Queue `job` to be written to `path` after every job submitted before it."""
    _writer.submit(job, path)


def write_job(job: Job) -> None:
    start = time.perf_counter()
    report = WriteReport(queued_s=start - job.submitted)
    dfd = -1
    file: AtomicFile | None = None
    error: BaseException | None = None
    try:
        file = AtomicFile(job.path)
        file.create()  # 0o666 less the umask, then the replaced checkpoint's mode (as save and torch.save do)
        file.adopt_mode()
        dfd = open_direct(file.tmp) if POOL_DIRECT_IO else -1
        pwrite_all(file.fd, fmt.header_bytes(), 0)
    except BaseException as e:  # noqa: BLE001 - reported on the job's future
        error = e
    end = None
    while end is None:
        t = time.perf_counter()
        item = job._items.get()
        report.wait_s += time.perf_counter() - t
        if not isinstance(item, tuple):
            end = item
            break
        extent, offset = item
        if error is None:
            t = time.perf_counter()
            try:
                dfd = _write_extent(file.fd, dfd, extent, offset)
                report.bytes_written += extent.nbytes
            except BaseException as e:  # noqa: BLE001
                error = e
            report.write_s += time.perf_counter() - t
        job.pool.release(extent)  # written, or never to be: the snapshot may be waiting for room
    if isinstance(end, _Abort) and error is None:
        error = end.error
    report.direct_io = dfd >= 0
    if error is None:
        try:
            pwrite_all(file.fd, end.tail, end.tail_offset)
            t = time.perf_counter()
            file.sync()
            report.fsync_s = time.perf_counter() - t
            dfd = _close(dfd)
            t = time.perf_counter()
            file.commit()
            report.commit_s = time.perf_counter() - t
        except BaseException as e:  # noqa: BLE001
            error = e
    _close(dfd)
    report.background_s = time.perf_counter() - start
    if error is not None:
        if file is not None:
            try:
                file.abort()
            except OSError:
                pass
        job.done.set_exception(_named(error, job.path))
    else:
        job.done.set_result(report)


def _write_extent(fd: int, dfd: int, extent, offset: int) -> int:
    """Write the extent (record + zero padding to 4 KiB) at `offset`; the O_DIRECT descriptor
    if there is one. Returns it, or -1 once the file system refused a direct write."""
    views = extent.views()
    if dfd >= 0:
        if pwrite_direct(dfd, views, offset):
            return dfd
        os.close(dfd)  # accepted at open, refused at write: buffered from now on
    pwritev_all(fd, views, offset)
    return -1


def _close(dfd: int) -> int:
    if dfd >= 0:
        try:
            os.close(dfd)
        except OSError:
            pass
    return -1


def _named(error: BaseException, path) -> BaseException:
    """An OSError says which save it broke, as `save`'s do; anything else as it is."""
    if isinstance(error, OSError) and error.errno is not None:
        named = OSError(error.errno, f"{error.strerror} while writing in the background "
                                     "(the temporary file was removed)", str(path))
        named.__cause__ = error
        return named
    return error
