"""gdsckpt.reserve and Checkpointer.reserve: the host memory a first save needs, made ahead of
need on a background thread. The pool grows to save_async's bound (and no further, with a save
racing it), a second reservation allocates nothing, the first save after it allocates nothing
and is bit-exact, release_pools() frees it (and stops one in progress), bad input raises what
save_async raises before any thread starts. The memory tier's slots are made within its cap,
dropping nothing; a step takes a reserved slot (waiting for one in the making); a reserved slot
holds nothing that counts: never restored, removed on close and, after a SIGKILL, by the next
manager. The CPU pool is plain memory; the code is the pinned pool's."""

from __future__ import annotations

import json
import os
import signal
import threading
from concurrent.futures import wait as wait_futures

import pytest
import torch

import gdsckpt
from gdsckpt import Checkpointer
from gdsckpt.writing import async_save as am
from gdsckpt.manager.memory import slot as memory_slot
from gdsckpt.engine import pinned_pool as pp
from gdsckpt.errors import GDSUnavailableError, MemoryTierFullError, UnsupportedStateError
from gdsckpt.manager.memory.folders import tier_folder
from conftest import all_dtype_tensors, assert_same
from test_memory_tier import OPTS, REPO, _child, slot_files, state_for

SMALL = dict(backend="cpu", chunk_bytes=64 << 10)


def _state(seed: int, n: int = 200_000) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(n, generator=g), "b": torch.randn(700, generator=g).to(torch.bfloat16)},
            "dtypes": all_dtype_tensors(n=300, seed=seed), "step": seed}


def _reserving() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "gdsckpt-reserve"]


@pytest.fixture(autouse=True)
def fresh():
    """Each test starts and ends with no save in flight and no pool."""
    pp.release_pools()
    yield
    for fut, _, _ in list(am._tracked):
        wait_futures([fut], timeout=30)
        fut.observed = True
    am._tracked.clear()
    pp.release_pools()


class GatedArenas:
    """Holds the reservation thread's arena allocations from the `after`-th on until the gate
    opens, and records, at every arena allocated (the reservation's or a save's), the bytes
    allocated and being allocated with it: what the pool would hold if every one landed."""

    def __init__(self, monkeypatch, after: int):
        self.gate, self.holding = threading.Event(), threading.Event()
        self.reserved, self.outstanding = 0, []
        real = pp._Arena
        test = self

        class Arena(real):
            def __init__(self, size, pinned):
                pool = pp.pool_for(None)
                if threading.current_thread().name == "gdsckpt-reserve":  # its arena counts in `growing`
                    test.outstanding.append(pool.capacity + pool.growing)
                    test.reserved += 1
                    if test.reserved > after:
                        test.holding.set()
                        assert test.gate.wait(30), "the test never opened the gate"
                else:  # a save's, allocated under the lock
                    test.outstanding.append(pool.capacity + pool.growing + size)
                super().__init__(size, pinned)

        monkeypatch.setattr(pp, "_Arena", Arena)


# ---------------------------------------------------------------- the pool


def test_reserve_grows_the_pool_to_save_asyncs_bound_and_again_allocates_nothing(tmp_path):
    state = _state(1, n=1_000_000)
    fut = gdsckpt.reserve(state, **SMALL)
    r = fut.result(60)
    assert isinstance(r, gdsckpt.Reservation) and r.where == "pool cpu" and not r.pinned
    assert pp.pools()["cpu"]["capacity_bytes"] == r.held_bytes == r.allocated_bytes
    assert r.limit_bytes - pp.ALIGN < r.held_bytes <= r.limit_bytes
    assert r.seconds >= r.alloc_s > 0 and r.warm_s > 0
    again = gdsckpt.reserve(state, wait=True, **SMALL).result()
    assert again.allocated_bytes == 0 and again.held_bytes == r.held_bytes
    stats = gdsckpt.save_async(state, tmp_path / "a.gdsckpt", **SMALL).result(60)
    assert stats.pool_limit_bytes == r.limit_bytes  # the bound save_async gives the same state
    assert stats.pool_alloc_s == 0.0 and stats.pool_bytes == r.held_bytes  # nothing allocated in the call
    assert_same(gdsckpt.load(tmp_path / "a.gdsckpt"), state)
    assert pp.release_pools() == r.held_bytes and pp.pools()["cpu"]["capacity_bytes"] == 0
    assert _reserving() == []


