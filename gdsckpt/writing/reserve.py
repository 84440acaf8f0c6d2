"""gdsckpt.reserve: the host memory a save will need, allocated and page-locked ahead of need on
a background thread, so that the first save blocks no longer than a steady one.

    gdsckpt.reserve(state)                      # before the loop: returns at once
    ...                                         # training goes on meanwhile
    fut = gdsckpt.save_async(state, path)       # takes what is reserved so far, allocates no more than it may

A first save_async allocates its host pool (pinned_pool.py), and page-locked memory costs
~0.25-0.5 s per GB (H100, 2026-11-24). Unreserved, that save either copies the state on the GPU
and grows the pool from the copy off the call (async_save._copied_save, where the GPU has room),
or grows it inside the call, blocking about as long as a synchronous save. A reservation, on its
own thread:

1. warms the backend a save of `state` runs on: tiny snapshots (random bytes per dtype of
   `state`, on its device, discarded), which make the per-device codecs (every candidate of
   codec="auto"), kernels and streams a first save would make inside its call; then makes
   codec="auto"'s per-stream choice from `state`'s own bytes, which a first save would sample
   in its call (~20 ms on the H100 for a 4.9 GB GPT state) and later saves reuse;
2. grows the device's pool (pinned_pool.pool_for) to save_async's bound for `state`
   (async_save.default_pool_limit of its plan, or pool_bytes=), an arena at a time without
   holding the pool's lock (PinnedPool.grow): a save that starts meanwhile takes the arenas
   already there and grows only into what the reservation is not allocating, so that the
   pool never holds more than the bound. Reserved again, a pool that holds its bound
   allocates nothing.

The pool stays bounded as save_async bounds it: release_pools() frees it (and stops a
reservation in progress), a save with a smaller bound trims it. Checkpointer.reserve reserves
what a Checkpointer's next save needs, the memory tier's slots included (`reserve_memory`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from .snapshot import modes as snapshot_modes
from .async_save import check_pool_bytes, default_pool_limit
from gdsckpt.codecs import GPU_AUTO_PLANES
from gdsckpt.core.defaults import CODEC_SAMPLE_PIECE_BYTES
from gdsckpt.engine.device_copy import cuda_device_of, on_device
from gdsckpt.core.dtypes import name_of
from gdsckpt.manager.memory.snapshot import slot_bytes
from gdsckpt.engine.pinned_pool import align_up, pool_for
from gdsckpt.format.plan import Plan, make_plan
from gdsckpt.engine.ring import Completion
from gdsckpt.format.stateful import unstepped_parameters
from .save import SaveOptions, Sink, Snapshot, backend_kind, choose_codecs_ahead, save_flat, tensor_specs
from gdsckpt.format.tree import Leaf, flatten

__all__ = ["reserve", "reserve_planned", "Reservation", "Planned", "plan_for", "reserve_memory", "in_background"]

# The warm-up snapshot's bytes per dtype: one codec-choice sample piece, so that codec="auto"
# samples it with every candidate codec (on the GPU: byte-plane ANS's nvCOMP codec and shuffle
# kernel too, not only the typed ANS that zeros picked). Below it nothing was sampled, and a first
# save on a fresh host compiled and made them in its call: 1.03 s blocked, 0.12 s steady
# (H100, 2026-11-24, bench/results/2026-11-24-h100-drift/).
WARM_BYTES = CODEC_SAMPLE_PIECE_BYTES


@dataclass
class Reservation:
    """What a reservation did: `allocated_bytes` (0: everything was there already) in `seconds`,
    of which `warm_s` warming the backend and `alloc_s` allocating (and page-locking)."""

    where: str  # "pool cuda:0", "pool cpu", or "memory <the tier's folder>"
    limit_bytes: int  # the pool's bound, or the memory tier's cap
    held_bytes: int  # what the pool (the tier) holds after it
    allocated_bytes: int
    pinned: bool  # page-locked: the bytes come from a GPU
    seconds: float
    warm_s: float
    alloc_s: float
    slots: int = 0  # the memory tier's slots made


@dataclass
class Planned:
    """A state planned as its save would plan it: the chunks (the bounds follow from them), the
    backend it runs on, the CUDA device whose pool and backend it uses, per dtype the device
    of its first tensor (where the warm-up's sample goes), and the state's leaves (whose bytes
    the codec choice samples)."""

    plan: Plan
    options: SaveOptions
    kind: str  # "gpu" or "cpu"
    device: int | None
    samples: dict  # torch.dtype -> torch.device
    leaves: list[Leaf]


def plan_for(state, save_options: dict) -> Planned:
    """Check `state` and the options as save_async does (the same typed errors, before anything
    runs) and plan it. An optimizer in it that holds no state yet is warned of: before its first
    step it holds no moments, so the plan (and a reservation) would be sized without them.
    snapshot= (save_async's) is checked and changes nothing: every mode compresses into the pool."""
    save_options = dict(save_options)
    snapshot_modes.lookup(save_options.pop("snapshot", Snapshot.HOST), snapshot_modes.SAVE_ASYNC)
    options = SaveOptions(**save_options)
    for key in _optimizers_without_state(state):
        warnings.warn(f"gdsckpt.reserve: the optimizer at {key or 'the top'!r} holds no state yet: if it keeps "
                      "some once it steps (AdamW's moments: two thirds of the state), the reservation is sized "
                      "without it; reserve after its first step", stacklevel=3)
    _, leaves = flatten(state)
    kind = backend_kind(leaves, options)
    plan = make_plan(tensor_specs(leaves), lambda dtype: None, options.chunk_bytes_for(kind))  # bounds: no codec
    device = None
    if kind == "gpu":  # the device save_async makes current (else the caller's current one)
        device = cuda_device_of(l.tensor for l in leaves)
        device = torch.cuda.current_device() if device is None else device
    samples = {}
    for l in leaves:
        samples.setdefault(l.tensor.dtype, l.tensor.device)
    return Planned(plan, options, kind, device, samples, leaves)


def _optimizers_without_state(obj, path: str = "", depth: int = 0) -> list[str]:
    """Where in `state` an optimizer (the object, or its state_dict()) has parameters but no
    state, where it keeps some once it steps (stateful.unstepped_parameters): the top-level values
    and the containers under them."""
    if isinstance(obj, torch.optim.Optimizer):
        return [path] if unstepped_parameters(obj.state, obj.param_groups) else []
    if not isinstance(obj, (dict, list, tuple)) or depth > 8:
        return []
    if isinstance(obj, dict) and obj.keys() == {"state", "param_groups"}:  # an optimizer's state_dict()
        if unstepped_parameters(obj["state"], obj["param_groups"]):
            return [path]
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    return [found for k, v in items for found in _optimizers_without_state(v, f"{path}/{k}" if path else str(k), depth + 1)]


def reserve(state, *, pool_bytes: int | None = None, wait: bool = False, **save_options) -> Future:
    """Reserve the host pool a save_async of `state` needs (with these save_options and
    pool_bytes, as save_async takes them), on a background thread; a Future of a Reservation.
    wait=True: return once it is done (raising its error). Bad input raises here, before
    anything runs, as save_async raises it."""
    check_pool_bytes(pool_bytes)
    return reserve_planned(plan_for(state, save_options), pool_bytes, wait)


def reserve_planned(planned: Planned, pool_bytes: int | None, wait: bool) -> Future:
    """reserve() of a state already planned (plan_for)."""
    bound = max(pool_bytes or default_pool_limit(planned.plan), align_up(planned.options.chunk_bytes_for(planned.kind)))
    return in_background(lambda stop: reserve_pool(planned, bound, stop), planned.device, wait)


def reserve_pool(planned: Planned, bound: int, stop: Callable[[], bool]) -> Reservation:
    """Warm the backend, then grow the device's pool to `bound` (on the reservation's thread)."""
    t0 = time.perf_counter()
    warm_s = warm(planned)
    pool = pool_for(torch.device("cuda", planned.device) if planned.kind == "gpu" else None)
    allocated, alloc_s = pool.grow(bound, stop)
    where = f"cuda:{planned.device}" if planned.kind == "gpu" else "cpu"
    return Reservation(f"pool {where}", bound, pool.capacity, allocated, pool.pinned, time.perf_counter() - t0,
                       warm_s, alloc_s)


def reserve_memory(tier, planned: Planned, stop: Callable[[], bool], replicas: tuple = ()) -> Reservation:
    """Make and page-lock the memory tier's slots for the next steps (MemoryTier.make_spares),
    one at a time, then those of the tiers in `replicas` (the peer replicas this rank holds,
    each at the state's size: a peer's image is about its own), then warm the backend (on the
    reservation's thread: a step that needs a slot meanwhile waits for one, not for the
    warm-up). Every slot made is handed back, ready or not, whatever happens: a step would wait
    for it."""
    t0 = time.perf_counter()
    allocated = made = 0
    for each in (tier, *replicas):
        got, n = _make_spares(each, slot_bytes(planned.plan), planned.kind == "gpu", stop)
        allocated, made = allocated + got, made + n
    alloc_s = time.perf_counter() - t0
    warm_s = warm(planned)
    return Reservation(f"memory {tier.folder}", tier.cap_bytes, tier.held_bytes(), allocated,
                       planned.kind == "gpu", time.perf_counter() - t0, warm_s, alloc_s, made)


def _make_spares(tier, need: int, pin: bool, stop: Callable[[], bool]) -> tuple[int, int]:
    """`tier`'s spare slots of `need` bytes made and (pin) page-locked; (bytes, slots) made ready."""
    spares = tier.make_spares(need)
    allocated = made = 0
    try:
        while spares:
            slot, ready = spares[0], False
            try:
                ready = slot.prepare(pin, lambda: stop() or tier.stopping())
            finally:
                spares.pop(0)
                tier.spare_done(slot, ready)
            allocated += slot.mapped if ready else 0
            made += ready
    finally:
        for slot in spares:  # after a failure: the rest go, never prepared
            tier.spare_done(slot, False)
    return allocated, made


class _Discard:
    """interfaces.ChunkFile that drops every record (the warm-up's)."""

    fd = None

    def pwrite(self, buf, nbytes: int, offset: int) -> Completion:
        return Completion(lambda: nbytes)

    def pread(self, buf, nbytes: int, offset: int):
        raise NotImplementedError("nothing is kept to read")

    def close(self) -> None:
        pass


def warm(planned: Planned) -> float:
    """Small snapshots through the backend, codecs, options and kernels a save of `planned` uses,
    discarded; seconds. Per dtype two tensors of random bytes, so that the chunk is gathered from
    both (a lone aligned tensor is compressed where it lies, and the gather kernels would wait for
    the first save); with codec="auto" on the GPU, once more with byte planes for the dtypes that
    may choose them (sampled random bytes may not), so that their gather-into-planes kernel is
    built too. On a host whose CuPy kernel cache is cold, each kernel left out is compiled in the
    first save's call instead. Then codec="auto"'s choice for the state itself (save.choose_codecs_ahead):
    its sample is read while training may be changing the tensors, which moves only the choice."""
    t = time.perf_counter()
    sample = {}
    for i, (dtype, device) in enumerate(planned.samples.items()):
        half = max(1, WARM_BYTES // dtype.itemsize // 2) * dtype.itemsize
        rng = torch.Generator(device=device).manual_seed(i)  # the caller's random streams stay as they were
        for j in range(2):
            raw = torch.randint(0, 2 if dtype == torch.bool else 256, (half,), dtype=torch.uint8, device=device,
                                generator=rng)
            sample[f"{i}/{j}"] = raw.view(dtype)
    skeleton, leaves = flatten(sample)
    runs = [planned.options]
    planes = {name_of(d): "ans-planes" for d in planned.samples if name_of(d) in GPU_AUTO_PLANES}
    if planned.kind == "gpu" and planned.options.codec == "auto" and planes:
        runs.append(dataclasses.replace(planned.options, codec=planes))
    for options in runs:
        save_flat(skeleton, leaves, Sink(_Discard()), options)
    choose_codecs_ahead(planned.leaves, planned.options)
    return time.perf_counter() - t


def in_background(work: Callable[[Callable[[], bool]], Reservation], device: int | None, wait: bool) -> Future:
    """Run work(stop) on its own thread, on CUDA device `device` (a new thread's current device
    is 0); a Future of its result. stop() turns true once the interpreter is exiting: the thread
    is not a daemon (exit waits for it), so it stops at its next arena instead."""
    fut: Future = Future()
    fut.set_running_or_notify_cancel()

    def stop() -> bool:
        return not threading.main_thread().is_alive()

    def run() -> None:
        try:
            with on_device(device):
                result = work(stop)
        except BaseException as e:  # noqa: BLE001 - the future carries it
            fut.set_exception(e)
        else:
            fut.set_result(result)

    threading.Thread(target=run, name="gdsckpt-reserve", daemon=False).start()
    if wait:
        fut.result()
    return fut
