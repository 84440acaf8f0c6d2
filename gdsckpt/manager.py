"""Checkpointer: step-numbered checkpoints in a directory, the newest few kept, drained to an
S3-compatible object store in the background, restored from the newest intact step.

    ckpt = gdsckpt.Checkpointer("/nvme/run7", keep=3, remote="s3://bucket/run7", keep_remote=10)
    for step in range(start, steps):
        train_step()
        if step % 1000 == 0:
            ckpt.save_async(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    ckpt.close()                                  # waits for the last save and upload
    r = ckpt.restore(state)                       # newest intact step, in place; r.step, r.skipped

Layout: one gdsckpt file per step, DIR/step_00001000.gdsckpt, for a single process; under
torch.distributed, one DCP directory per step, DIR/step_00001000/ (gdsckpt.dcp.GdsckptWriter:
a file per rank and DCP's .metadata; DCP's plans cached between saves, gdsckpt.dcp.CachedSavePlanner),
with the same calls on every rank. A step counts once it is committed: the file renamed into
place (gdsckpt.save is atomic and durable), or the DCP directory's .metadata written.
Temporaries of killed saves never count.

The remote tier (remote="s3://bucket/prefix"; endpoint and credentials from the AWS variables):
after a step commits, a background thread uploads it (multipart, parts in parallel: see
gdsckpt/remote.py), reads it back against gdsckpt's own chunk checksums, and only then writes
the step's marker, s3://bucket/prefix/step_00001000.gdsckpt.uploaded.json. A step counts as
uploaded only with its marker, and only while every object the marker lists is there at its size.

The policy:
* keep the newest `keep` steps locally;
* upload the 1st, (1 + every_remote)th, (1 + 2 every_remote)th ... step this manager saves;
* an upload that a newer committed step has overtaken while it waited is skipped (coalesced);
* an old local step is deleted only once a newer step is committed, and, with the remote tier
  on, once it or a newer step is uploaded: a step waiting for (or in) an upload is never
  deleted, so the only copy of the newest state never goes; the remote keeps the newest
  `keep_remote` uploaded steps (None: all), removing a step's marker before its objects;
* a failed upload (store down, refused credentials, missing bucket) is logged and retried with
  backoff (up to a minute apart) until it succeeds or a newer step overtakes it; local
  checkpointing goes on meanwhile; `status()` reports the queue depth, the upload throughput
  and the last errors.

One manager per directory: a lock file (DIR/.gdsckpt-manager.lock, flock) makes a second
Checkpointer on the same directory, in this process or another, fail with CheckpointLockedError.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
import warnings
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from . import api
from .errors import (
    CheckpointFormatError, CheckpointLockedError, GdsckptError, NoCheckpointError, RemoteStoreError, VersionError,
)
from .storage import fsync_dir

log = logging.getLogger("gdsckpt.manager")

LOCK_NAME = ".gdsckpt-manager.lock"
SUFFIX = ".gdsckpt"
MARKER = ".uploaded.json"
_STEP = re.compile(r"^step_(\d{8,})(\.gdsckpt)?$")
_MARKER = re.compile(r"^step_(\d{8,})(\.gdsckpt)?" + re.escape(MARKER) + "$")
_DCP_METADATA = ".metadata"
MAX_BACKOFF = 60.0
# What restore falls back from: a step that is damaged, incomplete or unreadable. A state that
# does not match the checkpoint, or a codec this machine lacks, is the caller's to fix: raised.
_DAMAGE = (CheckpointFormatError, OSError)


def step_name(step: int, distributed: bool) -> str:
    return f"step_{step:08d}" if distributed else f"step_{step:08d}{SUFFIX}"


@dataclass
class Restored:
    """What restore() did. `state` is the caller's state (filled in place) or a new one;
    `skipped` lists the newer steps it could not use, as (step, "local" | "remote", why)."""

    state: object
    step: int
    source: str
    path: str
    skipped: list = field(default_factory=list)
    stats: object = None


@dataclass
class StepInfo:
    step: int
    local: str | None = None
    local_bytes: int = 0
    remote: str | None = None
    remote_bytes: int = 0


class _Lock:
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

    def release(self):
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


class Checkpointer:
    """Step-numbered checkpoints in `directory` with retention and an optional object-store tier.

    keep: local steps kept (>= 1). remote: "s3://bucket/prefix" or None. keep_remote: remote
    steps kept (None: all). every_remote: upload every n-th saved step. save_options: keyword
    arguments of gdsckpt.save (codec, chunk_bytes, io, ...) or of GdsckptWriter under
    torch.distributed. remote_options: keyword arguments of gdsckpt.remote.ObjectStore
    (part_bytes, concurrency, max_retries, retry_seconds). distributed: None = whether
    torch.distributed is initialized. upload=False: no uploader thread (the CLI's prune).
    """

    def __init__(self, directory, *, keep: int = 3, remote: str | None = None, keep_remote: int | None = None,
                 every_remote: int = 1, save_options: dict | None = None, remote_options: dict | None = None,
                 distributed: bool | None = None, upload: bool = True):
        if keep < 1:
            raise ValueError(f"keep must be at least 1 (the newest step is never deleted), got {keep}")
        if keep_remote is not None and keep_remote < 1:
            raise ValueError(f"keep_remote must be at least 1 or None, got {keep_remote}")
        if every_remote < 1:
            raise ValueError(f"every_remote must be at least 1, got {every_remote}")
        self.directory = Path(directory)
        self.keep, self.keep_remote, self.every_remote = keep, keep_remote, every_remote
        self.save_options = dict(save_options or {})
        if distributed is None:
            import torch.distributed as dist
            distributed = dist.is_available() and dist.is_initialized()
        self.distributed = bool(distributed)
        self.rank = 0
        if self.distributed:
            import torch.distributed as dist
            self.rank = dist.get_rank()
        self.directory.mkdir(parents=True, exist_ok=True)
        # Under torch.distributed the directory is shared by the ranks: rank 0 holds the lock,
        # deletes and uploads; every rank saves and restores.
        self._owner = self.rank == 0
        self._lock = _Lock(self.directory) if self._owner else None
        self._mutex = threading.RLock()
        self._deleting = threading.Lock()
        self._wake = threading.Condition(self._mutex)
        self._closed = False
        self._pending: tuple[int, Future] | None = None
        self._saves = 0
        self.store = None
        self._queue: list[int] = []
        self._in_flight: int | None = None
        self._uploaded: set[int] | None = None  # None: not known yet (the store not reached)
        self._stats = {"uploads": 0, "uploaded_bytes": 0, "upload_seconds": 0.0, "verify_seconds": 0.0,
                       "skipped": [], "failures": 0, "last_upload": None}
        self._errors: deque = deque(maxlen=10)
        self._thread = None
        if remote is not None:
            from .remote import ObjectStore
            self.store = ObjectStore(remote, **(remote_options or {}))
            if self._owner and upload:
                self._thread = threading.Thread(target=self._uploader, name="gdsckpt-uploader", daemon=True)
                self._thread.start()
                with self._mutex:
                    newest = self._local_steps()
                    if newest:  # a restarted run: its newest step may never have reached the store
                        self._queue.append(newest[-1])
                        self._wake.notify_all()

    # ------------------------------------------------------------ steps
    def _path(self, step: int) -> Path:
        return self.directory / step_name(step, self.distributed)

    def _committed(self, p: Path) -> bool:
        if self.distributed:
            return p.is_dir() and (p / _DCP_METADATA).is_file()
        return p.is_file()

    def _local_steps(self) -> list[int]:
        out = []
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        for name in names:
            m = _STEP.match(name)
            if m and bool(m.group(2)) != self.distributed and self._committed(self.directory / name):
                out.append(int(m.group(1)))
        return sorted(out)

    def remote_steps(self) -> dict[int, dict]:
        """{step: marker} of the steps uploaded, verified and still complete on the store."""
        if self.store is None:
            return {}
        listing = self.store.list()
        out = {}
        for name in listing:
            m = _MARKER.match(name)
            if not m or bool(m.group(2)) == self.distributed:
                continue
            try:
                marker = json.loads(self.store.get_bytes(name))
                files = marker["files"]
            except (RemoteStoreError, ValueError, KeyError, TypeError):
                continue  # removed meanwhile, or not ours
            if all(listing.get(f) == size for f, size in files.items()):
                out[int(m.group(1))] = marker
        return out

    def steps(self) -> list[int]:
        """Committed steps, here and (remote tier on) on the store, oldest first."""
        local = set(self._local_steps())
        if self.store is not None:
            try:
                local |= set(self.remote_steps())
            except RemoteStoreError as e:
                log.warning("gdsckpt: cannot list %s: %s", self.store.url(), e)
        return sorted(local)

    def latest_step(self) -> int | None:
        s = self.steps()
        return s[-1] if s else None

    # ------------------------------------------------------------ saving
    def _check(self, step: int) -> None:
        if self._closed:
            raise GdsckptError(f"this Checkpointer of {str(self.directory)!r} is closed")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        local = self._local_steps()
        if local and step <= local[-1]:
            raise ValueError(f"step {step} is not newer than step {local[-1]}, already committed in "
                             f"{str(self.directory)!r} (delete the newer steps, or use a new directory)")

    def save(self, step: int, state) -> object:
        """Save `state` as `step`; durable and committed on return. Returns gdsckpt's Stats
        (None under torch.distributed, where DCP returns its metadata)."""
        self.wait()
        self._check(step)
        path = self._path(step)
        if self.distributed:
            import torch.distributed.checkpoint as dcp
            from .dcp import CachedSavePlanner, GdsckptWriter
            dcp.save(state, storage_writer=GdsckptWriter(path, **self.save_options), planner=CachedSavePlanner())
            stats = None
        else:
            stats = api.save(state, path, **self.save_options)
        self._on_commit(step)
        return stats

    def save_async(self, step: int, state, *, optimizer=None) -> Future:
        """Save `state` as `step` in the background: `state` may be mutated once this returns
        (gdsckpt.save_async's snapshot; dcp.async_save under torch.distributed). optimizer=opt:
        the snapshot runs during the next forward/backward and opt.step() waits for it (the
        overlap contract of gdsckpt.save_async; GdsckptWriter(optimizer=) under
        torch.distributed). The step counts once the returned future completes; wait() waits
        for it and raises its error."""
        self.wait()
        self._check(step)
        path = self._path(step)
        if self.distributed:
            import torch.distributed.checkpoint as dcp
            from .dcp import CachedSavePlanner, GdsckptWriter
            fut = dcp.async_save(state, storage_writer=GdsckptWriter(path, optimizer=optimizer, **self.save_options),
                                 planner=CachedSavePlanner())
            fut = getattr(fut, "upload_completion", fut)  # an AsyncSaveResponse when staging is overlapped
        else:
            from .async_save import save_async
            fut = save_async(state, path, overlap=optimizer is not None, optimizer=optimizer, **self.save_options)
        self._pending = (step, fut)

        def done(f):
            if f.exception() is None:
                try:
                    self._on_commit(step)
                except Exception as e:  # retention must not turn a good save into a failed future
                    log.warning("gdsckpt: after committing step %d: %s", step, e)
        fut.add_done_callback(done)
        return fut

    def wait(self, *, uploads: bool = False, timeout: float | None = None) -> None:
        """Wait for the pending save_async (raising its error). uploads=True: then also until the
        upload queue is empty and nothing is in flight, or an upload attempt fails (it stays
        queued and is retried; the error is in status()), or `timeout` seconds pass."""
        if self._pending is not None:
            step, fut = self._pending
            try:
                fut.result()
            finally:
                self._pending = None
        if uploads and self._thread is not None:
            deadline = None if timeout is None else time.monotonic() + timeout
            with self._wake:
                failures = self._stats["failures"]
                while (self._queue or self._in_flight is not None) and not (
                        self._stats["failures"] > failures and self._in_flight is None):
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self._wake.wait(min(left, 1.0) if left is not None else 1.0)

    def _on_commit(self, step: int) -> None:
        with self._mutex:
            self._saves += 1
            if self._thread is not None and (self._saves - 1) % self.every_remote == 0:
                self._queue.append(step)
                self._wake.notify_all()
        if self._owner:
            self._retain()

    # ------------------------------------------------------------ retention
    def _retain(self) -> None:
        with self._deleting:  # one deleter at a time: the uploader's retention and a save's
            for s in self._doomed_local():
                self._delete_local(s)

    def _doomed_local(self) -> list[int]:
        """Local steps the policy lets go now."""
        with self._mutex:
            local = self._local_steps()
            protected = set(local[-self.keep:]) | set(self._queue)
            if self._in_flight is not None:
                protected.add(self._in_flight)
            if self._pending is not None:
                protected.add(self._pending[0])
            uploaded = self._uploaded
            doomed = []
            for s in local[:-self.keep]:
                if s in protected:
                    continue
                if self.store is not None and not (uploaded and (s in uploaded or max(uploaded) > s)):
                    continue  # its only copy, or the only copy of state newer than what the store has
                doomed.append(s)
            return doomed

    def _doomed_remote(self) -> list[tuple[int, dict]]:
        if self.keep_remote is None or self.store is None:
            return []
        return sorted(self.remote_steps().items())[:-self.keep_remote]

    def prune(self, *, dry_run: bool = False) -> dict:
        """Apply the retention policy now (as after every save and upload); dry_run: only say
        what would go. {"local": [steps], "remote": [steps]}."""
        if self.store is not None and self._uploaded is None:
            ups = set(self.remote_steps())
            with self._mutex:
                self._uploaded = ups
        local, remote = self._doomed_local(), [s for s, _ in self._doomed_remote()]
        if not dry_run:
            self._retain()
            self._retain_remote()
        return {"local": local, "remote": remote}

    def _delete_local(self, step: int) -> None:
        p = self._path(step)
        log.info("gdsckpt: removing step %d (%s)", step, p)
        if self.distributed:
            meta = p / _DCP_METADATA
            if meta.exists():  # uncommit first: a kill mid-removal leaves an uncommitted directory
                meta.unlink(missing_ok=True)
                fsync_dir(p)
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        fsync_dir(self.directory)

    def _retain_remote(self) -> None:
        for s, marker in self._doomed_remote():
            name = step_name(s, self.distributed)
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
                    if self._closed:
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
                if self._uploaded is None:
                    ups = set(self.remote_steps())
                    with self._mutex:
                        self._uploaded = ups
                if step not in self._uploaded:
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
            try:  # before the step leaves flight: wait(uploads=True) returns with retention done
                self._retain()
                self._retain_remote()
            except Exception as e:
                log.warning("gdsckpt: retention after uploading step %d: %s: %s", step, type(e).__name__, e)
            with self._wake:
                self._in_flight = None
                self._wake.notify_all()

    def _upload(self, step: int) -> None:
        name = step_name(step, self.distributed)
        p = self._path(step)
        if not self._committed(p):
            raise GdsckptError(f"step {step} is no longer in {str(self.directory)!r}")
        files = {}
        t0 = time.perf_counter()
        total = 0
        verify_s = 0.0
        if self.distributed:
            parts = sorted(f.name for f in p.iterdir() if f.is_file() and not f.name.startswith(".tmp"))
            parts.sort(key=lambda n: n == _DCP_METADATA)  # DCP's commit point goes last
            for part in parts:
                rel = f"{name}/{part}"
                size = (p / part).stat().st_size
                self.store.upload(p / part, rel)
                t = time.perf_counter()
                if part.endswith(SUFFIX):
                    self.store.verify(rel, expected_size=size)
                elif self.store.get_bytes(rel) != (p / part).read_bytes():
                    raise CheckpointFormatError("read-back differs from the local file", path=self.store.url(rel))
                verify_s += time.perf_counter() - t
                files[rel] = size
                total += size
        else:
            size = p.stat().st_size
            self.store.upload(p, name)
            t = time.perf_counter()
            self.store.verify(name, expected_size=size)
            verify_s = time.perf_counter() - t
            files[name] = size
            total = size
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
        """The remote tier's state: queue depth, the step in flight, uploaded steps, throughput
        (bytes / seconds of upload + verify, per upload and overall), skipped steps, last errors."""
        with self._mutex:
            st = dict(self._stats)
            st["skipped"] = list(st["skipped"])
            st["queue_depth"] = len(set(self._queue))
            st["queued"] = sorted(set(self._queue))
            st["in_flight"] = self._in_flight
            st["uploaded"] = sorted(self._uploaded) if self._uploaded is not None else None
            st["MBps"] = st["uploaded_bytes"] / st["upload_seconds"] / 1e6 if st["upload_seconds"] else 0.0
            st["errors"] = list(self._errors)
            st["local_steps"] = self._local_steps()
            return st

    # ------------------------------------------------------------ restoring
    def restore(self, state=None, step: int | None = None, *, device=None, strict: bool = True) -> Restored:
        """Restore the newest committed, intact step (or `step`), from the local directory, else
        from the remote tier. state given: filled in place (load_into; required under
        torch.distributed); None: a new state on `device` (None: where it was saved from).
        A damaged or incomplete step is skipped for the one before it, with a warning, and listed
        in the result's `skipped`. NoCheckpointError if no step can be restored."""
        self.wait()
        local = set(self._local_steps())
        remote: dict = {}
        if self.store is not None:
            try:
                remote = self.remote_steps()
            except RemoteStoreError as e:
                log.warning("gdsckpt: cannot list %s: %s", self.store.url(), e)
        if step is not None:
            candidates = [step]
        else:
            candidates = sorted(local | set(remote), reverse=True)
        if self.distributed and state is None:
            raise ValueError("under torch.distributed, restore needs the state to load into (DCP loads in place)")
        skipped = []
        for s in candidates:
            wheres = ([("local", None)] if s in local else []) + ([("remote", remote[s])] if s in remote else [])
            if not wheres:
                skipped.append((s, "local", "not found"))
            for where, marker in wheres:
                try:
                    out, path, stats = self._restore_one(s, where, state, device, strict)
                except VersionError:
                    raise
                except _DAMAGE as e:
                    skipped.append((s, where, f"{type(e).__name__}: {e}"))
                    continue
                if skipped:
                    warnings.warn(f"gdsckpt: restored step {s} ({where}), not the newer " +
                                  "; ".join(f"step {a} ({b}): {c}" for a, b, c in skipped), stacklevel=2)
                return Restored(out, s, where, path, skipped, stats)
        what = f"step {step}" if step is not None else "a committed, intact step"
        raise NoCheckpointError(f"no {what} in {str(self.directory)!r}"
                                + (f" or {self.store.url()}" if self.store is not None else "")
                                + (": " + "; ".join(f"step {a} ({b}): {c}" for a, b, c in skipped) if skipped else ""))

    def _restore_one(self, step, where, state, device, strict):
        name = step_name(step, self.distributed)
        if self.distributed:
            import torch.distributed.checkpoint as dcp
            from .dcp import GdsckptReader
            path = self._path(step)
            if where == "remote":
                path = self._fetch_dcp(step)
            from torch.distributed.checkpoint.api import CheckpointException
            try:
                dcp.load(state, storage_reader=GdsckptReader(path))
            except CheckpointException as e:  # raised on every rank alike, so every rank falls back alike
                errs = [exc for exc, _ in e.failures.values()]
                if errs and all(isinstance(x, _DAMAGE) and not isinstance(x, VersionError) for x in errs):
                    first = errs[0]
                    raise CheckpointFormatError(f"rank(s) {sorted(e.failures)} could not read the step: "
                                                f"{type(first).__name__}: {first}", path=path) from None
                raise
            return state, str(path), None
        if where == "local":
            return self._load(self._path(step), str(self._path(step)), state, device, strict)
        url = self.store.url(name)
        # download, then load from the temporary copy (removed after)
        tmp = self.directory / f".{name}.download.{os.getpid()}"
        try:
            self.store.download(name, tmp)
            return self._load(tmp, url, state, device, strict)
        finally:
            tmp.unlink(missing_ok=True)

    @staticmethod
    def _load(path, label, state, device, strict):
        with api.open(path) as ck:
            if state is not None:
                stats = ck.load_into(state, strict=strict)
                return state, label, stats
            out = ck.load(device)
            return out, label, ck.last_stats

    def _fetch_dcp(self, step: int) -> Path:
        """Under torch.distributed: rank 0 downloads the step's DCP directory from the store into
        the local directory (a temporary, renamed once complete); every rank waits for it."""
        import torch.distributed as dist
        name = step_name(step, True)
        final = self._path(step)
        ok = [None]
        if self.rank == 0:
            try:
                tmp = self.directory / f".{name}.download"
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
                for rel in self.store.list(name):  # "step_.../__0_0.gdsckpt", relative to the prefix
                    self.store.download(rel, tmp / rel.split("/", 1)[1])
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
                fsync_dir(self.directory)
            except Exception as e:
                ok[0] = f"{type(e).__name__}: {e}"
        dist.broadcast_object_list(ok, src=0)
        if ok[0] is not None:
            raise OSError(f"downloading step {step} from {self.store.url(name)} failed: {ok[0]}")
        return final

    # ------------------------------------------------------------ lifetime
    def close(self, *, wait_uploads: bool = True, timeout: float | None = None) -> None:
        """Wait for the pending save; with the remote tier, for the upload queue to drain
        (wait_uploads, at most `timeout` seconds); then stop the uploader and release the lock."""
        if self._closed:
            return
        try:
            self.wait()
            if wait_uploads:
                self.wait(uploads=True, timeout=timeout)
        finally:
            with self._wake:
                self._closed = True
                self._wake.notify_all()
            if self._thread is not None:
                self._thread.join(timeout=30)
            if self._lock is not None:
                self._lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self) -> str:
        return (f"Checkpointer({str(self.directory)!r}, keep={self.keep}, remote="
                f"{self.store.url() if self.store else None!r}, keep_remote={self.keep_remote}, "
                f"every_remote={self.every_remote})")


# ---------------------------------------------------------------- the CLI's views (no lock taken)


def _check_local(path: Path, deep: bool) -> str:
    """"ok" or why not: the footer and index of every gdsckpt file of a step (deep: every chunk)."""
    files = sorted(path.glob(f"*{SUFFIX}")) if path.is_dir() else [path]
    if path.is_dir() and not (path / _DCP_METADATA).is_file():
        return "incomplete (no .metadata)"
    try:
        for f in files:
            with api.open(f) as ck:
                if deep:
                    ck.verify()
    except (GdsckptError, OSError) as e:
        return f"DAMAGED: {type(e).__name__}: {e}"
    return "ok"


def describe(location: str, *, remote: str | None = None, deep: bool = False) -> list[dict]:
    """Steps in a checkpoint directory and/or under an s3:// prefix, newest last: for each, where
    it lives, its size and whether it is intact (committed and its footer and index valid; deep:
    every chunk checksum verified, which reads every byte)."""
    from .remote import ObjectStore, is_remote
    rows: dict[int, dict] = {}

    def row(step):
        return rows.setdefault(step, {"step": step, "local": None, "local_bytes": 0, "local_state": None,
                                      "remote": None, "remote_bytes": 0, "remote_state": None,
                                      "remote_files": []})

    if not is_remote(location):
        d = Path(location)
        for name in sorted(os.listdir(d)):
            m = _STEP.match(name)
            if not m:
                continue
            p = d / name
            r = row(int(m.group(1)))
            r["local"] = str(p)
            r["local_bytes"] = sum(f.stat().st_size for f in p.iterdir() if f.is_file()) if p.is_dir() \
                else p.stat().st_size
            r["local_state"] = _check_local(p, deep)
    else:
        remote = location
    if remote:
        store = ObjectStore(remote)
        listing = store.list()
        markers = {}
        for name in listing:
            m = _MARKER.match(name)
            if m:
                try:
                    markers[name[:-len(MARKER)]] = json.loads(store.get_bytes(name))
                except (RemoteStoreError, ValueError):
                    pass
        for name, size in listing.items():
            top = name.split("/", 1)[0]
            m = _STEP.match(top)
            if not m or name.endswith(MARKER):
                continue
            r = row(int(m.group(1)))
            r["remote"] = store.url(top)
            r["remote_bytes"] += size
        for r in rows.values():
            if r["remote"] is None:
                continue
            top = r["remote"].rsplit("/", 1)[1]
            marker = markers.get(top)
            r["remote_files"] = sorted(marker["files"]) if marker else []
            if marker is None:
                r["remote_state"] = "incomplete (no verified-upload marker)"
            elif not all(listing.get(f) == n for f, n in marker["files"].items()):
                r["remote_state"] = "DAMAGED: objects missing or of another size than uploaded"
            elif deep:
                try:
                    for f in marker["files"]:
                        if f.endswith(SUFFIX):
                            store.verify(f)
                    r["remote_state"] = "ok"
                except (GdsckptError, OSError) as e:
                    r["remote_state"] = f"DAMAGED: {type(e).__name__}: {e}"
            else:
                r["remote_state"] = "ok"
    return [rows[k] for k in sorted(rows)]


def restore_test(location: str, *, remote: str | None = None) -> tuple[int | None, list[dict]]:
    """Verify steps newest first, every chunk checksum, until one is intact: (that step or None,
    the rows checked). What restore() would do, without loading."""
    checked = []
    for r in reversed(describe(location, remote=remote)):
        if r["local"] is not None:
            r["local_state"] = _check_local(Path(r["local"]), deep=True)
        if r["remote"] is not None and r["remote_state"] == "ok":
            from .remote import ObjectStore
            store = ObjectStore(r["remote"].rsplit("/", 1)[0])
            try:
                for f in r["remote_files"]:
                    if f.endswith(SUFFIX):
                        store.verify(f)
            except (GdsckptError, OSError) as e:
                r["remote_state"] = f"DAMAGED: {type(e).__name__}: {e}"
        checked.append(r)
        if "ok" in (r["local_state"], r["remote_state"]):
            return r["step"], checked
    return None, checked
