"""CachedSavePlanner: DCP's DefaultSavePlanner with plan caching, reused only while nothing changed.
RankStateLoadPlanner: DCP's DefaultLoadPlanner that passes over a rank's own state the step lacks."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, SavePlanner

from ..errors import StateMismatchError
from .metadata import PreparedMetadata
from .standins import STAND_INS

__all__ = ["CachedSavePlanner", "RankStateLoadPlanner"]


@dataclass
class _PlannedLayout:
    """The flattened state dict a cached local plan was made from, where every tensor in it
    was a stand-in (standins.py): its keys in order, the stand-ins (None for another value)
    and DCP's flattening mappings."""

    plan: SavePlan  # the local plan (DCP's _cached_save_plan entry) made from it
    keys: tuple[str, ...]
    values: tuple  # the stand-in at each key, None where the value is not a tensor
    mappings: dict

    def holds_for(self, state_dict: dict, mappings: dict) -> bool:
        """The state dict has the same keys, the same stand-in objects and plain values where
        this one had them: its local plan is this one's (a stand-in never changes)."""
        if len(state_dict) != len(self.keys) or mappings != self.mappings:
            return False
        for (key, value), want_key, want in zip(state_dict.items(), self.keys, self.values):
            if key != want_key or (value is not want if want is not None else not _one_byte_item(value)):
                return False
        return True


def _one_byte_item(value) -> bool:
    """A value DCP writes as one BYTE_IO item whatever it holds (not a tensor, nor an object
    that plans its own write items)."""
    return not isinstance(value, torch.Tensor) and not hasattr(value, "__create_write_items__") \
        and type(value).__name__ != "ShardedTensor"


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

    DCP still builds the local plan (a write item per tensor) to compare it, every save. For
    the state dicts GdsckptWriter's compressed staging makes, whose tensors are stand-ins that
    are handed out again while their layout holds (standins.py), the comparison is one of
    objects: the same keys holding the same stand-ins means the same plan, and no plan is
    built.

    DCP keeps its caches per process and key, and a cached final plan holds the storage
    writer's own data (GdsckptWriter's file prefix): saves through another storage writer
    (FileSystemWriter for exports, say) need a planner with another `cache_key`, or they would
    be handed this writer's plans."""

    _planned_layouts: ClassVar[dict[str, _PlannedLayout]] = {}  # cache key -> its cached local plan's layout

    def __init__(self, cache_key: str = "GdsckptWriter", **kwargs: Any):
        super().__init__(enable_plan_caching=True, **kwargs)
        self._cached_plans_key = f"{type(self).__name__}:{cache_key}"

    def create_local_plan(self) -> SavePlan:
        key = self._cached_plans_key
        cached = SavePlanner._cached_save_plan.get(key)
        known = CachedSavePlanner._planned_layouts.get(key)
        if cached is not None and known is not None and known.plan is cached \
                and known.holds_for(self.state_dict, self.mappings):
            self.plan = cached
            return SavePlan([], usable=False)
        plan = super().create_local_plan()
        if not plan.usable:
            if cached is None or cached.items != self.plan.items:
                self._pending_local_plan = self.plan  # cached once the global plan succeeds
                plan = self.plan
            else:
                self._remember_layout(cached)
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        # The coordinator's Metadata, which DCP pickles to every rank after the commit: one
        # that pickles as the `.metadata` file's pickle, prepared once per layout
        # (metadata.PreparedMetadata), kept in DCP's cache in place of the plain one.
        plans, metadata = super().create_global_plan(all_plans)
        prepared = PreparedMetadata.of(metadata)
        if SavePlanner._cached_metadata.get(self._cached_plans_key) is metadata:
            SavePlanner._cached_metadata[self._cached_plans_key] = prepared
        self.metadata = prepared
        return plans, prepared

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        pending = getattr(self, "_pending_local_plan", None)
        finished = super().finish_plan(new_plan)
        if pending is not None and SavePlanner._cached_save_plan.get(self._cached_plans_key) is pending:
            self._remember_layout(pending)
        return finished

    def _remember_layout(self, plan: SavePlan) -> None:
        """Note the flattened state `plan` was made from, if all its tensors are stand-ins."""
        values = tuple(v if isinstance(v, torch.Tensor) else None for v in self.state_dict.values())
        if all(v is None or STAND_INS.made(v) for v in values):
            CachedSavePlanner._planned_layouts[self._cached_plans_key] = _PlannedLayout(
                plan, tuple(self.state_dict), values, dict(self.mappings))
        else:
            CachedSavePlanner._planned_layouts.pop(self._cached_plans_key, None)


class RankStateLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner for a Checkpointer's restore of a view (stateful.dcp_view).

    - Keys of this rank's own state (stateful.rank_key: its RNG()) the step may not hold (saved by
      fewer ranks, or by a gdsckpt before such keys): such a value is left as it is, with a warning
      (`left_as_is` set on it, so that its load_state_dict does nothing), instead of failing the
      whole load for a missing key.
    - strict: a key the checkpoint lacks, or a tensor whose dtype or shape differs from the
      checkpoint's, is a StateMismatchError naming it, before anything is read (DCP's own planner
      converts the dtype); else keys missing from the checkpoint are left alone (allow_partial_load).
      Keys the checkpoint has beyond the state are not refused: other ranks' own keys are there."""

    def __init__(self, view, strict: bool = True):
        super().__init__(allow_partial_load=not strict)
        self._view, self._strict = view, strict

    def create_local_plan(self) -> LoadPlan:
        held = self.metadata.state_dict_metadata
        for top in self._view.rank_keys:
            mine = [k for k in self.state_dict if k == top or k.startswith(top + ".")]
            if mine and not any(k in held for k in mine):
                warnings.warn(f"gdsckpt: {top!r} is not in the checkpoint (saved by fewer ranks, or by an older "
                              "gdsckpt): this rank's generators are left as they are", stacklevel=2)
                for k in mine:
                    del self.state_dict[k]
                self._view[top].left_as_is = True
        if self._strict:
            missing = [k for k in self.state_dict if k not in held]
            if missing:
                more = " and more" if len(missing) > 5 else ""
                raise StateMismatchError(f"{', '.join(map(repr, missing[:5]))}{more} not in the checkpoint "
                                         "(restore(strict=False) leaves them alone)")
            for key, value in self.state_dict.items():
                md = held.get(key)
                if isinstance(value, torch.Tensor) and isinstance(md, TensorStorageMetadata) and (
                        md.properties.dtype != value.dtype or tuple(md.size) != tuple(value.shape)):
                    raise StateMismatchError(
                        f"tensor {key!r} is {md.properties.dtype}{list(md.size)} in the checkpoint but "
                        f"{value.dtype}{list(value.shape)} in the state (restore(strict=False) loads it converted)")
        return super().create_local_plan()
