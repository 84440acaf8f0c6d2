"""gdsckpt.dcp.save / async_save / load: torch.distributed.checkpoint through gdsckpt in one
call, set up as its fast path needs:

    gdsckpt.dcp.reserve(dcp_view(state))              # optional, before the loop: the staging's pool
    fut = gdsckpt.dcp.async_save(state, "ckpt/step2000")
    gdsckpt.dcp.load(state, "ckpt/step2000")          # into the objects, resharded by DCP

- the state as DCP takes it (stateful.dcp_view: modules and optimizers through torch's
  get_/set_model_state_dict and get_/set_optimizer_state_dict), its state_dict() taken once here;
- GdsckptWriter(path, ...) as the storage writer and its async stager;
- CachedSavePlanner: no plan exchange after the first save (without it DCP gathers every rank's
  plan on its background thread each save, holding the GIL beside the training);
- the optimizer `state` holds itself (one torch.optim.Optimizer object, whose step takes hooks)
  overlapping the snapshot with the next forward/backward, as gdsckpt.save_async infers it: where
  every tensor of the state is that optimizer's parameters' or state's memory, and neither
  optimizer= nor snapshot= is given.

A first save without reserve() takes its compressed staging from a copy of the state on its GPU,
off the call, where half the GPU's free memory holds it (device_copy.copy_first); reserve() makes
the pool ahead of need instead (call it before the loop: a reservation still growing the pool
makes a first save grow it in its call).
"""

from __future__ import annotations

import os

from gdsckpt.core.process_groups import shared_group
from gdsckpt.writing.snapshot.overlap import fencing_optimizer
from gdsckpt.format.stateful import dcp_view, dcp_write_back
from .planner import CachedSavePlanner, RankStateLoadPlanner
from .reader import GdsckptReader
from .staging import state_tensors, stateful_values
from .writer import GdsckptWriter

__all__ = ["save", "async_save", "load"]


def _state_dict(state) -> dict:
    """`state`'s DCP view with each Stateful's state_dict() taken, as DCP would take it."""
    return stateful_values(dcp_view(state))


def _writer_options(state, state_dict: dict, writer_options: dict) -> dict:
    """writer_options with the optimizer whose step alone changes every tensor of the state (the
    one it holds itself, or the one that stepped: overlap.fencing_optimizer), where the overlap is
    inferred."""
    if "optimizer" in writer_options or "snapshot" in writer_options or "async_staging" in writer_options:
        return writer_options
    opt = fencing_optimizer(state, state_tensors(state_dict))
    return writer_options if opt is None else {**writer_options, "optimizer": opt}


def async_save(state, path: str | os.PathLike, *, process_group=None, **writer_options):
    """dcp.async_save of `state` (gdsckpt's state: modules, optimizers, plain values, as
    gdsckpt.save takes it) into the DCP directory `path`, through GdsckptWriter and
    CachedSavePlanner. writer_options: GdsckptWriter's (codec, snapshot, optimizer, ...). Returns
    what dcp.async_save returns: DCP's AsyncSaveResponse where the snapshot overlaps (its
    `staging_completion`, `upload_completion`), else a Future of the metadata. process_group:
    where DCP's collectives run, on its background thread; by default a group of gdsckpt's own
    (process_groups.shared_group), never the default group the training's collectives use."""
    import torch.distributed.checkpoint as dcp
    state_dict = _state_dict(state)
    writer = GdsckptWriter(path, **_writer_options(state, state_dict, writer_options))
    return dcp.async_save(state_dict, storage_writer=writer, planner=CachedSavePlanner(),
                          process_group=process_group if process_group is not None else shared_group())


def save(state, path: str | os.PathLike, *, process_group=None, **writer_options):
    """dcp.save of `state` into `path` through GdsckptWriter and CachedSavePlanner; durable on
    return (DCP's Metadata returned). writer_options: GdsckptWriter's save options."""
    import torch.distributed.checkpoint as dcp
    writer = GdsckptWriter(path, **writer_options)
    return dcp.save(_state_dict(state), storage_writer=writer, planner=CachedSavePlanner(),
                    process_group=process_group)


def load(state, path: str | os.PathLike, *, strict: bool = True, process_group=None):
    """dcp.load of the DCP directory `path` into `state` (as gdsckpt.load_into takes it): tensors
    into the state's own (resharded by DCP where the world or the sharding changed), objects
    through load_state_dict(), plain values written back. strict: a key the step lacks, or a
    tensor of another dtype or shape, is a StateMismatchError naming it before anything is read."""
    import torch.distributed.checkpoint as dcp
    view = dcp_view(state)
    dcp.load(view, storage_reader=GdsckptReader(path), planner=RankStateLoadPlanner(view, strict),
             process_group=process_group)
    dcp_write_back(state, view)
