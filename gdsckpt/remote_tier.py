"""The Checkpointer's object-store tier (remote="s3://bucket/prefix"; endpoint and credentials
from the AWS variables), as one object, RemoteTier:

* after a step commits, a background thread uploads it (multipart, parts in parallel: see
  gdsckpt/remote.py), reads it back against gdsckpt's own chunk checksums, and only then writes
  the step's marker, s3://bucket/prefix/step_00001000.gdsckpt.uploaded.json. A step counts as
  uploaded only with its marker, and only while every object the marker lists is there at its size;
* an upload that a newer queued step has overtaken while it waited is skipped (coalesced);
* a failed upload (store down, refused credentials, missing bucket) is logged and retried with
  backoff (up to a minute apart) until it succeeds or a newer step overtakes it; `status()`
  reports the queue depth, the upload throughput and the last errors;
* remote retention keeps the policy's newest `keep_remote` uploaded steps, removing a step's
  marker before its objects."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections import deque
from typing import Callable

from .errors import CheckpointFormatError, GdsckptError, RemoteStoreError
from .policy import Policy
from .steps import SUFFIX, StepLayout, parse_step_name

log = logging.getLogger("gdsckpt.manager")

MARKER = ".uploaded.json"
MAX_BACKOFF = 60.0


def marker_step(name: str) -> tuple[int, bool] | None:
    """(step, distributed) of a marker's object name; None for any other name."""
    return parse_step_name(name[:-len(MARKER)]) if name.endswith(MARKER) else None


def read_marker(store, name: str) -> dict | None:
    """The marker object `name`, or None if it is gone or not one of ours."""
    try:
        marker = json.loads(store.get_bytes(name))
        marker["files"]
    except (RemoteStoreError, ValueError, KeyError, TypeError):
        return None
    return marker


def no_remote_status() -> dict:
    """status() of a manager without a remote tier."""
    return {"uploads": 0, "uploaded_bytes": 0, "upload_seconds": 0.0, "verify_seconds": 0.0, "skipped": [],
            "failures": 0, "last_upload": None, "queue_depth": 0, "queued": [], "in_flight": None,
            "uploaded": None, "MBps": 0.0, "errors": []}


