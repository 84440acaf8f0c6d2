"""The Checkpointer's interfaces: how a tier keeps its steps in a directory (`StepLayout`: a file
per step, or a DCP directory per step; gdsckpt/manager/steps.py) and which of them it keeps
(`RetentionPolicy`; gdsckpt/manager/policy.py has LatestN, KeepEvery and AnyOf).

A step's life through a StepLayout, as the Checkpointer drives it:

    layout.save(step, state) | layout.save_async(step, state, optimizer)   # committed: a step
    layout.noted(step)                           # recorded without listing the directory again
    layout.local_steps(); layout.damage(step)    # what retention weighs (RetentionPolicy.keep)
    layout.delete(step)                          # what the policy lets go (never through a link)
    layout.files(step) / layout.fetched(step, store)   # the object-store tier's upload, download
    layout.load(layout.path(step), state, device, strict)   # a restore, newest intact step first
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import ContextManager, Protocol, runtime_checkable


class StepLayout(Protocol):
    directory: Path
    distributed: bool
    loads_in_place: bool  # restore needs the caller's state to load into

    def name(self, step: int) -> str: ...

    def path(self, step: int) -> Path: ...

    def committed(self, path: Path) -> bool: ...

    def local_steps(self) -> list[int]:
        """Committed steps in the directory, oldest first."""

    def save(self, step: int, state) -> object:
        """Durable and committed on return; gdsckpt's Stats, or None."""

    def save_async(self, step: int, state, optimizer) -> Future:
        """`state` may be mutated on return; the step is committed once the future completes."""

    def reserve(self, state, wait: bool) -> Future:
        """The host memory save_async of `state` takes, made ahead of need on a background thread:
        a Future of a gdsckpt.Reservation (None where the save takes none of gdsckpt's)."""

    def load(self, path: Path, state, device, strict: bool) -> tuple[object, object]:
        """(the restored state, gdsckpt's Stats or None) of the step at `path`; DAMAGE if it is
        damaged or incomplete."""

    def delete(self, step: int) -> None:
        """Uncommit, then remove the step (a kill mid-way leaves nothing that counts); a step that
        is a symlink, or a link inside its directory, is unlinked, never followed (step_removal)."""

    def files(self, step: int) -> list[tuple[Path, str]]:
        """(local file, name relative to the store's prefix) of the step, its commit point last."""

    def fetched(self, step: int, store) -> ContextManager[tuple[Path, str]]:
        """The step brought from `store` (a gdsckpt.stores.Store): (local path, what to
        call it) while the context lasts."""

    def leftovers(self) -> list[Path]:
        """What killed restores left in the directory, for the lock holder to remove."""

    def barrier(self) -> None:
        """Every rank reaches this point before any goes on (one process: nothing to wait for)."""

    def damage(self, step: int, deep: bool = False) -> str | None:
        """Why the committed step is not intact, or None (step_damage); each check runs once per
        version of the step's files."""

    def known_damage(self) -> dict[int, str]:
        """{step: why} of the local steps found damaged so far."""

    def unchecked(self, steps: list[int]) -> list[int]:
        """Those of `steps` damage() has not looked at (its findings are in known_damage)."""

    def noted(self, step: int) -> None:
        """This process has just committed or removed the step: local_steps() records it without
        listing the directory again."""


@runtime_checkable
class RetentionPolicy(Protocol):
    """Which committed steps a tier keeps.

    keep(steps) is given a tier's committed step numbers, oldest first (newest last), and returns
    those it keeps; the others may go. It is called from the Checkpointer's retention thread after
    every commit and upload (and by prune()), and by the memory tier before each new copy (the
    new step included) and after each commit: many times, with lists that overlap, so it must
    depend on `steps` alone (no state kept between calls). Whatever it returns, a tier never
    deletes its newest intact step, a step being saved, uploaded or read, nor (with the remote
    tier on) a local step newer than what the store has."""

    def keep(self, steps: Sequence[int]) -> Collection[int]: ...
