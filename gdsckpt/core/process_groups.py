"""The process group of gdsckpt's own, for the collectives it runs off the caller's thread.

dcp.async_save plans the step and writes its .metadata on a background thread, through
collectives (a gather of the plans, a scatter of the final ones, a gather of the write results).
On the default group these interleave with the training loop's own collectives, which the main
thread runs meanwhile (DDP's all_reduce, a loss averaged, a barrier): each rank pairs the two
threads' operations in its own order, and the ranks hang until the group's timeout (gloo) or
exchange the wrong buffers (NCCL). On a group of their own they pair only with each other.
"""

from __future__ import annotations

import datetime


def own_group():
    """A new process group of every rank of the default group, for collectives gdsckpt runs on a
    thread of its own. A collective: every rank calls it, in the same order, on the caller's
    thread (a Checkpointer makes it when constructed, which every rank does).

    Its backend is the default group's where that one serves CPU tensors (gloo, or
    "cpu:gloo,cuda:nccl"): DCP's collectives exchange pickled objects on the CPU, and
    dcp.async_save refuses a group without a CPU backend; else (NCCL alone) gloo. Its timeout is
    the default group's, so that a rank that never joins fails the save as it would fail the
    training's collectives."""
    import torch.distributed as dist
    config = dist.get_backend_config()
    backend = config if "cpu:" in config else "gloo"
    return dist.new_group(backend=backend, timeout=_default_timeout())


def _default_timeout() -> datetime.timedelta | None:
    """The default group's timeout (init_process_group's timeout=), or None (torch's default)
    where this torch does not say: torch has no public getter, so its backend's options are read."""
    import torch
    import torch.distributed as dist
    world = dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            timeout = world._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


_SHARED: list = []  # [(the default group, its own_group())]: the one made for calls on every rank alike


def shared_group():
    """own_group(), made once per default group, for calls that every rank makes alike and that
    run collectives off the caller's thread (gdsckpt.dcp.async_save with no process_group=); None
    where torch.distributed is not initialised. Made at the first such call, on every rank."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    if not _SHARED or _SHARED[0][0] is not world:  # a new default group (destroyed and made again)
        _SHARED[:] = [(world, own_group())]
    return _SHARED[0][1]