def test_reserve_leaves_the_callers_random_streams_alone(tmp_path):
    """The warm-up's random bytes come from a generator of its own: a reservation between two draws of
    the training's global generator does not change the second draw (dropout masks, data order)."""
    torch.manual_seed(5)
    torch.rand(3)
    want = torch.rand(8)
    torch.manual_seed(5)
    torch.rand(3)
    gdsckpt.reserve({"a": torch.ones(10_000), "b": torch.ones(100, dtype=torch.bfloat16),
                     "c": torch.ones(5, dtype=torch.bool)}, wait=True, **SMALL).result()
    assert torch.equal(torch.rand(8), want)


def test_without_reserve_the_first_save_allocates_in_the_call(tmp_path):
    stats = gdsckpt.save_async(_state(2), tmp_path / "a.gdsckpt", **SMALL).result(60)
    assert stats.pool_alloc_s > 0  # what reserve takes out of the first save


def test_pool_bytes_bounds_the_reservation(tmp_path):
    state = _state(3, n=1_000_000)
    r = gdsckpt.reserve(state, pool_bytes=1 << 20, wait=True, **SMALL).result()
    assert r.limit_bytes == 1 << 20 and r.held_bytes == 1 << 20
    stats = gdsckpt.save_async(state, tmp_path / "a.gdsckpt", pool_bytes=1 << 20, **SMALL).result(60)
    assert stats.pool_alloc_s == 0.0 and stats.pool_bytes == 1 << 20 >= stats.pool_peak_bytes
    assert_same(gdsckpt.load(tmp_path / "a.gdsckpt"), state)
    one_chunk = gdsckpt.reserve(state, pool_bytes=1, wait=True, **SMALL).result()
    assert one_chunk.limit_bytes == 64 << 10  # a bound below one chunk is raised to one, as save_async raises it


@pytest.mark.parametrize("bound", [None, 4 << 20])
def test_a_save_racing_a_reservation_stays_within_the_bound_and_is_bit_exact(tmp_path, monkeypatch, bound):
    """The reservation is held inside its third arena's allocation (outside the pool's lock)
    while a save_async of the same state runs: the save takes the two arenas there, grows only
    into the room the reservation is not allocating, or waits for its arena; at no point is
    more allocated, or being allocated, than the bound. With a bound below the state (4 MiB of
    16 MB) the save fills the pool to it."""
    arenas = GatedArenas(monkeypatch, after=2)
    g = torch.Generator().manual_seed(4)  # 16 MB, incompressible: arenas of 1 MiB
    state = {"w": torch.randint(0, 256, (16 << 20,), dtype=torch.uint8, generator=g), "b": torch.randn(700)}
    fut = gdsckpt.reserve(state, pool_bytes=bound, **SMALL)
    assert arenas.holding.wait(30)
    pool = pp.pool_for(None)
    assert pool.growing > 0 and pool.capacity == 2 << 20 and not fut.done()
    real_wait = pool._cond.wait

    def wait(timeout=None):
        """The save waits in the pool (for the arena in progress, or for room): the arena may land
        now (else it lands once the save is done). Not a timer: under load the save had not always
        reached the pool when one fired, and the reservation took the whole bound."""
        if threading.current_thread().name != "gdsckpt-reserve":
            arenas.gate.set()
        return real_wait(timeout)

    monkeypatch.setattr(pool._cond, "wait", wait)
    try:
        stats = gdsckpt.save_async(state, tmp_path / "a.gdsckpt", pool_bytes=bound, **SMALL).result(60)
    finally:
        arenas.gate.set()
    r = fut.result(60)
    assert stats.pool_limit_bytes == r.limit_bytes
    assert max(arenas.outstanding) <= r.limit_bytes
    assert pool.capacity <= r.limit_bytes and pool.growing == 0 and pool.in_use == 0
    assert r.allocated_bytes < pool.capacity == r.held_bytes  # the save allocated its share, not more
    assert_same(gdsckpt.load(tmp_path / "a.gdsckpt"), state)
    again = gdsckpt.save_async(state, tmp_path / "b.gdsckpt", pool_bytes=bound, **SMALL).result(60)
    assert again.pool_alloc_s == 0.0


