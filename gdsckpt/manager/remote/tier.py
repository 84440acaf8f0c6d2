"""The Checkpointer's object-store tier (remote="s3://bucket/prefix": any gdsckpt.stores URL), as
one object, RemoteTier:

* after a step commits, a background thread uploads it (multipart, parts in parallel: see
  gdsckpt/stores/), reads it back against gdsckpt's own chunk checksums, and only then writes
  the step's marker, s3://bucket/prefix/step_00001000.gdsckpt.uploaded.json (gdsckpt/manager/remote/marker.py:
  a schema, and each file's identity). A step counts as uploaded only with a valid marker, and
  only while every object the marker lists is there at its size; a marker that does not parse is
  skipped with a warning. Restore from the store checks every object against its identity;
* an upload that a newer queued step has overtaken while it waited is skipped (coalesced), and
  so is a step the store has already, but only if its objects are the local files (by identity):
  a step saved again under a number the store has replaces the store's step, marker first;
* a failed upload (store down, refused credentials, missing bucket) is logged and retried with
  backoff (up to a minute apart) until it succeeds or a newer step overtakes it; `status()`
  reports the queue depth, the upload throughput and the last errors. A step damaged locally is
  reported as such and never retried; the newest older intact step goes instead;
* remote retention keeps the policy's newest `keep_remote` uploaded steps and never the newest
  intact one (its objects the files uploaded, every chunk checked: read in full once before an
  older step goes, unless this manager's upload read it back), removing a step's marker before
  its objects, then the objects of steps with no marker (an upload or a removal cut short) that
  are not being uploaded here;
* the listing of the store ends within the store's timeout: a store that hangs leaves the
  manager on its local steps; close() names the steps never uploaded."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, Iterator

from gdsckpt import api
from gdsckpt.errors import (
    CheckpointFormatError, GdsckptError, RemoteNotFoundError, RemoteStoreError, UploadIncompleteError,
)
from gdsckpt.manager.policy import Policy
from gdsckpt.manager.steps import SUFFIX, StepLayout, parse_step_name
from .parts import NodeLocalParts
from .verify import REPLACED, check_identity, check_uploaded, verify_object
from gdsckpt.stores import Store
from .marker import (
    MARKER, FileIdentity, InvalidMarker, Marker, file_identity, load_marker, marker_step, object_identity,
    read_markers,
)

log = logging.getLogger("gdsckpt.manager.checkpointer")

MAX_BACKOFF = 60.0
# How long close() waits, with no timeout given, for the upload in flight before leaving it to
# end on its own (the uploader then runs close's `then`, e.g. the lock's release, as it ends).
CLOSE_JOIN_SECONDS = 30.0


class _LocalDamage(Exception):
    """The local copy of the step being uploaded is damaged; `error` names its file."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def no_remote_status() -> dict:
    """status() of a manager without a remote tier."""
    return {"uploads": 0, "uploaded_bytes": 0, "upload_seconds": 0.0, "verify_seconds": 0.0, "skipped": [],
            "failures": 0, "last_upload": None, "queue_depth": 0, "queued": [], "in_flight": None,
            "uploaded": None, "MBps": 0.0, "errors": [], "rollback_pending": None}


