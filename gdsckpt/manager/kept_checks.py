"""Which local steps a retention run checks (footer and index, once per version of a step's
files: StepLayout.damage), so that a run's cost does not grow with the steps kept.

What retention lets go depends on which of the newest steps are intact: a damaged one does not
count toward `keep`. A run checks
* every step of that window (the newest `keep` intact ones, and the damaged ones among them)
  that was never checked: new steps, and those the window reaches after a damaged one;
* the steps of the window already checked, again (whose files may have been changed since):
  all of them when the window holds at most RECHECKED steps (keep=3: every step, every run);
  of a larger window, the newest RECHECKED // 2 and RECHECKED // 2 more in turn, so that a step
  damaged in place is found within a bounded number of runs.
Steps older than the window go whatever their state, and are not checked. With a retention
policy other than an int (LatestN(n) is one), the window is the intact steps the policy keeps
and the damaged ones known."""

from __future__ import annotations

import bisect
import logging

from .policy import RetentionPolicy, kept

RECHECKED = 16

log = logging.getLogger("gdsckpt.manager.checkpointer")


class KeptChecks:
    """check(steps): checks `steps` (StepLayout.damage each), logging what it finds damaged."""

    def __init__(self, layout, keep: int | RetentionPolicy):
        self.layout, self.keep = layout, keep
        self._next = -1  # the turn's next step: the first one above it
        self._reported: set[int] = set()  # damaged steps already logged

    def check(self, steps: list[int], deep=()) -> dict[int, str]:
        """{step: why} of `steps` that are not intact (those in `deep`: every chunk checked);
        a newly found one is logged."""
        out = {}
        for s in steps:
            why = self.layout.damage(s, deep=s in deep)
            if why is not None:
                out[s] = why
                if s not in self._reported:
                    self._reported.add(s)
                    log.warning("gdsckpt: local step %d is damaged; it does not count toward keep=%r: %s", s,
                                self.keep, why)
        return out

    def damaged(self, local: list[int]) -> dict[int, str]:
        """{step: why} of the damaged steps of `local` (oldest first), as far as known, once the
        window's steps are checked as the module says."""
        again = True
        while True:
            found = {s: why for s, why in self.layout.known_damage().items() if _has(local, s)}
            window = self._window(local, found)
            todo = self.layout.unchecked(window)
            if again:
                again = False
                todo += self._again(window)
            if not todo:
                return found
            self.check(sorted(set(todo)))

    def _window(self, local: list[int], found: dict[int, str]) -> list[int]:
        if isinstance(self.keep, int):
            return local[-(self.keep + len(found)):]  # holds the newest `keep` intact steps
        keeping = kept(self.keep, [s for s in local if s not in found])
        return [s for s in local if s in keeping or s in found]

    def _again(self, window: list[int]) -> list[int]:
        if len(window) <= RECHECKED:
            return window
        half = RECHECKED // 2
        newest, rest = window[-half:], window[:-half]
        i = bisect.bisect_right(rest, self._next)
        turn = rest[i:i + half]
        turn += rest[:half - len(turn)]  # from the oldest again
        self._next = turn[-1]
        return newest + turn


def _has(sorted_steps: list[int], step: int) -> bool:
    i = bisect.bisect_left(sorted_steps, step)
    return i < len(sorted_steps) and sorted_steps[i] == step
