"""A rollback in progress, recorded in DIR/.gdsckpt-rollback.json before anything is removed,
so that a manager killed part-way finishes it when the directory is next opened, and a store
that cannot be reached gets its part done before any new upload (gdsckpt/manager/remote/tier.py); and
Checkpointer.rollback() (Rollbacks, the Checkpointer's part that rolls back)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

from gdsckpt.errors import CheckpointFormatError, GdsckptError, NoCheckpointError
from .policy import whole_number
from gdsckpt.core.storage import fsync_dir

log = logging.getLogger("gdsckpt.manager.checkpointer")

JOURNAL_NAME = ".gdsckpt-rollback.json"


@dataclass(frozen=True)
class PendingRollback:
    """What a rollback has still to remove: the directory's steps newer than `local_to`, and the
    store's newer than `store_to` (None: done)."""

    local_to: int | None
    store_to: int | None


class RollbackJournal:
    def __init__(self, directory: Path):
        self.path = directory / JOURNAL_NAME

    def read(self) -> PendingRollback | None:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            doc = json.loads(raw)
            pending = PendingRollback(local_to=doc["local_to"], store_to=doc["store_to"])
            if not all(v is None or (type(v) is int and v >= 0) for v in (pending.local_to, pending.store_to)):
                raise ValueError(doc)
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointFormatError(f"a rollback's record is damaged ({type(e).__name__}: {e}); the rollback it "
                                        "recorded may be unfinished: call rollback(step) again, or remove the "
                                        "file", path=self.path) from None
        return pending

    def write(self, pending: PendingRollback | None) -> None:
        """Durably: the record (None: the rollback is done, no record)."""
        if pending is None or pending == PendingRollback(None, None):
            self.path.unlink(missing_ok=True)
        else:
            tmp = self.path.with_name(self.path.name + ".new")
            with open(tmp, "w") as f:
                json.dump({"local_to": pending.local_to, "store_to": pending.store_to}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        fsync_dir(self.path.parent)


class Rollbacks:
    """Checkpointer's rollback(), and the pending rollback's view of the local steps (a mixin:
    the attributes are the Checkpointer's)."""

    def rollback(self, step: int) -> list[int]:
        """Go back to `step`: every newer step is removed, here and on the store, so that nothing
        brings it back (a fresh manager's restore() included), and save(step + k) works. Call it
        on every rank under torch.distributed. Recorded before anything goes, so a manager killed
        part-way finishes it when the directory is next opened; a store that cannot be reached
        has its part done before any upload (meanwhile its newer steps do not count: status()'s
        'rollback_pending'). Returns the steps removed (the store's once reached)."""
        step = whole_number("step", step, 0)
        self._writable(f"roll back to step {step}")
        self.wait()
        gone: list[int] = []
        # No retention from the check to the removals: a local write ending meanwhile must not
        # count toward `keep` and let go of the step rolled back to.
        with self._deleting:
            known = [step in self.steps()]
            if self.distributed:  # rank 0's view, so every rank rolls back or refuses alike (node-local
                import torch.distributed as dist  # directories: the other nodes' hold no .metadata)
                dist.broadcast_object_list(known, src=0)
            if not known[0]:
                raise NoCheckpointError(f"no step {step} to roll back to in {str(self.directory)!r}"
                                        + (f" or {self.remote.url()}" if self.remote is not None else ""))
            self._fork_lineage()
            if self.memory is not None and not self._owner:  # every rank's own tier; the owner's: below
                gone = self.memory.drop_newer_than(step)
            if self._owner:
                prev = self._rollback.store_to if self._rollback is not None else None
                store_to = min(step, prev) if prev is not None else (step if self.remote is not None else None)
                # (a pending store part stays: nothing newer than `prev` has been uploaded since)
                gone = self._resume_rollback(PendingRollback(local_to=step, store_to=store_to))
        self.layout.barrier()
        return gone

    def _share_rollback(self, found: PendingRollback | None, failed: BaseException | None) -> None:
        """Under torch.distributed, at open: the rollback record the owner found and acted on
        reaches every rank (a collective: every rank opens the directory). Each drops its own
        memory copies newer than it, and keeps the directory's part pending only while the
        owner does (a read-only owner, which cannot finish it); the store's part is the owner's.
        GdsckptError on every rank if the owner could not read or act on the record."""
        import torch.distributed as dist
        box = [(found, self._rollback, None if failed is None else f"{type(failed).__name__}: {failed}")
               if self._owner else None]
        dist.broadcast_object_list(box, src=0)
        if self._owner:
            return
        found, left, error = box[0]
        if error is not None:
            raise GdsckptError(f"rank 0 could not finish the rollback recorded in {str(self._journal.path)!r}: "
                               f"{error}")
        if found is not None and found.local_to is not None and self.memory is not None:
            self.memory.drop_newer_than(found.local_to)
        self._rollback = None if left is None or left.local_to is None else PendingRollback(left.local_to, None)

    def abandoned(self) -> dict[str, list[int]]:
        """The steps a pending rollback gives up that are still here and on the store:
        {"local": [steps], "remote": [steps]}. They do not count; a manager that can write the
        directory removes them as it opens it."""
        p = self._rollback
        local = [s for s in self.layout.local_steps() if p is not None and p.local_to is not None and s > p.local_to]
        remote = self.remote.newer_than(p.store_to) if p is not None and p.store_to is not None and self.remote else []
        return {"local": local, "remote": remote}

    def _resume_rollback(self, pending: PendingRollback) -> list[int]:
        """Do what `pending` still has to: the directory's part at once, the store's through the
        remote tier (a read-only manager or a rank that does not own the directory: nothing is
        removed, the steps only stop counting). The caller holds `_deleting`: no retention meanwhile."""
        acts = self._lock is not None and self._owner  # (node-local directories: the others follow at a save)
        gone: set[int] = set()
        with self._rolling:
            if acts:
                self._journal.write(pending)
            self._rollback = pending
            if self.memory is not None and pending.local_to is not None:
                gone.update(self.memory.drop_newer_than(pending.local_to))
            if acts and pending.local_to is not None:
                for s in reversed([s for s in self.layout.local_steps() if s > pending.local_to]):
                    log.info("gdsckpt: rollback to step %d: removing step %d (%s)", pending.local_to, s,
                             self.layout.path(s))
                    self.layout.delete(s)
                    gone.add(s)
                self._rollback_done(local=True)
        store_to = self._rollback.store_to if self._rollback is not None else None
        if store_to is not None and self.remote is not None:
            removed = self.remote.abandon_newer_than(store_to, then=lambda: self._rollback_done(store_to=store_to),
                                                     remove=acts)
            gone |= set(removed or ())
        return sorted(gone)

    def _rollback_done(self, *, local: bool = False, store_to: int | None = None) -> None:
        """Record a part of the pending rollback done: the directory's (local), or the store's
        for `store_to` (unless a later rollback has replaced it)."""
        with self._rolling:
            p = self._rollback
            if p is None:
                return
            if local:
                p = replace(p, local_to=None)
            if store_to is not None and p.store_to == store_to:
                p = replace(p, store_to=None)
            if self._lock is not None and self._owner:
                self._journal.write(p)
            self._rollback = None if p == PendingRollback(None, None) else p

    def _local_steps(self) -> list[int]:
        """The committed local steps, less those a pending rollback abandoned (a read-only manager's view)."""
        local = self.layout.local_steps()
        p = self._rollback
        if p is not None and p.local_to is not None:
            local = [s for s in local if s <= p.local_to]
        return local