class RemoteTier:
    """The store (a gdsckpt.stores.Store) of one manager's steps, laid out as `layout`.
    upload=True starts the uploader thread (enqueue() feeds it); after each upload it calls
    `after_upload` (the manager's local retention), then applies remote retention."""

    def __init__(self, store: Store, layout: StepLayout, policy: Policy, *, upload: bool,
                 after_upload: Callable[[], None], parts: NodeLocalParts | None = None):
        self.store = store
        self.layout = layout
        self.policy = policy
        self.parts = parts  # node-local directories: this directory's part of each step (remote/parts.py)
        self.commits = parts is None or parts.commits  # writes steps' markers, runs the store's retention
        self._after_upload = after_upload
        self._mutex = threading.RLock()
        self._wake = threading.Condition(self._mutex)
        self._stopping = False
        self._retry_now = False  # close(wait=True): one more attempt at once, without the backoff
        self._queue: list[int] = []
        self._in_flight: int | None = None
        self._uploaded: set[int] | None = None  # None: not known yet (the store not reached)
        # Steps queued here whose copy on the store, if it has one under that number, is not known
        # to be this directory's file (a step saved again after an older one was restored): they
        # count as uploaded (close, retention, status) only once the uploader has confirmed or
        # uploaded them.
        self._unconfirmed: set[int] = set()
        self._damaged: set[int] = set()  # local steps found damaged: never uploaded, not retried
        # {(object, its identity): None if read in full and found intact, else the damage found}: by
        # an upload's read-back, or by retention before it counted the step as the one to keep
        self._verified: dict[tuple[str, FileIdentity], CheckpointFormatError | None] = {}
        self._stats = {"uploads": 0, "uploaded_bytes": 0, "upload_seconds": 0.0, "verify_seconds": 0.0,
                       "skipped": [], "failures": 0, "last_upload": None}
        self._errors: deque = deque(maxlen=10)
        self._warned: set[tuple[str, str]] = set()  # (marker, why): each bad marker is reported once
        # A rollback's part here: (steps newer than this are abandoned, what to call once they are
        # gone from the store). While set they do not count, and no upload runs before it is done.
        self._abandon: tuple[int, Callable[[], None]] | None = None
        self._ended = False  # the uploader has returned (or never ran)
        self._at_end: list[Callable[[], None]] = []
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
            self._unconfirmed.add(step)
            self._wake.notify_all()

    def _uploaded_here(self) -> set[int] | None:
        """The steps the store holds as this directory's files, as far as known (None: not yet)."""
        return None if self._uploaded is None else self._uploaded - self._unconfirmed

    # ------------------------------------------------------------ what the store has
    def remote_steps(self) -> dict[int, Marker]:
        """{step: marker} of the steps uploaded, verified and still complete on the store
        (upload_marker.read_markers: a marker that does not parse is skipped, with a warning once
        per marker and reason), less those a pending rollback abandoned."""
        out = read_markers(self.store, self.layout.distributed, self._warn_once)
        abandon = self._abandon
        return {s: m for s, m in out.items() if abandon is None or s <= abandon[0]}

    def _warn_once(self, name: str, why: str) -> None:
        with self._mutex:
            if (name, why) in self._warned:
                return
            self._warned.add((name, why))
        log.warning("gdsckpt: %s", why)

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
            return busy, self._uploaded_here()

    # ------------------------------------------------------------ remote retention
    def refresh(self) -> None:
        """Learn which steps the store has, if not known yet (before a prune)."""
        self._known_uploaded()

    def doomed(self) -> list[tuple[int, Marker]]:
        """The uploaded steps remote retention would remove now, with their markers: beyond the
        policy's newest `keep_remote`, and never the newest intact one (its objects still the
        files uploaded, by their identity, and every chunk passing its checksum), nor anything
        when no step is intact."""
        if self.policy.keep_remote is None:
            return []
        remote = self.remote_steps()
        doomed = self.policy.doomed_remote(sorted(remote))
        if doomed:
            intact = self._newest_intact(remote)
            doomed = [s for s in doomed if intact is not None and s != intact]
        return [(s, remote[s]) for s in doomed]

    def _newest_intact(self, remote: dict[int, Marker]) -> int | None:
        for step in sorted(remote, reverse=True):
            if self._intact(step, remote[step]):
                return step
        return None

    def _intact(self, step: int, marker: Marker) -> bool:
        """Whether step `step` can be restored from the store (check_uploaded): before retention
        counts a step as the one to keep, it is read in full, once per object identity (an
        upload from here has read it back already)."""
        try:
            check_uploaded(self.store, marker, self._verified)
        except (CheckpointFormatError, RemoteNotFoundError) as e:
            self._warn_once(self.layout.name(step), f"step {step} on {self.store.url()} cannot be restored "
                                                    f"({type(e).__name__}: {e}): remote retention keeps an older step")
            return False
        return True

    def retain(self) -> None:
        """Remote retention: the doomed steps (marker first: a kill mid-way leaves objects that do
        not count), then the orphans."""
        for s, marker in self.doomed():
            name = self.layout.name(s)
            log.info("gdsckpt: removing step %d from %s", s, self.store.url())
            self.store.delete(name + MARKER)
            for f in marker.files:
                self.store.delete(f)
            with self._mutex:
                if self._uploaded is not None:
                    self._uploaded.discard(s)
        self.remove_orphans()

    def orphans(self) -> dict[int, list[str]]:
        """{step: its objects} of the steps on the store that have objects but no marker object
        (an upload or a removal cut short by a kill) and that this manager is not uploading now
        (a step in upload has no marker yet). Only names of this layout's steps: nothing else
        under the prefix is ever touched."""
        listing = self.store.list()
        marked, found = set(), {}
        for name in listing:
            parsed = marker_step(name)
            if parsed is not None:
                if parsed[1] == self.layout.distributed:
                    marked.add(parsed[0])
                continue
            top, _, rest = name.partition("/")
            parsed = parse_step_name(top)
            if parsed is None or parsed[1] != self.layout.distributed or bool(rest) != self.layout.distributed \
                    or "/" in rest:
                continue
            found.setdefault(parsed[0], []).append(name)
        # after the listing: an upload that started meanwhile is in flight, one that ended is uploaded
        busy, uploaded = self.protected()
        spared = marked | busy | (uploaded or set())
        if self.parts is not None:  # another directory may be sending its part of a step rank 0 still has
            spared |= set(self.layout.local_steps())
        return {s: sorted(names) for s, names in sorted(found.items()) if s not in spared}

    def remove_orphans(self) -> list[int]:
        """Remove the orphans' objects; the steps they belonged to."""
        orphans = self.orphans()
        for step, names in orphans.items():
            log.info("gdsckpt: removing %d object(s) of step %d from %s: no marker (an upload or a removal "
                     "cut short)", len(names), step, self.store.url())
            for name in names:
                self.store.delete(name)
        return list(orphans)

    # ------------------------------------------------------------ rollback
    def abandon_newer_than(self, step: int, then: Callable[[], None], *, remove: bool = True) -> list[int] | None:
        """A rollback to `step` (the lowest of those whose part here is pending): the steps newer
        than it no longer count, and leave the store (markers first, then every object under
        their names, those of unfinished uploads too), after the upload in flight, if newer,
        ends; queued newer steps are dropped. `then` is called once they are gone. Returns the
        steps removed, or None if the store could not be reached, or remove=False (a read-only
        manager: they only stop counting); the uploader removes them before any upload."""
        with self._wake:
            self._abandon = (step, then)
            self._queue = [s for s in self._queue if s <= step]
            if self._uploaded is not None:
                self._uploaded = {s for s in self._uploaded if s <= step}
            while self._in_flight is not None and self._in_flight > step:
                self._wake.wait(1.0)
        if not remove:
            return None
        try:
            return self._finish_abandon()
        except RemoteStoreError as e:
            with self._mutex:
                self._errors.append({"step": step, "error": f"rollback: {type(e).__name__}: {e}", "time": time.time()})
            log.warning("gdsckpt: rollback to step %d: cannot remove the newer steps from %s yet (they do not count "
                        "meanwhile; removed before any upload): %s: %s", step, self.store.url(), type(e).__name__, e)
            return None

    def newer_than(self, step: int) -> list[int]:
        """The steps after `step` that have anything on the store (a marker, or objects of an
        upload, finished or not): what a rollback to `step` removes there."""
        return sorted(self._objects_newer_than(step)[2])

    def _objects_newer_than(self, step: int) -> tuple[list[str], list[str], set[int]]:
        """(marker names, other object names, their steps) of the steps after `step` on the store."""
        markers, objects, steps = [], [], set()
        for name in self.store.list():
            top = name.split("/", 1)[0]
            parsed = marker_step(top) or parse_step_name(top)
            if parsed is None or parsed[1] != self.layout.distributed or parsed[0] <= step:
                continue
            steps.add(parsed[0])
            (markers if name.endswith(MARKER) else objects).append(name)
        return markers, objects, steps

    def _finish_abandon(self) -> list[int]:
        with self._mutex:
            pending = self._abandon
        if pending is None:
            return []
        to, then = pending
        markers, objects, gone = self._objects_newer_than(to) if self.commits else ([], [], set())
        for name in markers + objects:  # uncommit first: a kill mid-way leaves objects that do not count
            self.store.delete(name)
        if gone:
            log.info("gdsckpt: rollback to step %d: steps %s removed from %s", to, sorted(gone), self.store.url())
        then()  # before uploads resume: should it fail, the removal is done again (nothing newer uploaded since)
        with self._mutex:
            if self._abandon is pending:
                self._abandon = None
            if self._uploaded is not None:
                self._uploaded -= gone
        return sorted(gone)

    # ------------------------------------------------------------ uploads
    def _uploader(self) -> None:
        try:
            self._upload_queue()
        finally:
            with self._mutex:
                self._ended = True
                at_end, self._at_end = self._at_end, []
            for fn in at_end:
                fn()

    def _upload_queue(self) -> None:
        backoff = 0.0
        failed_at = 0.0
        while True:
            with self._wake:
                while True:
                    if self._stopping:
                        return
                    if self._queue and (self._retry_now or time.monotonic() >= failed_at + backoff):
                        self._retry_now = False
                        break
                    self._wake.wait(None if not self._queue else max(0.01, failed_at + backoff - time.monotonic()))
                step = max(self._queue)
                overtaken = sorted(s for s in set(self._queue) if s < step)
                self._queue.clear()
                self._in_flight = step
                self._stats["skipped"].extend(overtaken)
                if self._uploaded is not None:  # never to be uploaded: unconfirmed only where the store has the number
                    self._unconfirmed -= set(overtaken) - self._uploaded
            for s in overtaken:
                log.info("gdsckpt: upload of step %d skipped: step %d overtook it", s, step)
            try:
                self._finish_abandon()  # a rollback's removals come before any upload
                if step not in self._known_uploaded() or not self._uploaded_as_here(step):
                    self._upload(step)
                with self._mutex:
                    self._unconfirmed.discard(step)
                backoff = 0.0
            except _LocalDamage as d:
                self._on_local_damage(step, d.error)
                continue
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
                if self.commits:
                    self.retain()
            except Exception as e:
                log.warning("gdsckpt: retention after uploading step %d: %s: %s", step, type(e).__name__, e)
            with self._wake:
                self._in_flight = None
                self._wake.notify_all()

    def _uploaded_as_here(self, step: int) -> bool:
        """Whether the store's step `step` is the local one: the same files, each of the identity
        its marker records, and its objects still of that identity. One that is not (a step saved
        again under a number the store has, after an older step was restored on a new node; or an
        object replaced since its upload) goes: its marker first (the store's step stops counting,
        and a kill leaves objects that do not count), then its objects the new upload will not
        overwrite; the caller uploads the local step in its place."""
        if not self._here(step):
            return True  # nothing here to upload instead (_upload would say so)
        name = self.layout.name(step)
        try:
            marker = load_marker(self.store, name + MARKER)
            local = {rel: file_identity(path, rel) for path, rel in self._files(step)}
        except (InvalidMarker, RemoteNotFoundError, CheckpointFormatError):
            return False  # no valid marker now; or the local step is damaged, which _upload reports
        same = local.keys() <= marker.files.keys() if self.parts is not None else local.keys() == marker.files.keys()
        if same and not any(marker.files[r].differences(i) for r, i in local.items()):
            try:
                if not any(marker.files[r].differences(object_identity(self.store, r)) for r in marker.files):
                    return True
                why = "an object was replaced since its upload"
            except (RemoteNotFoundError, CheckpointFormatError) as e:
                why = f"an object is gone or unreadable ({type(e).__name__}: {e})"
        else:
            why = "it was saved again after an older step was restored?"
        log.warning("gdsckpt: step %d on %s is not the step %d saved in %s (%s): replacing it", step,
                    self.store.url(), step, str(self.layout.directory), why)
        self.store.delete(name + MARKER)
        with self._mutex:
            self._uploaded.discard(step)
        for rel in marker.files:
            if rel not in local and self.parts is None:  # (other directories' parts are theirs)
                self.store.delete(rel)
        return False

    def _here(self, step: int) -> bool:
        """Whether the step is here to upload (node-local directories: its folder, committed or not)."""
        path = self.layout.path(step)
        return path.is_dir() if self.parts is not None else self.layout.committed(path)

    def _files(self, step: int) -> list[tuple[Path, str]]:
        """The step's files this directory uploads."""
        return self.parts.files(self.layout, step) if self.parts is not None else self.layout.files(step)

    def _on_local_damage(self, step: int, error: BaseException) -> None:
        """Step `step` is damaged here: it is not uploaded, now or on any retry, and the newest
        older intact step newer than what the store has goes instead."""
        local = self.layout.local_steps()
        with self._wake:
            self._damaged.add(step)
            self._errors.append({"step": step, "error": f"local damage: {type(error).__name__}: {error}",
                                 "time": time.time()})
            here = self._uploaded_here()
            floor = max(here) if here else -1
            older = [s for s in local if floor < s < step and s not in self._damaged]
            instead = older[-1] if older and not any(s > step for s in self._queue) else None
            if instead is not None:
                self._queue.append(instead)
            self._in_flight = None
            self._wake.notify_all()
        log.warning("gdsckpt: step %d is damaged in %s, not uploaded (%s: %s); %s", step,
                    str(self.layout.directory), type(error).__name__, error,
                    f"uploading step {instead} instead" if instead is not None else "no older step to upload instead")

    def _upload(self, step: int) -> None:
        name = self.layout.name(step)
        if not self._here(step):
            raise GdsckptError(f"step {step} is no longer in {str(self.layout.directory)!r}")
        files = {}
        t0 = time.perf_counter()
        total = 0
        verify_s = 0.0
        try:
            parts = self._files(step)
        except CheckpointFormatError as e:  # a DCP step lacking a file its .metadata names: never uploaded
            raise _LocalDamage(e) from None
        for local, rel in parts:
            try:
                identity = file_identity(local, rel)
            except CheckpointFormatError as e:  # its footer: names the local file
                raise _LocalDamage(e) from None
            size = identity.size
            self.store.put_file(local, rel)
            t = time.perf_counter()
            if rel.endswith(SUFFIX):
                try:
                    verify_object(self.store, rel, expected_size=size)
                except CheckpointFormatError:
                    self._verify_local(local)  # the local file's damage, if it is the local file's
                    raise
                check_identity(identity, object_identity(self.store, rel), self.store.url(rel),
                               f"the object read back is not the file {str(local)!r} uploaded")
                self._verified[rel, identity] = None
            elif self.store.get_bytes(rel) != local.read_bytes():
                raise CheckpointFormatError("read-back differs from the local file", path=self.store.url(rel))
            verify_s += time.perf_counter() - t
            files[rel] = identity
            total += size
        marker = Marker(step, files, time.time(), socket.gethostname())
        if self.parts is not None:  # this directory's part; rank 0: the step's marker over them all
            self.parts.commit(self.store, self.layout, step, marker)
        else:
            self.store.put_bytes(name + MARKER, marker.encode())
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

    @staticmethod
    def _verify_local(path: Path) -> None:
        """_LocalDamage naming `path` if its chunks, index or footer fail their checksums."""
        try:
            with api.open(path) as ck:
                ck.verify()
        except CheckpointFormatError as e:
            raise _LocalDamage(e) from None

    # ------------------------------------------------------------ restoring
    @contextlib.contextmanager
    def fetched(self, step: int) -> Iterator[tuple[Path, str]]:
        """The step brought from the store (the layout's download): (local path, what to call it)
        while the context lasts. Every object is checked against the identity its marker
        recorded, before the download (by ranged reads of its footer) and after it (the local
        copy): an object replaced since its upload, even by a valid checkpoint of the same size,
        raises CheckpointFormatError naming it, so restore falls back."""
        name = self.layout.name(step)
        try:
            marker = load_marker(self.store, name + MARKER)
        except InvalidMarker as e:
            raise CheckpointFormatError(f"the upload marker of step {step} is not valid: {e}",
                                        path=self.store.url(name + MARKER)) from None
        what = REPLACED.format(step=step)
        for rel, want in marker.files.items():
            check_identity(want, object_identity(self.store, rel), self.store.url(rel), what)
        with self.layout.fetched(step, self.store) as (path, label):
            for rel, want in marker.files.items():
                local = path if rel == name else path / rel[len(name) + 1:]
                check_identity(want, file_identity(local, rel), self.store.url(rel), what)
            yield path, label

    def status(self) -> dict:
        """Queue depth, the step in flight, uploaded steps, throughput (bytes / seconds of upload +
        verify, per upload and overall), skipped steps, last errors."""
        with self._mutex:
            st = dict(self._stats)
            st["skipped"] = list(st["skipped"])
            st["queue_depth"] = len(set(self._queue))
            st["queued"] = sorted(set(self._queue))
            st["in_flight"] = self._in_flight
            here = self._uploaded_here()
            st["uploaded"] = sorted(here) if here is not None else None
            st["MBps"] = st["uploaded_bytes"] / st["upload_seconds"] / 1e6 if st["upload_seconds"] else 0.0
            st["errors"] = list(self._errors)
            st["rollback_pending"] = None if self._abandon is None else self._abandon[0]
            return st

    # ------------------------------------------------------------ lifetime
    def wait(self, timeout: float | None = None, *, retry_now: bool = False) -> None:
        """Until the queue is empty and nothing is in flight, or an upload attempt fails (it
        stays queued and is retried; the error is in status()), or `timeout` seconds pass.
        retry_now: a step waiting for its retry's backoff is tried at once."""
        if self._thread is None:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._wake:
            failures = self._stats["failures"]
            if retry_now:
                self._retry_now = True
                self._wake.notify_all()
            while (self._queue or self._in_flight is not None) and not (
                    self._stats["failures"] > failures and self._in_flight is None):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._wake.wait(min(left, 1.0) if left is not None else 1.0)

    def close(self, *, wait: bool, timeout: float | None = None,
              then: Callable[[], None] | None = None) -> list[int]:
        """wait: first one more attempt at once for a step waiting out its retry's backoff, then
        wait() for the queue. Then stop the uploader: it ends once the upload in flight, if any,
        ends; close waits for that too. All within
        `timeout` seconds (None: no bound on the queue, CLOSE_JOIN_SECONDS on the upload in
        flight). `then` runs once the uploader has ended: before close returns, or else on the
        uploader's thread as it ends, so that what `then` releases (the directory's lock) is never
        released while an upload runs. Returns the steps queued or in flight that were never
        uploaded (a step found damaged locally is not one)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            if wait:
                self.wait(timeout, retry_now=True)
        finally:
            with self._wake:
                self._stopping = True
                self._wake.notify_all()
            if self._thread is not None:
                self._thread.join(CLOSE_JOIN_SECONDS if deadline is None else max(0.0, deadline - time.monotonic()))
            if then is not None:
                with self._mutex:
                    now = self._thread is None or self._ended
                    if not now:
                        self._at_end.append(then)
                if now:
                    then()
        with self._mutex:
            left = set(self._queue) | ({self._in_flight} if self._in_flight is not None else set())
            return sorted(left - (self._uploaded_here() or set()) - self._damaged)

    def incomplete_error(self, steps: list[int]) -> UploadIncompleteError:
        """The error close() raises for `steps`, never uploaded."""
        with self._mutex:
            last = self._errors[-1]["error"] if self._errors else "no upload attempt finished"
        return UploadIncompleteError(
            f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))} never reached {self.store.url()}: "
            f"the local copies in {str(self.layout.directory)!r} are kept (last error: {last}); "
            "close(wait_uploads=False) closes without them", steps=steps)