class RemoteTier:
    """The store (a gdsckpt.remote.ObjectStore) of one manager's steps, laid out as `layout`.
    upload=True starts the uploader thread (enqueue() feeds it); after each upload it calls
    `after_upload` (the manager's local retention), then applies remote retention."""

    def __init__(self, store, layout: StepLayout, policy: Policy, *, upload: bool,
                 after_upload: Callable[[], None]):
        self.store = store
        self.layout = layout
        self.policy = policy
        self._after_upload = after_upload
        self._mutex = threading.RLock()
        self._wake = threading.Condition(self._mutex)
        self._stopping = False
        self._queue: list[int] = []
        self._in_flight: int | None = None
        self._uploaded: set[int] | None = None  # None: not known yet (the store not reached)
        self._stats = {"uploads": 0, "uploaded_bytes": 0, "upload_seconds": 0.0, "verify_seconds": 0.0,
                       "skipped": [], "failures": 0, "last_upload": None}
        self._errors: deque = deque(maxlen=10)
        self._thread = None
        if upload:
            self._thread = threading.Thread(target=self._uploader, name="gdsckpt-uploader", daemon=True)
            self._thread.start()

    @property
    def uploading(self) -> bool:
        return self._thread is not None

    def url(self, name: str = "") -> str:
        return self.store.url(name)

    def enqueue(self, step: int) -> None:
        with self._wake:
            self._queue.append(step)
            self._wake.notify_all()

    # ------------------------------------------------------------ what the store has
    def remote_steps(self) -> dict[int, dict]:
        """{step: marker} of the steps uploaded, verified and still complete on the store."""
        listing = self.store.list()
        out = {}
        for name in listing:
            parsed = marker_step(name)
            if not parsed or parsed[1] != self.layout.distributed:
                continue
            marker = read_marker(self.store, name)
            if marker is None:
                continue  # removed meanwhile, or not ours
            if all(listing.get(f) == size for f, size in marker["files"].items()):
                out[parsed[0]] = marker
        return out

    def _known_uploaded(self) -> set[int]:
        if self._uploaded is None:
            ups = set(self.remote_steps())
            with self._mutex:
                self._uploaded = ups
        return self._uploaded

    def protected(self) -> tuple[set[int], set[int] | None]:
        """(steps queued or in flight, steps known uploaded or None if not known yet), at one instant."""
        with self._mutex:
            busy = set(self._queue)
            if self._in_flight is not None:
                busy.add(self._in_flight)
            return busy, (set(self._uploaded) if self._uploaded is not None else None)

    # ------------------------------------------------------------ remote retention
    def refresh(self) -> None:
        """Learn which steps the store has, if not known yet (before a prune)."""
        self._known_uploaded()

    def doomed(self) -> list[tuple[int, dict]]:
        """The uploaded steps remote retention would remove now, with their markers."""
        if self.policy.keep_remote is None:
            return []
        remote = self.remote_steps()
        return [(s, remote[s]) for s in self.policy.doomed_remote(sorted(remote))]

    def retain(self) -> None:
        for s, marker in self.doomed():
            name = self.layout.name(s)
            log.info("gdsckpt: removing step %d from %s", s, self.store.url())
            self.store.delete(name + MARKER)  # uncommit first: a kill mid-way leaves objects that do not count
            for f in marker["files"]:
                self.store.delete(f)
            with self._mutex:
                if self._uploaded is not None:
                    self._uploaded.discard(s)

    # ------------------------------------------------------------ uploads
    def _uploader(self) -> None:
        backoff = 0.0
        failed_at = 0.0
        while True:
            with self._wake:
                while True:
                    if self._stopping:
                        return
                    if self._queue and time.monotonic() >= failed_at + backoff:
                        break
                    self._wake.wait(None if not self._queue else max(0.01, failed_at + backoff - time.monotonic()))
                step = max(self._queue)
                overtaken = sorted(s for s in set(self._queue) if s < step)
                self._queue.clear()
                self._in_flight = step
                self._stats["skipped"].extend(overtaken)
            for s in overtaken:
                log.info("gdsckpt: upload of step %d skipped: step %d overtook it", s, step)
            try:
                if step not in self._known_uploaded():
                    self._upload(step)
                backoff = 0.0
            except Exception as e:  # the store down, refused, a corrupt read-back: keep the local copy, retry
                backoff = min(MAX_BACKOFF, max(1.0, backoff * 2))
                failed_at = time.monotonic()
                with self._wake:
                    self._stats["failures"] += 1
                    self._errors.append({"step": step, "error": f"{type(e).__name__}: {e}", "time": time.time()})
                    if not any(s > step for s in self._queue):
                        self._queue.append(step)
                    self._in_flight = None
                    self._wake.notify_all()
                log.warning("gdsckpt: upload of step %d to %s failed (retrying in %.0f s; the local copy is kept): "
                            "%s: %s", step, self.store.url(), backoff, type(e).__name__, e)
                continue
            try:  # before the step leaves flight: wait() returns with retention done
                self._after_upload()
                self.retain()
            except Exception as e:
                log.warning("gdsckpt: retention after uploading step %d: %s: %s", step, type(e).__name__, e)
            with self._wake:
                self._in_flight = None
                self._wake.notify_all()

    def _upload(self, step: int) -> None:
        name = self.layout.name(step)
        if not self.layout.committed(self.layout.path(step)):
            raise GdsckptError(f"step {step} is no longer in {str(self.layout.directory)!r}")
        files = {}
        t0 = time.perf_counter()
        total = 0
        verify_s = 0.0
        for local, rel in self.layout.files(step):
            size = local.stat().st_size
            self.store.upload(local, rel)
            t = time.perf_counter()
            if rel.endswith(SUFFIX):
                self.store.verify(rel, expected_size=size)
            elif self.store.get_bytes(rel) != local.read_bytes():
                raise CheckpointFormatError("read-back differs from the local file", path=self.store.url(rel))
            verify_s += time.perf_counter() - t
            files[rel] = size
            total += size
        marker = {"step": step, "files": files, "uploaded": time.time(), "host": socket.gethostname()}
        self.store.put_bytes(name + MARKER, json.dumps(marker).encode())
        secs = time.perf_counter() - t0
        with self._mutex:
            self._uploaded.add(step)
            st = self._stats
            st["uploads"] += 1
            st["uploaded_bytes"] += total
            st["upload_seconds"] += secs
            st["verify_seconds"] += verify_s
            st["last_upload"] = {"step": step, "bytes": total, "seconds": secs, "verify_seconds": verify_s,
                                 "MBps": total / secs / 1e6 if secs else 0.0}
        log.info("gdsckpt: step %d uploaded to %s and verified: %d bytes in %.2f s (%.1f MB/s)", step,
                 self.store.url(name), total, secs, total / secs / 1e6 if secs else 0.0)

    def status(self) -> dict:
        """Queue depth, the step in flight, uploaded steps, throughput (bytes / seconds of upload +
        verify, per upload and overall), skipped steps, last errors."""
        with self._mutex:
            st = dict(self._stats)
            st["skipped"] = list(st["skipped"])
            st["queue_depth"] = len(set(self._queue))
            st["queued"] = sorted(set(self._queue))
            st["in_flight"] = self._in_flight
            st["uploaded"] = sorted(self._uploaded) if self._uploaded is not None else None
            st["MBps"] = st["uploaded_bytes"] / st["upload_seconds"] / 1e6 if st["upload_seconds"] else 0.0
            st["errors"] = list(self._errors)
            return st

    # ------------------------------------------------------------ lifetime
    def wait(self, timeout: float | None = None) -> None:
        """Until the queue is empty and nothing is in flight, or an upload attempt fails (it
        stays queued and is retried; the error is in status()), or `timeout` seconds pass."""
        if self._thread is None:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._wake:
            failures = self._stats["failures"]
            while (self._queue or self._in_flight is not None) and not (
                    self._stats["failures"] > failures and self._in_flight is None):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._wake.wait(min(left, 1.0) if left is not None else 1.0)

    def close(self, *, wait: bool, timeout: float | None = None) -> list[int]:
        """wait: first wait() for the queue (at most `timeout` seconds). Then stop the uploader and
        join it. Returns the steps queued or in flight that were never uploaded."""
        try:
            if wait:
                self.wait(timeout)
        finally:
            with self._wake:
                self._stopping = True
                self._wake.notify_all()
            if self._thread is not None:
                self._thread.join(timeout=30)
        with self._mutex:
            left = set(self._queue) | ({self._in_flight} if self._in_flight is not None else set())
            return sorted(left - (self._uploaded or set()))
