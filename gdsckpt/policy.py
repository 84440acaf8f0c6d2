"""The Checkpointer's retention and upload policy: a frozen options dataclass, validated once,
and the pure decisions it makes (which saves go to the store, which steps may go)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    """keep: local steps kept (>= 1). keep_remote: remote steps kept (>= 1; None: all).
    every_remote: upload the 1st, (1 + every_remote)th, ... step a manager saves (>= 1)."""

    keep: int = 3
    keep_remote: int | None = None
    every_remote: int = 1

    def __post_init__(self):
        if self.keep < 1:
            raise ValueError(f"keep must be at least 1 (the newest step is never deleted), got {self.keep}")
        if self.keep_remote is not None and self.keep_remote < 1:
            raise ValueError(f"keep_remote must be at least 1 or None, got {self.keep_remote}")
        if self.every_remote < 1:
            raise ValueError(f"every_remote must be at least 1, got {self.every_remote}")

    def uploads(self, nth_save: int) -> bool:
        """Whether the manager's `nth_save` (1-based) goes to the store."""
        return (nth_save - 1) % self.every_remote == 0

    def doomed_local(self, local: list[int], protected: set[int], uploaded: set[int] | None,
                     remote: bool) -> list[int]:
        """The local steps (oldest first in `local`) that may go now: beyond the newest `keep`,
        not `protected` (a save or upload waiting for it), and, with the remote tier on
        (`remote`), uploaded or older than an uploaded step: never the only copy of a step
        newer than what the store has."""
        doomed = []
        for s in local[:-self.keep]:
            if s in protected:
                continue
            if remote and not (uploaded and (s in uploaded or max(uploaded) > s)):
                continue
            doomed.append(s)
        return doomed

    def doomed_remote(self, remote: list[int]) -> list[int]:
        """The uploaded steps (oldest first) that remote retention removes."""
        if self.keep_remote is None:
            return []
        return remote[:-self.keep_remote]