def test_release_pools_frees_a_reservation_and_stops_one_in_progress(monkeypatch):
    state = _state(5, n=4_000_000)
    gdsckpt.reserve(state, wait=True, **SMALL)
    assert pp.release_pools() > 0 and pp.pools()["cpu"]["capacity_bytes"] == 0
    arenas = GatedArenas(monkeypatch, after=2)
    fut = gdsckpt.reserve(state, **SMALL)
    assert arenas.holding.wait(30)
    assert pp.release_pools() == 2 << 20  # the arenas there; the one in progress goes back when it lands
    arenas.gate.set()
    r = fut.result(30)
    assert r.held_bytes == 0 and pp.pools()["cpu"]["capacity_bytes"] == 0 and pp.pool_for(None).growing == 0


def test_bad_input_raises_what_save_async_raises_before_any_thread_starts(tmp_path):
    st = _state(6)
    cases = [({"a": object()}, {}), (st, {"pool_bytes": 0}), (st, {"pool_bytes": True}), (st, {"pool_bytes": 1.5}),
             (st, {"codec": "nope"}), (st, {"chunk_bytes": 1000}), (st, {"ring_depth": 1}), (st, {"io": "fast"}),
             (st, {"backend": "tpu"}), (st, {"io": "gds", "backend": "cpu"}), (st, {"colour": "red"})]
    for state, kw in cases:
        with pytest.raises(Exception) as want:
            gdsckpt.save_async(state, tmp_path / "a.gdsckpt", **kw)
        with pytest.raises(type(want.value)) as got:
            gdsckpt.reserve(state, **kw)
        assert str(got.value) == str(want.value), kw
        assert type(got.value) in (UnsupportedStateError, ValueError, GDSUnavailableError, TypeError), kw
        assert _reserving() == [] and pp.pools().get("cpu", {}).get("capacity_bytes", 0) == 0
    assert os.listdir(tmp_path) == []


def test_the_warm_up_takes_every_dtype():
    r = gdsckpt.reserve(all_dtype_tensors(n=50), wait=True, backend="cpu").result()
    assert r.warm_s > 0 and r.held_bytes > 0


# ---------------------------------------------------------------- the memory tier


