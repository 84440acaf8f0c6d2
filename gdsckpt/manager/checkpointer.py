"""Checkpointer: step-numbered checkpoints in a directory, the newest few kept, drained to an
S3-compatible object store in the background, restored from the newest intact step.

    ckpt = gdsckpt.Checkpointer("/nvme/run7", keep=3, remote="s3://bucket/run7", keep_remote=10)
    for step in range(start, steps):
        train_step()
        if step % 1000 == 0:
            ckpt.save_async(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    ckpt.close()                                  # waits for the last save and upload
    r = ckpt.restore(state)                       # newest intact step, in place; r.step, r.skipped

The parts: the steps' layout in the directory (gdsckpt/manager/steps.py: a file per step, or a DCP
directory per step under torch.distributed), the object-store tier (gdsckpt/manager/remote/tier.py), the
policy (gdsckpt/manager/policy.py), the directory lock (gdsckpt/core/dirlock.py), the record of a rollback in
progress (gdsckpt/manager/rollback.py), the thread that runs retention after commits and uploads
(gdsckpt/manager/retention.py). This module orchestrates.

The policy:
* keep the local steps the `keep` retention policy keeps (an int n: the newest n; gdsckpt/manager/policy.py);
* upload the 1st, (1 + every_remote)th, (1 + 2 every_remote)th ... step this manager saves;
* an old local step is deleted only once a newer step is committed, and, with the remote tier
  on, once it or a newer step is uploaded: a step waiting for (or in) an upload is never
  deleted, so the only copy of the newest state never goes; the remote keeps the uploaded steps
  its `keep_remote` policy keeps (None: all);
* a damaged local step (its footer or index, or a DCP step's .metadata) does not count toward
  `keep`: retention never deletes the newest intact step (status()['local_damage']);
* local checkpointing goes on while the store is down.

rollback(step) goes back to an earlier step: the newer ones leave the directory and the store.

memory=True adds the memory tier (gdsckpt/manager/memory/steps.py): every save lands in shared memory on
this host, where it outlives the process and restores without the disk; the 1st, (1 +
every_local)th, ... step saved is also written to the directory (coalesced when the disk falls
behind), and uploads follow the steps written there. restore() tries a step's memory copy first.

reserve(state), before the loop, makes the host memory the first save would otherwise allocate
and page-lock inside its call (the pool, or the memory tier's segments) on a background thread.

One manager per directory: a lock file (DIR/.gdsckpt-manager.lock, flock) makes a second
Checkpointer on the same directory, in this process or another, fail with CheckpointLockedError.
A directory this process cannot write is opened read-only: steps(), latest_step() and
restore() work; save, save_async and prune raise ReadOnlyCheckpointerError.
Under torch.distributed the directory is shared by the ranks: rank 0 holds the lock, deletes,
uploads and finishes a rollback recorded there (opening is a collective: every rank constructs
its Checkpointer, and learns which ranks see the same directory: docs/replicas.md, node-local
directories); every rank saves and restores, the step rank 0 chooses. save_async's
collectives, which run on DCP's thread, use a process group the Checkpointer makes when
constructed (gdsckpt/core/process_groups.py): the training loop's own collectives on the default group
may run meanwhile.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import warnings
from concurrent.futures import Future
from pathlib import Path

from .options import (
    UNSET, CheckpointerOptions, LocalOptions, MemoryOptions, RemoteOptions, checkpointer_options,
)
from gdsckpt.core.dirlock import try_lock
from gdsckpt.errors import (
    CheckpointFormatError, GdsckptError, NoCheckpointError, ReadOnlyCheckpointerError, RemoteStoreError,
    VersionError,
)
from .memory.steps import MemorySteps
from .memory.folders import renew_directory_id
from .policy import whole_number
from .remote.parts import NodeLocalParts
from .remote.tier import RemoteTier, no_remote_status
from .kept_checks import KeptChecks
from gdsckpt.writing.snapshot.overlap import watch_optimizers
from .restored import Restored
from .retention import RetentionThread
from .directory_sharing import DirectorySharing, ranks_sharing
from .rollback import PendingRollback, RollbackJournal, Rollbacks
from .steps import DAMAGE, DcpSteps, FileSteps, StepLayout, step_name

__all__ = ["Checkpointer", "Restored", "step_name"]

log = logging.getLogger("gdsckpt.manager.checkpointer")


class Checkpointer(Rollbacks):
    """Step-numbered checkpoints in `directory` with retention and an optional object-store tier.

    The options come grouped (gdsckpt.options: local=LocalOptions, memory=MemoryOptions,
    remote=RemoteOptions, or all in options=CheckpointerOptions) or as these keywords, shorthand
    for the same fields (one setting given both ways is a ValueError):
    keep: local steps kept (an int >= 1: the newest n; or a RetentionPolicy such as
    LatestN(3) | KeepEvery(1000)). remote: "s3://bucket/prefix" or None. keep_remote: remote
    steps kept (likewise; None: all). every_remote: upload every n-th saved step. save_options:
    keyword arguments of gdsckpt.save (codec, chunk_bytes, io, ...; snapshot= for save_async) or of
    GdsckptWriter under torch.distributed, checked here (a ValueError naming the option, before
    anything is taken). remote_options: keyword arguments of gdsckpt.stores.open_store
    (part_bytes, concurrency, timeout, max_retries). distributed: None = whether
    torch.distributed is initialized; then constructing, save, save_async, restore and rollback are
    collectives (every rank makes the same calls; distributed=False for a one-rank tool).
    upload=False: no uploader thread (the CLI's prune).
    memory: hold every saved step in shared memory on this host (the memory tier); then
    every_local: write every n-th saved step (the 1st, 1 + n, ...) to the directory, memory_bytes:
    the tier's cap (None: defaults.MEMORY_*, status()['memory']['cap_bytes']), keep_memory: copies
    kept where the cap allows (an int or a RetentionPolicy); replicas: under torch.distributed, each
    memory step also held by that many ranks on other nodes (node=: this rank's; placement={rank:
    [holders]}: docs/replicas.md). read_only=True: open the directory as
    one this process cannot write (no lock, nothing in it removed or changed; restore and the
    listings only), as the CLI's dry runs do.
    """

    def __init__(self, directory, *, options: CheckpointerOptions | None = None, local: LocalOptions | None = None,
                 memory: bool | MemoryOptions = False, remote: str | RemoteOptions | None = None, keep=UNSET,
                 keep_remote=UNSET, every_remote=UNSET, save_options=UNSET, remote_options=UNSET, distributed=UNSET,
                 upload=UNSET, every_local=UNSET, memory_bytes=UNSET, keep_memory=UNSET, read_only=UNSET,
                 replicas=UNSET, node=UNSET, placement=UNSET):
        self.options = o = checkpointer_options(
            options, local=local, memory=memory, remote=remote, keep=keep, keep_remote=keep_remote,
            every_remote=every_remote, save_options=save_options, remote_options=remote_options,
            distributed=distributed, upload=upload, every_local=every_local, memory_bytes=memory_bytes,
            keep_memory=keep_memory, read_only=read_only, replicas=replicas, node=node, placement=placement)
        self.policy = o.policy()
        watch_optimizers()  # from the first step on, a save of fresh state_dict()s may overlap (fencing_optimizer)
        distributed, read_only, remote, memory = o.distributed, o.read_only, o.remote, o.memory
        self.directory = Path(directory)
        self.save_options = dict(o.save_options or {})
        if distributed is None:
            import torch.distributed as dist
            distributed = dist.is_available() and dist.is_initialized()
        self.distributed = bool(distributed)
        self.rank = 0
        if self.distributed:
            import torch.distributed as dist
            self.rank = dist.get_rank()
        # Before the lock: bad options and a bad URL are refused with nothing held, and refused
        # now, not at the first save_async hours into a run.
        (DcpSteps if self.distributed else FileSteps).check_options(self.save_options)
        store = None
        if remote is not None:
            from gdsckpt.stores import open_store
            store = open_store(remote.url, **(remote.store_options or {}))
        if not read_only:
            self.directory.mkdir(parents=True, exist_ok=True)
        # which ranks see this directory: a DCP step restores from it only where every rank does
        self.sharing = DirectorySharing(self.rank, ranks_sharing(self.directory) if self.distributed and not read_only
                                        else None)
        self._owner = self.rank == 0
        self._lock = try_lock(self.directory) if self.sharing.leads and not read_only else None
        # A directory this process cannot write, or asked not to: restore only (no lock to take,
        # nothing removed, a pending rollback's steps only stop counting).
        self.read_only = self._owner and self._lock is None
        if self.read_only:
            log.info("gdsckpt: %s cannot be written: this Checkpointer restores only", self.directory)
        if self.distributed:
            # dcp.async_save's collectives run on its thread: on a group of their own, never
            # interleaved with the training loop's on the default group (process_groups)
            from gdsckpt.core.process_groups import own_group
            self.layout: StepLayout = DcpSteps(self.directory, self.save_options, self.rank, group=own_group(),
                                               downloads=self.sharing.leads)
        else:  # read-only: a step from the store is downloaded elsewhere
            self.layout = FileSteps(self.directory, self.save_options,
                                    scratch=Path(tempfile.gettempdir()) if self.read_only else None)
        self._deleting = threading.Lock()  # one deleter at a time: the retention thread, prune() and rollback()
        self._retention = RetentionThread(self._retain)  # after commits and uploads, off their threads
        self._kept_checks = KeptChecks(self.layout, self.policy.keep)
        self._closed = False
        self._pending: tuple[int, Future, threading.Event | None] | None = None  # step, future, its commit handled
        self._saves = 0
        self._unrestorable: dict[int, str] = {}  # local steps restore() found damaged: {step: why}
        self._journal = RollbackJournal(self.directory)
        self._rolling = threading.RLock()  # the record's updates: here, and the uploader's once the store's part is done
        self._rollback: PendingRollback | None = None
        self.remote: RemoteTier | None = None
        self.memory: MemorySteps | None = None
        self.sharing.warn(self.directory, remote=store is not None)
        try:
            if store is not None:
                self.remote = RemoteTier(store, self.layout, self.policy,
                                         upload=self.sharing.leads and remote.upload and not self.read_only,
                                         after_upload=self._retention.request if self._owner else lambda: None,
                                         parts=NodeLocalParts(self.rank, self.sharing.leaders)
                                         if self.sharing.node_local else None)
            if memory and self.read_only:
                log.info("gdsckpt: %s is read-only: no memory tier", self.directory)
            elif memory:
                self.memory = MemorySteps(self.layout, rank=self.rank, every_local=memory.every_local,
                                          cap_bytes=memory.cap_bytes, keep=memory.keep, save_options=self.save_options,
                                          on_local_commit=self._on_commit, node=memory.node,
                                          placement=memory.placement, replicas=memory.replicas)
            # Whether its first write forks the lineage from copies it does not see (_fork_lineage);
            # not an empty tier under torch.distributed: the other ranks' tiers took the id already.
            self._forks = self._owner and not self.read_only and (
                self.memory is None or (not self.distributed and not self.memory.steps()))
            self._open()
        except BaseException:
            if self.memory is not None:
                self.memory.close(flush=False)
            if self.remote is not None:
                self.remote.close(wait=False, timeout=0)
            self._release()
            raise

    def _open(self) -> None:
        """What a manager finds to finish in its directory, before its first upload."""
        if self._lock is not None:
            self._remove_leftovers()
        pending, failed = None, None
        try:  # the owner's alone: the other ranks learn of it from the owner (share_rollback)
            pending = self._journal.read() if self._owner else None
            if pending is not None:  # a rollback killed part-way, or whose store could not be reached
                if self._lock is not None and pending.local_to is not None:
                    # memory copies it does not see (no tier, or this host's empty) of the steps it
                    # removes become another run's, as before any write: none comes back from memory
                    self._fork_lineage()
                with self._deleting:
                    self._resume_rollback(pending)
        except Exception as e:
            failed = e
        if self.distributed:
            self._share_rollback(pending, failed)
        if failed is not None:
            raise failed
        if self.distributed and self.memory is not None:  # a step one rank's tier kept alone counts on none
            self.memory.agree()
        if self.remote is not None:  # (node-local directories: a collective)
            newest = self.sharing.newest_everywhere(self.layout, self._deleting) if self.sharing.node_local \
                else max(self.layout.local_steps(), default=None)
            if self.remote.uploading and newest is not None:  # a restarted run's newest may never have reached it
                self.remote.enqueue(newest)

    def _remove_leftovers(self) -> None:
        for p in self.layout.leftovers():
            log.info("gdsckpt: removing %s, left by a restore that was killed", p)
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    # ------------------------------------------------------------ steps
    def remote_steps(self) -> dict[int, dict]:
        """{step: marker} of the steps uploaded, verified and still complete on the store."""
        return self.remote.remote_steps() if self.remote is not None else {}

    def _remote_or_nothing(self) -> dict[int, dict]:
        """remote_steps(), or {} with a warning when the store cannot be listed."""
        if self.remote is None:
            return {}
        try:
            return self.remote.remote_steps()
        except RemoteStoreError as e:
            log.warning("gdsckpt: cannot list %s: %s", self.remote.url(), e)
            return {}

    def _memory_steps(self) -> list[int]:
        return self.memory.steps() if self.memory is not None else []

    def steps(self) -> list[int]:
        """Committed steps, in memory (memory tier on), here and (remote tier on) on the store,
        oldest first."""
        return sorted(set(self._memory_steps()) | set(self._local_steps()) | set(self._remote_or_nothing()))

    def latest_step(self) -> int | None:
        s = self.steps()
        return s[-1] if s else None

    # ------------------------------------------------------------ saving
    def _writable(self, what: str) -> None:
        if self._closed:
            raise GdsckptError(f"this Checkpointer of {str(self.directory)!r} is closed")
        if self.read_only:
            raise ReadOnlyCheckpointerError(f"cannot {what}: {str(self.directory)!r} cannot be written (read-only), "
                                            "so this Checkpointer only restores")

    def _check(self, step: int) -> int:
        self._writable(f"save step {step!r}")
        step = whole_number("step", step, 0)
        # A damaged step does not count: a run that restored an older step because the newest was
        # damaged saves that step's number again (else every restart stopped there), in its place.
        found = self.sharing.owners_steps(self.layout, step, self._deleting) if self.sharing.node_local \
            else self.layout.local_steps()
        damaged = {s: why for s, why in self._unrestorable.items() if s in found}  # every rank's alike
        if not self.distributed:  # retention's findings too (the owner's alone under torch.distributed)
            damaged = self.layout.known_damage() | damaged
        newest = max([next((s for s in reversed(found) if s not in damaged), -1), *self._memory_steps()])
        if step <= newest:
            raise ValueError(f"step {step} is not newer than step {newest}, already committed in "
                             f"{str(self.directory)!r}{' or its memory tier' if self.memory else ''} "
                             f"(rollback(n) with n < {step} removes the newer steps; or use a new directory)")
        self._fork_lineage()
        if step in damaged:
            if self._owner:
                log.warning("gdsckpt: step %d is saved again in place of its damaged copy %s (%s)", step,
                            self.layout.path(step), damaged[step])
                with self._deleting:
                    self.layout.delete(step)
            self.layout.barrier()  # no rank writes the step before its damaged copy is gone
        return step

    def _fork_lineage(self) -> None:
        """Before the first write (save, rollback) of a manager that does not see the directory's
        memory copies (no tier, or an empty one): they become another run's, on every host."""
        if self._forks:
            self._forks = False
            if self.memory is not None:
                self.memory.tier.renew_id()
            else:
                renew_directory_id(self.directory)

    def save(self, step: int, state) -> object:
        """Save `state` as `step`; durable and committed on return, and the steps retention lets go
        deleted (save_async leaves them to a thread of their own). Returns gdsckpt's Stats
        (None under torch.distributed, where DCP returns its metadata). With the memory tier:
        committed in memory on return, and durable too if this step is written to the directory."""
        self._wait_save()
        step = self._check(step)
        if self.memory is not None:
            due = self.memory.next_is_local() and not self.distributed  # (a DCP step: saved by the call)
            written = self.memory.writes.when_written(step) if due else None
            stats = self.memory.save_async(step, state, None).result()
            self.memory.wait_local()
            if written is not None:  # its write to the directory failed: raised, as without the tier
                if written.done():
                    written.result()
                else:  # no room in memory: the save wrote the file itself
                    self.memory.writes.unwatch(step)
        else:
            stats = self.layout.save(step, state)
            self._on_commit(step)
        self._retention.wait()  # as it returns, the directory holds what the policy keeps
        return stats

    def save_async(self, step: int, state, *, optimizer=None) -> Future:
        """Save `state` as `step` in the background: `state` may be mutated once this returns
        (gdsckpt.save_async's snapshot; dcp.async_save under torch.distributed). optimizer=opt:
        the snapshot runs during the next forward/backward and opt.step() waits for it (the
        overlap contract of gdsckpt.save_async; GdsckptWriter(optimizer=) under
        torch.distributed), unless save_options name a snapshot taken in the call ("device", or
        "cpu" under torch.distributed), which no step waits for. The step counts once the
        returned future completes; wait() waits for it and raises its error."""
        self._wait_save()
        step = self._check(step)
        if self.memory is not None:  # committed in memory; the tier writes it to the directory if due
            self._pending = (step, self.memory.save_async(step, state, optimizer), None)
            return self._pending[1]
        fut = self.layout.save_async(step, state, optimizer)
        handled = threading.Event()  # wait() returns once the commit is handled, not only made
        self._pending = (step, fut, handled)

        def done(f):
            try:
                if Future.exception(f) is None:  # SaveFuture.exception() would count as the caller's look
                    self._on_commit(step)
            except Exception as e:  # the upload queue must not turn a good save into a failed future
                log.warning("gdsckpt: after committing step %d: %s", step, e)
            finally:
                handled.set()
        fut.add_done_callback(done)
        return fut

    def reserve(self, state, *, wait: bool = False) -> Future:
        """Make ahead of need, on a background thread, the host memory the next saves of `state`
        take, so that the first one blocks no longer than later ones: save_async's pool
        (gdsckpt.reserve), or with the memory tier the tier's slots for the next steps, made and
        page-locked within its cap, dropping nothing (a slot no step has used holds nothing that
        counts: it is removed as any uncommitted one). A Future of a gdsckpt.Reservation;
        wait=True: returned once done. Under torch.distributed without the memory tier: the pool
        GdsckptWriter's compressed staging takes for this rank's shards (gdsckpt.dcp.reserve;
        save_options={"snapshot": "cpu"}: nothing, the future's result is None)."""
        self._writable("reserve memory for saves")
        if self.memory is not None:
            return self.memory.reserve(state, wait)
        return self.layout.reserve(state, wait)

    def wait(self, *, uploads: bool = False, timeout: float | None = None) -> None:
        """Wait for the pending save_async (raising its error, unless the caller has seen it through
        the future's result() or exception()), then for the retention it started (on a thread of
        its own: a save waits for the pending save only). uploads=True: then also until the
        upload queue is empty and nothing is in flight, or an upload attempt fails (it stays
        queued and is retried; the error is in status()), or `timeout` seconds pass."""
        self._wait_save()
        if uploads and self.remote is not None:
            self.remote.wait(timeout)  # the last upload's retention requested before it returns
        self._retention.wait()

    def _wait_save(self) -> None:
        if self._pending is not None:
            _, fut, handled = self._pending
            try:
                err = Future.exception(fut)  # waits; not a look at the outcome: SaveFuture.observed stays
                if handled is not None:
                    handled.wait()
            finally:
                self._pending = None
            if err is not None and not getattr(fut, "observed", False):
                fut.result()  # raises it, once: a failure the caller has seen is not raised again

    def _on_commit(self, step: int) -> None:
        self.layout.noted(step)  # the directory's listing records it
        self._saves += 1
        if self.remote is not None and self.remote.uploading and self.policy.uploads(self._saves):
            self.remote.enqueue(step)
        if self._owner:
            self._retention.request()

    # ------------------------------------------------------------ retention
    def _retain(self) -> None:
        with self._deleting:
            for s in self._doomed_local():
                log.info("gdsckpt: removing step %d (%s)", s, self.layout.path(s))
                self.layout.delete(s)

    def _doomed_local(self) -> list[int]:
        """Local steps the policy lets go now. A damaged step does not count toward `keep`
        (footer and index checked, once per step); and before the step that would be the only
        intact one left loses its older company, its every chunk is verified (once, a full read)
        unless the store holds a verified copy of it."""
        local = self._local_steps()  # a pending rollback's abandoned steps count for nothing
        protected: set[int] = set()
        uploaded = None
        if self.remote is not None:
            protected, uploaded = self.remote.protected()
        pending = self._pending
        if pending is not None:
            protected.add(pending[0])
        if self.sharing.node_local:  # every step here lacks the other nodes' files: none is the intact one
            return self.policy.doomed_local(local, set(), protected, uploaded, remote=self.remote is not None)
        while True:
            damaged = self._kept_checks.damaged(local)  # the steps that decide, not every one kept
            if not damaged and isinstance(self.policy.keep, int) and len(local) <= self.policy.keep:
                return []  # every step is one of the newest `keep` intact ones
            doomed = self.policy.doomed_local(local, set(damaged), protected, uploaded, remote=self.remote is not None)
            left = set(local).difference(damaged, doomed)
            if not doomed or len(left) != 1 or (uploaded and min(left) in uploaded):
                return doomed
            if not self._kept_checks.check([min(left)], deep=(min(left),)):
                return doomed

    def prune(self, *, dry_run: bool = False) -> dict:
        """Apply the retention policy now (as after every save and upload); dry_run: only say what
        would go (under torch.distributed rank 0 removes; another rank only says what it sees go).
        {"local": [steps], "remote": [steps], "damaged": {local step: why}}."""
        if not dry_run:
            self._writable("prune")
        if self.remote is not None:
            self.remote.refresh()
        local = self._doomed_local()
        remote = [s for s, _ in self.remote.doomed()] if self.remote is not None else []
        if not dry_run and self._owner:  # (every rank removing the same steps: each failing on the others')
            self._retain()
            if self.remote is not None:
                self.remote.retain()
        return {"local": local, "remote": remote, "damaged": self.layout.known_damage()}

    def status(self) -> dict:
        """The remote tier's state: queue depth, the step in flight, uploaded steps, throughput
        (bytes / seconds of upload + verify, per upload and overall), skipped steps, last errors;
        the local steps, and those found damaged ({step: why}: retention's checks)."""
        st = self.remote.status() if self.remote is not None else no_remote_status()
        st["local_steps"] = self.layout.local_steps()
        st["node_local_directory"] = self.sharing.describe()
        st["local_damage"] = self.layout.known_damage()
        if self.memory is not None:  # its cap, what it holds, and the local writes coalesced and why
            st["memory"] = self.memory.status()
        if self.remote is not None:  # the uploads the uploader coalesced (its "skipped"), and why
            st["coalesced_uploads"] = [{"step": s, "why": "a newer step was committed while it waited for the store "
                                        f"(upload and verify at {st['MBps']:.0f} MB/s so far)"} for s in st["skipped"]]
        return st

    def release_memory(self) -> int:
        """Free the memory tier's copies (after the local writes in progress; steps held in
        memory only are lost, with a warning); later saves use the tier again. Bytes freed."""
        if self.memory is None:
            return 0
        self.wait()
        return self.memory.release()

    # ------------------------------------------------------------ restoring
    def restore(self, state=None, step: int | None = None, *, device=None, strict: bool = True) -> Restored:
        """Restore the newest committed, intact step (or `step`), from the local directory, else
        from the remote tier. state given: filled in place (load_into; required under
        torch.distributed), atomically: every chunk is verified before a byte reaches `state`, so
        after a fall-back it holds exactly the step restored; None: a new state on `device`
        (None: where it was saved from).
        A damaged or incomplete step is skipped for the one before it, with a warning, and listed
        in the result's `skipped`. NoCheckpointError if no step can be restored."""
        if step is not None:
            step = whole_number("step", step, 0)
        self.wait()
        memory = set(self.memory.restorable()) if self.memory is not None else set()  # every rank's
        if self.distributed:  # rank 0's view: every rank tries the same steps, so all restore the same one
            import torch.distributed as dist
            seen = [(set(self._local_steps()), dict.fromkeys(self._remote_or_nothing())) if self._owner else None]
            dist.broadcast_object_list(seen, src=0)
            local, remote = seen[0]
            local, elsewhere = self.sharing.restorable(self.layout, local)  # node-local: those on every node
            self._unrestorable.update(elsewhere)
        else:
            local, remote = set(self._local_steps()), self._remote_or_nothing()
        if step is not None:
            candidates = [step]
        else:
            candidates = sorted(memory | local | set(remote), reverse=True)
        if self.layout.loads_in_place and state is None:
            raise ValueError("under torch.distributed, restore needs the state to load into (DCP loads in place)")
        skipped = []
        for s in candidates:
            wheres = [w for w, there in (("memory", memory), ("local", local), ("remote", remote)) if s in there]
            if not wheres:
                skipped.append((s, "local", "not found"))
            for where in wheres:
                try:
                    out, path, stats = self._restore_one(s, where, state, device, strict)
                except VersionError:
                    raise
                except DAMAGE as e:
                    skipped.append((s, where, f"{type(e).__name__}: {e}"))
                    if where == "memory":
                        self.memory.damaged(s, f"{type(e).__name__}: {e}")
                    elif where == "local" and isinstance(e, CheckpointFormatError):  # not a passing I/O error
                        self._unrestorable[s] = f"{type(e).__name__}: {e}"
                    continue
                if skipped:
                    warnings.warn(f"gdsckpt: restored step {s} ({where}), not the newer " +
                                  "; ".join(f"step {a} ({b}): {c}" for a, b, c in skipped), stacklevel=2)
                if self.memory is not None and step is None:  # newer copies some rank lacks: another past
                    self.memory.restored(s)
                source = self.memory.source_of(s) if where == "memory" else where  # "peer": from a replica
                log.info("restored step %d from %s (%s)", s, source, path)
                return Restored(out, s, source, path, skipped, stats)
        if self.memory is not None and step is None:  # the run starts afresh: whatever some rank holds is a past
            self.memory.restored(-1)
        what = f"step {step}" if step is not None else "committed, intact step"
        raise NoCheckpointError(f"no {what} in {str(self.directory)!r}"
                                + (f" or {self.remote.url()}" if self.remote is not None else "")
                                + (": " + "; ".join(f"step {a} ({b}): {c}" for a, b, c in skipped) if skipped else "")
                                + self.sharing.why_not_restored())

    def _restore_one(self, step, where, state, device, strict):
        if where == "memory":
            return self.memory.load(step, state, device, strict)
        if where == "local":
            path = self.layout.path(step)
            out, stats = self.layout.load(path, state, device, strict)
            return out, str(path), stats
        with self.remote.fetched(step) as (path, label):  # checked against the upload's identity
            out, stats = self.layout.load(path, state, device, strict)
            return out, label, stats

    # ------------------------------------------------------------ lifetime
    def close(self, *, wait_uploads: bool = True, timeout: float | None = None) -> None:
        """Wait for the pending save; with the remote tier, for the upload queue to drain
        (wait_uploads) and the upload in flight to end, at most `timeout` seconds in all; then
        release the lock. An upload still running then keeps the lock until it ends.
        wait_uploads: UploadIncompleteError if a step to upload never reached the store."""
        if self._closed:
            return
        saved = False
        never_uploaded: list[int] = []
        unflushed: Exception | None = None
        try:
            self.wait()
            saved = True
        finally:
            self._closed = True
            if self.memory is not None:  # its writes to the directory first: they are uploaded next
                try:
                    self.memory.close(flush=saved)
                except Exception as e:  # the lock and the uploader still go; raised at the end
                    unflushed = e
            if self.remote is not None:  # the lock goes only once the uploader has ended
                never_uploaded = self.remote.close(wait=wait_uploads and saved, timeout=timeout, then=self._release)
            else:
                self._release()
        if unflushed is not None:
            raise GdsckptError(f"closing the Checkpointer of {str(self.directory)!r}: the newest step, held only in "
                               f"memory, could not be written to the directory ({type(unflushed).__name__}: "
                               f"{unflushed}); its memory copy is kept for the next manager") from unflushed
        if wait_uploads and never_uploaded:
            raise self.remote.incomplete_error(never_uploaded)

    def _release(self) -> None:
        self._retention.close()  # its deletions end before another manager may open the directory
        if self._lock is not None:
            self._lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self) -> str:
        p = self.policy
        return (f"Checkpointer({str(self.directory)!r}, keep={p.keep}, remote="
                f"{self.remote.url() if self.remote else None!r}, keep_remote={p.keep_remote}, "
                f"every_remote={p.every_remote}"
                + (f", memory=True, every_local={self.memory.every_local}" if self.memory else "") + ")")
