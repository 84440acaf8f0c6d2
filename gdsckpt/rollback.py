"""A rollback in progress, recorded in DIR/.gdsckpt-rollback.json before anything is removed,
so that a manager killed part-way finishes it when the directory is next opened, and a store
that cannot be reached gets its part done before any new upload (gdsckpt/remote_tier.py)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointFormatError
from .storage import fsync_dir

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