def _gated_slots(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Slots of many arenas, and the reservation thread held at each arena until the gate
    (the first returned) opens; the second is set once it is held."""
    monkeypatch.setattr(memory_slot, "POOL_ARENA_BYTES", 64 << 10)
    gate, holding = threading.Event(), threading.Event()
    real = memory_slot.Slot._touch

    def touch(slot, *a, **kw):
        if threading.current_thread().name == "gdsckpt-reserve":
            holding.set()
            assert gate.wait(30), "the test never opened the gate"
        return real(slot, *a, **kw)
    monkeypatch.setattr(memory_slot.Slot, "_touch", touch)
    return gate, holding


def test_checkpointer_reserve_makes_the_tiers_slots_and_the_first_saves_take_them(tmp_path, shm):
    d = tmp_path / "run"
    with Checkpointer(d, memory=True, every_local=2, save_options=OPTS) as ck:
        r = ck.reserve(state_for(1), wait=True).result()
        tier = ck.memory.tier
        assert r.where == f"memory {tier.folder}" and r.slots == tier.keep == 2 and not r.pinned
        assert r.allocated_bytes == r.held_bytes == tier.held_bytes() > 0
        made = slot_files(ck)
        assert len(made) == 2 and ck.steps() == []
        assert [n for n in os.listdir(tier.folder) if n.endswith(".commit")] == []  # nothing that counts
        assert ck.reserve(state_for(1), wait=True).result().slots == 0  # enough there: nothing more
        for s in range(1, 6):
            ck.save_async(s, state_for(s))
            ck.wait()
            ck.memory.wait_local()  # (a copy being written to the directory is not dropped: a step
            # then may need a slot beyond keep_memory, made in its save, as without a reservation)
            assert slot_files(ck) == made and tier.held_bytes() == r.held_bytes  # no slot made in a save
        assert ck.memory.steps() == [4, 5]
        restored = ck.restore()
        assert (restored.step, restored.source) == (5, "memory")
        assert_same(restored.state, state_for(5))
    assert not tier.folder.exists() or slot_files(tier) == made


def test_reserved_slots_stay_within_the_cap_and_drop_nothing(tmp_path, shm):
    d = tmp_path / "run"
    with Checkpointer(d, memory=True, save_options=OPTS) as ck:
        ck.save(1, state_for(1))
        one = ck.memory.tier.held_bytes()
    with Checkpointer(d, memory=True, memory_bytes=one * 3 // 2, save_options=OPTS) as ck:
        r = ck.reserve(state_for(2), wait=True).result()
        assert r.slots == 0 and r.allocated_bytes == 0 and r.held_bytes == one  # no room beside step 1's copy
        assert ck.memory.steps() == [1] and ck.memory.tier.dropped == type(ck.memory.tier.dropped)()
    with Checkpointer(d, memory=True, memory_bytes=one // 2, save_options=OPTS) as ck:
        r = ck.reserve(state_for(2), wait=True).result()
        assert r.where == "pool cpu"  # its steps go to the directory as without the tier: the pool is reserved


def test_a_save_waits_for_a_slot_in_the_making_and_makes_no_other(tmp_path, shm, monkeypatch):
    gate, holding = _gated_slots(monkeypatch)
    d = tmp_path / "run"
    with Checkpointer(d, memory=True, every_local=100, save_options=OPTS) as ck:
        fut = ck.reserve(state_for(1))
        assert holding.wait(30)
        made = slot_files(ck)
        assert len(made) == 2
        opener = threading.Timer(0.5, gate.set)
        opener.start()
        try:
            ck.save_async(1, state_for(1)).result(60)  # waits for a reserved slot to be ready
        finally:
            gate.set()
            opener.cancel()
        assert fut.result(30).slots == 2
        assert slot_files(ck) == made
        ck.save_async(2, state_for(2)).result(60)
        assert slot_files(ck) == made
        assert_same(ck.restore(step=1).state, state_for(1))


def test_close_stops_slots_in_the_making_and_leaves_none(tmp_path, shm, monkeypatch):
    gate, holding = _gated_slots(monkeypatch)
    d = tmp_path / "run"
    ck = Checkpointer(d, memory=True, save_options=OPTS)
    fut = ck.reserve(state_for(1))
    assert holding.wait(30)
    folder = ck.memory.tier.folder
    threading.Timer(0.5, gate.set).start()
    ck.close()  # waits for the arena in progress, then the slots go
    assert fut.result(30).slots == 0
    assert not folder.exists()
    with pytest.raises(gdsckpt.GdsckptError, match="closed"):
        ck.reserve(state_for(1))


def test_a_slot_that_cannot_be_made_fails_the_reservation_and_holds_up_nothing(tmp_path, shm, monkeypatch):
    def full(slot, pin, stop=None):
        raise MemoryTierFullError(f"the shared-memory file system holding {str(slot.path)!r} has no room")
    monkeypatch.setattr(memory_slot.Slot, "prepare", full)
    with Checkpointer(tmp_path / "run", memory=True, save_options=OPTS) as ck:
        with pytest.raises(MemoryTierFullError, match="no room"):
            ck.reserve(state_for(1), wait=True)
        assert slot_files(ck) == [] and ck.memory.tier.held_bytes() == 0  # every slot made went back
        ck.save_async(1, state_for(1)).result(60)  # waits for no slot: makes its own
        assert_same(ck.restore().state, state_for(1))


def test_release_memory_frees_reserved_slots(tmp_path, shm):
    with Checkpointer(tmp_path / "run", memory=True, save_options=OPTS) as ck:
        r = ck.reserve(state_for(1), wait=True).result()
        assert ck.release_memory() == r.held_bytes and slot_files(ck) == []
        ck.save(1, state_for(1))  # the tier works on
        assert ck.memory.steps() == [1]


_RESERVE_AND_DIE = r"""
import os, sys
sys.path.insert(0, sys.argv[2])
from gdsckpt import Checkpointer
from test_memory_tier import state_for, OPTS
ck = Checkpointer(sys.argv[1], memory=True, save_options=OPTS)
ck.save(1, state_for(1))
r = ck.reserve(state_for(2), wait=True).result()
print("reserved", r.slots, flush=True)
os.kill(os.getpid(), 9)
"""


def test_a_reserved_slot_is_never_restored_and_is_reclaimed_after_a_kill(tmp_path, shm):
    d = tmp_path / "run"
    child = _child(_RESERVE_AND_DIE, d, REPO / "tests", tmp=tmp_path)
    out, err = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL, err
    assert out.strip() == "reserved 1"
    folder = tier_folder(d, 0)
    slots = {n for n in os.listdir(folder) if n.startswith("slot-")}
    named = {json.loads((folder / n).read_text())["slot"] for n in os.listdir(folder) if n.endswith(".commit")}
    assert len(slots) == 2 and len(named) == 1 and named < slots
    with Checkpointer(d, memory=True, save_options=OPTS) as ck:
        assert [(x["name"], x["why"]) for x in ck.memory.tier.reclaimed] == \
            [(n, "torn: no commit record (its writer died)") for n in sorted(slots - named)]
        assert set(slot_files(ck)) == named and ck.steps() == [1]
        r = ck.restore()
        assert (r.step, r.source) == (1, "memory")
        assert_same(r.state, state_for(1))


def test_checkpointer_reserve_without_memory_reserves_the_pool(tmp_path):
    with Checkpointer(tmp_path / "run", save_options=SMALL) as ck:
        r = ck.reserve(_state(7, n=1_000_000), wait=True).result()
        assert r.where == "pool cpu" and r.held_bytes == pp.pools()["cpu"]["capacity_bytes"] > 0
        stats = ck.save_async(1, _state(7, n=1_000_000)).result(60)
        assert stats.pool_alloc_s == 0.0


# ---------------------------------------------------------------- on a GPU (pinned arenas, page-locked slots)


@pytest.mark.gpu
def test_gpu_reserve_pins_the_pool_and_the_first_save_allocates_nothing(tmp_path):
    g = torch.Generator(device="cuda").manual_seed(8)
    state = {"w": torch.randn(20_000_000, device="cuda", generator=g),
             "b": torch.randn(300_000, device="cuda", generator=g).to(torch.bfloat16)}
    r = gdsckpt.reserve(state, wait=True).result()
    pool = f"cuda:{torch.cuda.current_device()}"
    assert r.where == f"pool {pool}" and r.pinned and r.warm_s > 0
    assert pp.pools()[pool]["capacity_bytes"] == r.held_bytes == r.allocated_bytes
    assert r.limit_bytes - pp.ALIGN < r.held_bytes <= r.limit_bytes
    first = gdsckpt.save_async(state, tmp_path / "a.gdsckpt").result(120)
    assert first.backend == "gpu" and first.pool_alloc_s == 0.0 and first.pool_limit_bytes == r.limit_bytes
    assert "codec_choice" not in first.stages  # codec="auto" chose from the state's bytes in the reservation
    assert first.memory["pinned_host_bytes"] == r.held_bytes
    assert_same(gdsckpt.load(tmp_path / "a.gdsckpt", device="cpu"), {k: v.cpu() for k, v in state.items()})
    assert gdsckpt.reserve(state, wait=True).result().allocated_bytes == 0


@pytest.mark.gpu
def test_gpu_pool_arenas_are_registered_pages_unlocked_on_release_and_kept_from_a_forked_child(tmp_path):
    """The GPU pool's arenas are plain pages page-locked with cudaHostRegister (faster to make than
    cudaHostAlloc's), which torch sees as pinned; release_pools unlocks them. A forked child
    (a DataLoader worker) does not inherit them: saves after it has run and written its own memory
    stay bit-exact."""
    g = torch.Generator(device="cuda").manual_seed(10)
    state = {"w": torch.randn(6_000_000, device="cuda", generator=g),
             "b": torch.randn(300_000, device="cuda", generator=g).to(torch.bfloat16)}
    first = gdsckpt.save_async(state, tmp_path / "a.gdsckpt").result(120)
    assert first.backend == "gpu" and first.pool_alloc_s > 0
    arenas = list(pp.pool_for(torch.device("cuda", torch.cuda.current_device()))._arenas)
    assert arenas and all(a.registered and a.tensor.is_pinned() for a in arenas)
    pid = os.fork()
    if pid == 0:  # the child writes memory of its own and leaves without touching CUDA
        try:
            junk = bytearray(64 << 20)
            junk[:] = b"\xff" * len(junk)
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    for k in state:
        state[k].mul_(-1)
    second = gdsckpt.save_async(state, tmp_path / "b.gdsckpt").result(120)
    assert second.pool_alloc_s == 0.0
    assert_same(gdsckpt.load(tmp_path / "b.gdsckpt", device="cpu"), {k: v.cpu() for k, v in state.items()})
    pp.release_pools()
    assert not any(a.registered for a in arenas)
    assert pp.pools()[f"cuda:{torch.cuda.current_device()}"]["capacity_bytes"] == 0


_FIRST_SAVE_MAKES_NO_CODEC = """
import json, sys, torch, gdsckpt
from gdsckpt.engine.gpu.backend import _resources
g = torch.Generator(device="cuda").manual_seed(9)
# AdamW-like streams, so that codec="auto" samples typed and byte-plane ANS for each float dtype
state = {"w": torch.randn(8_000_000, device="cuda", generator=g),
         "v": torch.randn(8_000_000, device="cuda", generator=g).square_() * 1e-6,
         "h": torch.randn(4_000_000, device="cuda", generator=g).to(torch.bfloat16)}
gdsckpt.reserve(state, wait=True).result()
codecs = _resources(torch.cuda.current_device()).codecs._codecs
made = set(codecs)
gdsckpt.save_async(state, sys.argv[1]).result(120)
print(json.dumps({"made": sorted(made, key=str), "new": sorted(set(codecs) - made, key=str)}))
"""


@pytest.mark.gpu
def test_gpu_reserve_makes_every_codec_the_first_save_uses(tmp_path):
    """In a new process (nothing made before it): after reserve, the first save makes no nvCOMP
    codec of its own, byte-plane ANS's included, though the warm-up's zeros would store best
    under typed ANS."""
    child = _child(_FIRST_SAVE_MAKES_NO_CODEC, tmp_path / "a.gdsckpt", tmp=tmp_path)
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err
    codecs = json.loads(out.strip().splitlines()[-1])
    assert {k[0] for k in codecs["made"]} >= {"ans", "ans-planes"} and codecs["new"] == [], codecs


@pytest.mark.gpu
def test_gpu_checkpointer_reserve_page_locks_the_slots_before_the_first_save(tmp_path, shm):
    g = torch.Generator(device="cuda").manual_seed(9)
    state = {"model": {"w": torch.randn(2_000_000, device="cuda", generator=g)},
             "optim": {"m": torch.randn(1_000_000, device="cuda", generator=g)}}
    with Checkpointer(tmp_path / "run", memory=True, every_local=10) as ck:
        r = ck.reserve(state, wait=True).result()
        st = ck.status()["memory"]
        assert r.slots == 2 and r.pinned and st["pinned_bytes"] == st["held_bytes"] == r.held_bytes
        made = slot_files(ck)
        first = ck.save_async(1, state).result(120)
        assert first.io_path == "memory" and first.backend == "gpu"
        ck.save_async(2, state).result(120)
        assert slot_files(ck) == made and ck.status()["memory"]["pinned_bytes"] == r.held_bytes
        restored = ck.restore(step=2)
        assert (restored.source, restored.step) == ("memory", 2)
        assert torch.equal(restored.state["model"]["w"].cpu(), state["model"]["w"].cpu())


def test_reserve_warns_of_an_optimizer_that_has_taken_no_step():
    """Before its first step an optimizer holds no moments: a reservation then is sized without
    them (AdamW's: two thirds of the state), so it says so, naming where the optimizer is."""
    import warnings
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    for state in ({"model": model, "optim": opt}, {"model": model.state_dict(), "optim": opt.state_dict()}):
        with pytest.warns(UserWarning, match=r"the optimizer at 'optim' holds no state yet"):
            gdsckpt.reserve(state, wait=True, **SMALL)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = gdsckpt.reserve({"model": model, "optim": opt}, wait=True, **SMALL).result()
    assert r.limit_bytes >= 3 * sum(p.nbytes for p in model.parameters())  # the moments counted
    pp.release_pools()
