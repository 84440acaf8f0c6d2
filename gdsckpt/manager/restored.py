"""What Checkpointer.restore() returns."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass
class Restored:
    """What restore() did. `state` is the caller's state (filled in place) or a new one;
    `source` is where the step came from: "memory", "peer" (this rank's copy came from another
    node's replica), "local" or "remote"; `skipped` lists the newer
    steps (or copies) it could not use, as (step, "memory" | "local" | "remote", why)."""

    state: object
    step: int
    source: str
    path: str
    skipped: list = field(default_factory=list)
    stats: object = None

    def __repr__(self) -> str:  # not the state: a model's worth of tensors
        keys = f", keys={len(self.state)}" if isinstance(self.state, Mapping) else ""
        return (f"Restored(step={self.step}, source={self.source!r}{keys}, path={self.path!r}"
                + (f", skipped={len(self.skipped)}" if self.skipped else "") + ")")
