"""The Checkpointer's retention and upload policy: the retention policies (which committed steps a
tier keeps), a frozen options dataclass validated once, and the pure decisions it makes (which
saves go to the store, which steps may go).

A retention policy is any object with `keep(steps) -> set of steps` (the RetentionPolicy
Protocol); LatestN(n) keeps the newest n (what keep=n means), KeepEvery(n) every step whose number
is a multiple of n, for good, and AnyOf (or `|`) what any of several keeps. The local, memory and
remote tiers apply a policy alike; keep=, keep_memory= and keep_remote= take one or an int n
(LatestN(n)).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from .interfaces import RetentionPolicy


def whole_number(name: str, value, minimum: int, why: str = "") -> int:
    """`value` as an int, or ValueError: an integer (int, or NumPy's) of at least `minimum`; a
    float, a bool or a string is refused, never rounded or parsed."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}" + (f" ({why})" if why else "") + f", got {value!r}")
    return int(value)


# ---------------------------------------------------------------- retention policies


class _Combinable:
    def __or__(self, other) -> AnyOf:
        return AnyOf(self, other)


@dataclass(frozen=True)
class LatestN(_Combinable):
    """The newest `n` steps (n >= 1): keep=n."""

    n: int

    def __post_init__(self):
        object.__setattr__(self, "n", whole_number("LatestN.n", self.n, 1, "the newest step is never deleted"))

    def keep(self, steps: Sequence[int]) -> set[int]:
        return set(list(steps)[-self.n:])


@dataclass(frozen=True)
class KeepEvery(_Combinable):
    """Every step whose number is a multiple of `n` (n >= 1), for good: the versions a team goes
    back to (fine-tunes from) long after the newest few have moved on."""

    n: int

    def __post_init__(self):
        object.__setattr__(self, "n", whole_number("KeepEvery.n", self.n, 1))

    def keep(self, steps: Sequence[int]) -> set[int]:
        return {s for s in steps if s % self.n == 0}


@dataclass(frozen=True, init=False)
class AnyOf(_Combinable):
    """What any of `policies` keeps: AnyOf(LatestN(3), KeepEvery(1000)), or LatestN(3) | KeepEvery(1000)."""

    policies: tuple

    def __init__(self, *policies):
        if not policies:
            raise ValueError("AnyOf needs at least one retention policy")
        for i, p in enumerate(policies):
            if not isinstance(p, RetentionPolicy):
                raise TypeError(f"AnyOf: argument {i} must be a retention policy (an object with keep(steps)), "
                                f"got {type(p).__name__} {p!r}")
        object.__setattr__(self, "policies", tuple(policies))

    def __repr__(self) -> str:
        return f"AnyOf({', '.join(map(repr, self.policies))})"

    def keep(self, steps: Sequence[int]) -> set[int]:
        steps = list(steps)
        return set().union(*(set(p.keep(steps)) for p in self.policies))


def retention(name: str, value, why: str = "the newest step is never deleted"):
    """`value` as given to keep=, keep_memory= or keep_remote=: a RetentionPolicy as it is, an int n
    (>= 1) as an int (LatestN(n)); anything else a ValueError naming `name`."""
    if isinstance(value, RetentionPolicy) and not isinstance(value, numbers.Number):
        return value
    return whole_number(name, value, 1, why)


def as_policy(value) -> RetentionPolicy:
    """An int n as LatestN(n); a policy as it is."""
    return LatestN(value) if isinstance(value, int) else value


def kept(policy: RetentionPolicy, steps: Sequence[int]) -> set[int]:
    """policy.keep(steps), as a set of the steps given (a policy naming others names nothing)."""
    return set(policy.keep(list(steps))) & set(steps)


# ---------------------------------------------------------------- the Checkpointer's policy


@dataclass(frozen=True)
class Policy:
    """keep: local retention, an int n (the newest n, >= 1) or a RetentionPolicy. keep_remote: the
    remote tier's, likewise (None: all). every_remote: upload the 1st, (1 + every_remote)th, ...
    step a manager saves (>= 1)."""

    keep: int | RetentionPolicy = 3
    keep_remote: int | RetentionPolicy | None = None
    every_remote: int = 1

    def __post_init__(self):
        object.__setattr__(self, "keep", retention("keep", self.keep))
        if self.keep_remote is not None:
            object.__setattr__(self, "keep_remote", retention("keep_remote", self.keep_remote, "or None: all"))
        object.__setattr__(self, "every_remote", whole_number("every_remote", self.every_remote, 1))

    def uploads(self, nth_save: int) -> bool:
        """Whether the manager's `nth_save` (1-based) goes to the store."""
        return (nth_save - 1) % self.every_remote == 0

    def doomed_local(self, local: list[int], damaged: set[int], protected: set[int], uploaded: set[int] | None,
                     remote: bool) -> list[int]:
        """The local steps (oldest first in `local`) that may go now: an intact one the policy does
        not keep (applied to the intact ones: a `damaged` step does not count, and with none intact
        nothing goes; the newest intact always stays); a damaged one older than every intact step,
        or that the policy would not keep were it intact (never one newer than every intact step);
        in both cases not `protected` (a save or upload waiting for it), and, with the remote tier
        on (`remote`), uploaded or older than an uploaded step: never the only copy of a step newer
        than what the store has."""
        intact = [s for s in local if s not in damaged]
        if not intact:
            return []
        policy = as_policy(self.keep)
        keeping = kept(policy, intact) | {intact[-1]}
        doomed = []
        for s in local:
            if s in damaged:  # as if intact: newer than every intact step, it would be the newest
                goes = s < intact[0] or (s < intact[-1] and s not in kept(policy, sorted(intact + [s])))
            else:
                goes = s not in keeping
            if not goes or s in protected:
                continue
            if remote and not (uploaded and (s in uploaded or max(uploaded) > s)):
                continue
            doomed.append(s)
        return doomed

    def doomed_remote(self, remote: list[int]) -> list[int]:
        """The uploaded steps (oldest first) that remote retention removes: never the newest."""
        if self.keep_remote is None or not remote:
            return []
        keeping = kept(as_policy(self.keep_remote), remote) | {remote[-1]}
        return [s for s in remote if s not in keeping]
