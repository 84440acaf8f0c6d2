"""The Checkpointer's retention and upload policy: a frozen options dataclass, validated once,
and the pure decisions it makes (which saves go to the store, which steps may go)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass


def whole_number(name: str, value, minimum: int, why: str = "") -> int:
    """`value` as an int, or ValueError: an integer (int, or NumPy's) of at least `minimum`; a
    float, a bool or a string is refused, never rounded or parsed."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}" + (f" ({why})" if why else "") + f", got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Policy:
    """keep: local steps kept (>= 1). keep_remote: remote steps kept (>= 1; None: all).
    every_remote: upload the 1st, (1 + every_remote)th, ... step a manager saves (>= 1)."""

    keep: int = 3
    keep_remote: int | None = None
    every_remote: int = 1

    def __post_init__(self):
        object.__setattr__(self, "keep", whole_number("keep", self.keep, 1, "the newest step is never deleted"))
        if self.keep_remote is not None:
            object.__setattr__(self, "keep_remote", whole_number("keep_remote", self.keep_remote, 1, "or None: all"))
        object.__setattr__(self, "every_remote", whole_number("every_remote", self.every_remote, 1))

    def uploads(self, nth_save: int) -> bool:
        """Whether the manager's `nth_save` (1-based) goes to the store."""
        return (nth_save - 1) % self.every_remote == 0

    def doomed_local(self, local: list[int], damaged: set[int], protected: set[int], uploaded: set[int] | None,
                     remote: bool) -> list[int]:
        """The local steps (oldest first in `local`) that may go now: older than the newest
        `keep` intact ones (a `damaged` step does not count, and with none intact nothing goes),
        not `protected` (a save or upload waiting for it), and, with the remote tier on
        (`remote`), uploaded or older than an uploaded step: never the only copy of a step
        newer than what the store has."""
        intact = [s for s in local if s not in damaged]
        if not intact:
            return []
        oldest_kept = intact[-self.keep:][0]
        doomed = []
        for s in local:
            if s >= oldest_kept:
                break
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
