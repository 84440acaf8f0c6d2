"""CachedSavePlanner: DCP's DefaultSavePlanner with plan caching, reused only while nothing changed."""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

__all__ = ["CachedSavePlanner"]


class CachedSavePlanner(DefaultSavePlanner):
    """DCP's DefaultSavePlanner with its plan caching on, and stricter about when a cached plan
    may be reused.

    Without caching, every save gathers each rank's pickled plan (a write item per tensor) on
    the coordinator and scatters the global plan back. Under dcp.async_save that runs in the
    training process's background thread, holding the GIL: with 1,748 tensors per rank on 2x
    H200, ~0.5 s of GIL per save, which the first training step after the save lost
    (py-spy --gil, bench/results/2026-11-23-h200x2-gil/). With caching, a rank whose plan is
    unchanged sends an empty plan and every rank reuses its cached final plan.

    DCP decides "unchanged" from keys, offsets and sizes only (torch 2.11-2.13), so a tensor
    whose dtype changed would be saved under a cached plan and metadata naming the old dtype.
    Here a cached plan is reused only if every write item is equal, dtype, layout and all;
    otherwise the rank sends its full plan, as on a first save.

    DCP keeps its caches per process and key, and a cached final plan holds the storage
    writer's own data (GdsckptWriter's file prefix): saves through another storage writer
    (FileSystemWriter for exports, say) need a planner with another `cache_key`, or they would
    be handed this writer's plans."""

    def __init__(self, cache_key: str = "GdsckptWriter", **kwargs: Any):
        super().__init__(enable_plan_caching=True, **kwargs)
        self._cached_plans_key = f"{type(self).__name__}:{cache_key}"

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        if not plan.usable:
            cached = SavePlanner._cached_save_plan.get(self._cached_plans_key)
            if cached is None or cached.items != self.plan.items:
                self._pending_local_plan = self.plan  # cached once the global plan succeeds
                return self.plan
        return plan
