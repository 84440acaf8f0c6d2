"""The memory tier (Checkpointer(memory=True, every_local=N); gdsckpt/manager/memory/tier.py and the
modules around it): every save lands in shared memory, where it outlives the process; a new
process restores it from there, every chunk verified and bit-exact; a copy counts only once its
commit record is written, so a process killed mid-write leaves nothing that is restored, and the
next manager removes it; the cap and the drop order; two runs, or two ranks, on one host; the
local writes coalesced when the disk falls behind; the CLI's view and clean.

Every test puts the tier under its own folder in /dev/shm (GDSCKPT_MEMORY_ROOT), removed after."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import gdsckpt
from gdsckpt import Checkpointer
from gdsckpt.errors import CheckpointLockedError, ChecksumError
from gdsckpt.manager.memory.snapshot import MemoryTarget, local_write
from gdsckpt.manager.memory.tier import MemoryTier, default_cap
from gdsckpt.manager.memory.folders import ID_NAME, tier_folder
from gdsckpt.manager.steps import step_name
from conftest import assert_same

REPO = Path(__file__).resolve().parents[2]
OPTS = {"chunk_bytes": 64 << 10}



def state_for(step: int, n: int = 20_000) -> dict:
    """A training-like state whose every tensor depends on the step."""
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(n, generator=g), "b": torch.randn(300, generator=g).to(torch.bfloat16)},
            "optim": {"step": torch.tensor(float(step)), "m": torch.randn(n // 2, generator=g)},
            "meta": {"step": step, "name": "run"}}


def zeros_like(state):
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
            "optim": {k: torch.zeros_like(v) for k, v in state["optim"].items()}, "meta": {"step": -1, "name": ""}}


def local_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if not p.name.startswith("."))


def slot_files(ck_or_tier) -> list[str]:
    folder = ck_or_tier.memory.tier.folder if isinstance(ck_or_tier, Checkpointer) else ck_or_tier.folder
    return sorted(n for n in os.listdir(folder) if n.startswith("slot-"))


# ---------------------------------------------------------------- in one process


def test_every_save_in_memory_every_nth_on_disk_restore_from_memory(tmp_path, shm):
    d = tmp_path / "run"
    with Checkpointer(d, memory=True, every_local=3, keep_memory=2, save_options=OPTS) as ck:
        for s in range(1, 8):
            fut = ck.save_async(s, state_for(s))
            st = fut.result()
            assert st.io_path == "memory" and st.pool_limit_bytes == ck.status()["memory"]["cap_bytes"]
            # keep_memory drops the oldest copy not being read: while step 4's local write still reads
            # its copy, a later save drops step 5 or 6 instead (legitimately; 2 runs in 8 on a loaded
            # host ended with [4, 7]). Waiting for each local write makes the drop order this test checks.
            ck.memory.wait_local()
        assert ck.memory.steps() == [6, 7]  # keep_memory=2
        assert local_files(d) == [step_name(1, False), step_name(4, False), step_name(7, False)]
        assert ck.steps() == [1, 4, 6, 7] and ck.latest_step() == 7
        target = zeros_like(state_for(7))
        r = ck.restore(target)
        assert (r.step, r.source, r.skipped) == (7, "memory", [])
        assert "memory copy of step 7" in r.path
        assert_same(target, state_for(7))
        r = ck.restore(step=6)  # a new state, from the copy of a step that is in memory only
        assert (r.step, r.source) == (6, "memory")
        assert_same(r.state, state_for(6))
        with pytest.raises(ValueError, match="not newer than step 7"):
            ck.save_async(7, state_for(7))


def test_local_file_from_memory_is_byte_identical_to_save_async(tmp_path, shm):
    tier = MemoryTier(tmp_path)
    try:
        state = state_for(3)
        assert gdsckpt.save_async(state, tmp_path / "m.gdsckpt", memory=MemoryTarget(tier, 3), **OPTS).result()
        local_write(tier, 3, tmp_path / "a.gdsckpt").result()
        gdsckpt.save_async(state, tmp_path / "b.gdsckpt", **OPTS).result()
        assert not (tmp_path / "m.gdsckpt").exists()  # a memory step writes no file by itself
        a, b = (tmp_path / "a.gdsckpt").read_bytes(), (tmp_path / "b.gdsckpt").read_bytes()
        meta_a, meta_b = gdsckpt.open(tmp_path / "a.gdsckpt").metadata, gdsckpt.open(tmp_path / "b.gdsckpt").metadata
        if meta_a["created"] == meta_b["created"]:
            assert a == b
        else:  # apart from the time the index records
            assert len(a) == len(b) and sum(x != y for x, y in zip(a, b)) <= 64
        assert_same(gdsckpt.load(tmp_path / "a.gdsckpt"), state)
    finally:
        tier.close()


def test_refusals(tmp_path, shm):
    with pytest.raises(ValueError, match="pass memory=True"):
        Checkpointer(tmp_path / "a", every_local=4)
    with pytest.raises(ValueError, match="every_local must be at least 1"):
        Checkpointer(tmp_path / "a", memory=True, every_local=0)
    tier = MemoryTier(tmp_path)
    try:
        with pytest.raises(ValueError, match="memory= takes the compressed snapshot into the memory tier"):
            gdsckpt.save_async(state_for(1), tmp_path / "x", pool_bytes=1 << 20, memory=MemoryTarget(tier, 1))
    finally:
        tier.close()


def test_device_snapshot_into_memory(tmp_path, shm):
    """save_options={"snapshot": "device"} with the memory tier: the state copied in the call, the copy
    compressed into the tier; the state may change as save_async returns."""
    d = tmp_path / "run"
    with Checkpointer(d, memory=True, every_local=2, save_options={**OPTS, "snapshot": "device"}) as ck:
        assert ck.reserve(state_for(1), wait=True).result() is not None
        for s in (1, 2, 3):
            state = state_for(s)
            fut = ck.save_async(s, state)
            state["model"]["w"].fill_(7)
            st = fut.result()
            assert (st.mode, st.io_path) == ("device", "memory")
            ck.memory.wait_local()
        assert ck.save(4, state_for(4)).io_path == "memory"
        assert local_files(d) == [step_name(1, False), step_name(3, False)]
        for s in (1, 3, 4):
            r = ck.restore(step=s)
            assert r.source == ("memory" if s in ck.memory.steps() else "local")
            assert_same(r.state, state_for(s))


def test_status_reports_the_cap(tmp_path, shm):
    with Checkpointer(tmp_path / "a", memory=True) as ck:
        st = ck.status()["memory"]
        assert st["cap_bytes"] == default_cap(shm) > 0
        assert st["every_local"] == 1 and st["coalesced"] == [] and st["fallbacks"] == []
    with Checkpointer(tmp_path / "b", memory=True, memory_bytes=10 << 20) as ck:
        ck.save(1, state_for(1))
        st = ck.status()["memory"]
        assert st["cap_bytes"] == 10 << 20 and 0 < st["held_bytes"] <= 10 << 20 and st["steps"] == [1]


def test_release_memory_and_fallback_to_local(tmp_path, shm):
    d = tmp_path / "run"
    with Checkpointer(d, memory=True, every_local=2, save_options=OPTS) as ck:
        for s in (1, 2, 3, 4):
            ck.save(s, state_for(s))
        assert ck.memory.steps() == [3, 4] and ck.layout.local_steps() == [1, 3]
        assert ck.release_memory() > 0
        assert ck.memory.steps() == [] and slot_files(ck) == []
        r = ck.restore()  # step 4 was in memory only: gone
        assert (r.step, r.source) == (3, "local")
        ck.save(5, state_for(5))  # the tier is used again
        assert ck.memory.steps() == [5]
        ck.release_memory()
    # close() did not flush anything: step 5 was on disk (the 3rd save of 2 counts from 1: 1, 3, 5)
    assert local_files(d) == [step_name(s, False) for s in (1, 3, 5)]


def test_close_writes_the_newest_memory_only_step(tmp_path, shm):
    d = tmp_path / "run"
    with Checkpointer(d, memory=True, every_local=10, save_options=OPTS) as ck:
        for s in (1, 2, 3):
            ck.save_async(s, state_for(s))
    assert local_files(d) == [step_name(1, False), step_name(3, False)]
    assert_same(gdsckpt.load(d / step_name(3, False)), state_for(3))


def test_rollback_drops_newer_memory_copies(tmp_path, shm):
    d = tmp_path / "run"
    with Checkpointer(d, memory=True, every_local=2, keep_memory=5, save_options=OPTS) as ck:
        for s in (1, 2, 3, 4):
            ck.save(s, state_for(s))
        assert ck.rollback(2) == [3, 4]
        assert ck.memory.steps() == [1, 2] and ck.steps() == [1, 2]
        r = ck.restore()
        assert (r.step, r.source) == (2, "memory")
        ck.save(3, state_for(30))
    with Checkpointer(d, memory=True) as ck:
        assert_same(ck.restore().state, state_for(30))


def _rollback_beside_a_local_write(d: Path, monkeypatch, delay: float) -> tuple[list[int], list[int]]:
    """keep=1: step 2 is committed in memory and being written to the directory when
    rollback(1) starts; the rollback's record is made slow (its fsync behind that write)."""
    from gdsckpt.manager import rollback as rb
    write = rb.RollbackJournal.write

    def slow(self, pending):
        if pending is not None and pending.local_to is not None:
            time.sleep(delay)
        return write(self, pending)
    monkeypatch.setattr(rb.RollbackJournal, "write", slow)
    with Checkpointer(d, keep=1, memory=True, keep_memory=1, save_options=OPTS) as ck:
        ck.save(1, state_for(1))
        ck.save_async(2, state_for(2))
        return ck.rollback(1), ck.steps()


def test_a_rollback_beside_a_local_write_keeps_the_step_it_goes_back_to(tmp_path, shm, monkeypatch):
    """The write of step 2 ending during the rollback must not let retention (keep=1) remove
    step 1 as older than step 2, which the rollback then removes: nothing would be left."""
    gone, steps = _rollback_beside_a_local_write(tmp_path / "run", monkeypatch, 0.5)
    assert gone == [2] and steps == [1]
    with Checkpointer(tmp_path / "run") as ck:
        assert_same(ck.restore(zeros_like(state_for(1))).state, state_for(1))


def test_a_rollback_without_the_memory_tier_reaches_its_copies(tmp_path, shm):
    """A manager without memory=True (a restart, a tool) that rolls back leaves no memory copy
    that a later memory=True manager would bring back."""
    d = tmp_path / "run"
    with Checkpointer(d, memory=True, keep_memory=5, save_options=OPTS) as ck:
        for s in (1, 2, 3):
            ck.save(s, state_for(s))
    with Checkpointer(d, save_options=OPTS) as ck:
        assert ck.rollback(1) == [2, 3] and ck.steps() == [1]
    with Checkpointer(d, memory=True, save_options=OPTS) as ck:
        assert ck.steps() == [1]
        assert {r["why"] for r in ck.memory.tier.reclaimed} == {
            "another run's (the directory was made anew, or its steps went on without these copies)"}
        r = ck.restore(zeros_like(state_for(1)))
        assert (r.step, r.source) == (1, "local")
        assert_same(r.state, state_for(1))
        ck.save(2, state_for(20))


def test_a_rollback_killed_part_way_and_finished_without_the_tier_brings_nothing_back(tmp_path, shm):
    """A memory=True manager's rollback killed after its record and before it dropped its copies; a
    manager without the tier (a restart, `gdsckpt prune --yes`) finishes it at open: the copies of
    the steps it removed are another run's from then on, and a later memory=True manager restores
    the step rolled back to (it restored step 3 from memory, and wrote it back into the directory)."""
    from gdsckpt.manager.rollback import PendingRollback, RollbackJournal
    d = tmp_path / "run"
    ck = Checkpointer(d, memory=True, keep_memory=5, save_options=OPTS)
    for s in (1, 2, 3):
        ck.save(s, state_for(s))
    RollbackJournal(d).write(PendingRollback(local_to=1, store_to=None))  # rollback(1), killed here
    ck.memory.close(flush=False)  # the process is gone: its copies stay in shared memory
    ck._release()
    with Checkpointer(d, save_options=OPTS) as other:
        assert other.steps() == [1]
    with Checkpointer(d, memory=True, save_options=OPTS) as ck:
        assert ck.steps() == [1]
        r = ck.restore(zeros_like(state_for(1)))
        assert (r.step, r.source) == (1, "local")
    assert sorted(p.name for p in d.iterdir() if p.name.startswith("step_")) == [step_name(1, False)]


def test_a_due_write_to_the_directory_that_fails_is_raised_by_save_and_close(tmp_path, shm, monkeypatch):
    """every_local=1: save() is durable on return, so a failed write of its step to the directory
    (a full disk) is raised by save(), as without the tier, and close()'s flush of the newest step
    raises too; the memory copy stays, and the next manager restores it. Both returned normally, the
    error only logged, and the step lived in shared memory alone."""
    from concurrent.futures import Future
    from gdsckpt.manager.memory import local_writes
    from gdsckpt.errors import GdsckptError
    real = local_writes.local_write

    def full(tier, step, path):
        if step < 2:
            return real(tier, step, path)
        failed = Future()
        failed.set_exception(OSError(28, "No space left on device (test)"))
        return failed
    monkeypatch.setattr(local_writes, "local_write", full)
    d = tmp_path / "run"
    ck = Checkpointer(d, memory=True, save_options=OPTS)
    ck.save(1, state_for(1))
    with pytest.raises(OSError, match="No space left"):
        ck.save(2, state_for(2))
    assert ck.memory.tier.steps() == [1, 2] and ck.layout.local_steps() == [1]
    with pytest.raises(GdsckptError, match="could not be written to the directory .*No space left"):
        ck.close()
    monkeypatch.setattr(local_writes, "local_write", real)  # the disk has room again
    with Checkpointer(d, memory=True, save_options=OPTS) as ck:
        r = ck.restore(zeros_like(state_for(2)))
        assert (r.step, r.source) == (2, "memory")
        assert_same(r.state, state_for(2))
    assert local_files(d) == [step_name(1, False), step_name(2, False)]  # the next close wrote it


@pytest.mark.parametrize("first", ["grows", "near the cap"])
def test_an_overlapped_step_that_finds_no_room_is_saved_to_the_directory(tmp_path, shm, first):
    """save_async(optimizer=) (the overlap mode) of a step the tier has no room for goes to the
    directory, as in the host mode: its room is checked against the state in the call, where its
    snapshot's own thread could not fall back. It failed with MemoryTierFullError on its future, the
    step in neither place: after the optimizer's first step had grown the state (its moments), or
    on a first save whose estimate left out the index."""
    import torch
    torch.manual_seed(0)
    model = torch.nn.Linear(200, 200)
    opt = torch.optim.Adam(model.parameters())

    def state():
        return {"model": model.state_dict(), "optim": opt.state_dict()}
    small = sum(t.nbytes for t in model.state_dict().values())
    cap = 400_000 if first == "grows" else small + 8192
    with Checkpointer(tmp_path / "run", memory=True, memory_bytes=cap, save_options=OPTS) as ck:
        if first == "grows":
            ck.save_async(1, state(), optimizer=opt).result()  # before its first step: no moments yet
            model(torch.randn(4, 200)).sum().backward()
            opt.step()
        step = 2 if first == "grows" else 1
        want = {k: v.clone() for k, v in model.state_dict().items()}
        ck.save_async(step, state(), optimizer=opt).result()
        assert [f["step"] for f in ck.status()["memory"]["fallbacks"]] == [step]
        assert step in ck.layout.local_steps()
    assert_same(gdsckpt.load(tmp_path / "run" / step_name(step, False))["model"], want)


_DIES_WITH_STEPS_IN_MEMORY = r"""
import os, sys
sys.path.insert(0, sys.argv[2])
from gdsckpt import Checkpointer
from test_memory_tier import state_for, OPTS
ck = Checkpointer(sys.argv[1], memory=True, every_local=10, save_options=OPTS)
for s in (1, 2, 3):
    ck.save(s, state_for(s))
os._exit(0)  # preempted: steps 2 and 3 in this host's memory only
"""


@pytest.mark.parametrize("second_run", ["memory elsewhere", "no memory tier"])
def test_copies_of_an_abandoned_run_never_shadow_the_steps_written_without_them(tmp_path, shm, monkeypatch,
                                                                               second_run):
    """Run A dies on host X with steps 2 and 3 in X's memory only. Run B, on host Y (its tier
    empty) or without the memory tier, resumes from step 1 on disk and writes its own 2 and 3.
    Back on X, a run must restore B's step 3, not A's copy of it."""
    d, host_x = tmp_path / "run", shm / "x"
    host_x.mkdir()
    monkeypatch.setenv("GDSCKPT_MEMORY_ROOT", str(host_x))
    child = _child(_DIES_WITH_STEPS_IN_MEMORY, d, REPO / "tests", tmp=tmp_path)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    if second_run == "memory elsewhere":
        (shm / "y").mkdir()
        monkeypatch.setenv("GDSCKPT_MEMORY_ROOT", str(shm / "y"))
    with Checkpointer(d, memory=second_run == "memory elsewhere", save_options=OPTS) as ck:
        assert ck.restore(zeros_like(state_for(1))).step == 1
        ck.save(2, state_for(200))
        ck.save(3, state_for(300))
    monkeypatch.setenv("GDSCKPT_MEMORY_ROOT", str(host_x))
    with Checkpointer(d, memory=True, save_options=OPTS) as ck:
        assert ck.memory.steps() == []  # A's copies: another run's
        r = ck.restore(zeros_like(state_for(3)))
        assert (r.step, r.source) == (3, "local")
        assert_same(r.state, state_for(300))


def test_a_run_that_resumes_from_its_copies_keeps_them(tmp_path, shm):
    """The lineage is renewed only by a writer that does not see the copies: a restart on the
    same host restores from memory, saves on, and its copies stay valid for the next restart."""
    d = tmp_path / "run"
    with Checkpointer(d, memory=True, every_local=10, save_options=OPTS) as ck:
        ck.save(1, state_for(1))
        ck.save(2, state_for(2))
    ident = (d / ID_NAME).read_text()
    with Checkpointer(d, memory=True, every_local=10, save_options=OPTS) as ck:
        assert ck.restore(zeros_like(state_for(2))).source == "memory"
        ck.save(3, state_for(3))
    assert (d / ID_NAME).read_text() == ident
    with Checkpointer(d, memory=True, save_options=OPTS) as ck:
        assert ck.memory.steps()[-1] == 3 and ck.restore().source == "memory"


# ---------------------------------------------------------------- the cap and the drop order


def test_cap_and_drop_order(tmp_path, shm):
    d = tmp_path / "run"
    probe = MemoryTier(tmp_path / "probe")
    try:  # one step's room in memory
        gdsckpt.save_async(state_for(0), tmp_path / "p", memory=MemoryTarget(probe, 0), **OPTS).result()
        room = probe.held_bytes()
    finally:
        probe.release_all()
        probe.close()
    cap = int(room * 3.5)  # three steps
    seen = []
    with Checkpointer(d, memory=True, every_local=2, memory_bytes=cap, keep_memory=10, save_options=OPTS) as ck:
        for s in range(1, 7):
            ck.save(s, state_for(s))  # synchronous: steps 1, 3, 5 are on disk before the next save
            seen.append(ck.memory.steps())
            assert ck.memory.tier.held_bytes() <= cap
        # step 4 needs room: step 1 goes (on disk, oldest); step 5: step 3 goes before the older
        # step 2, which is in memory only; step 6: step 5 (on disk) before steps 2 and 4
        assert seen == [[1], [1, 2], [1, 2, 3], [2, 3, 4], [2, 4, 5], [2, 4, 6]]
        assert [x["step"] for x in ck.status()["memory"]["dropped"]] == [1, 3, 5]
        assert len(slot_files(ck)) == 3  # each dropped copy's slot was reused


def test_the_newest_only_copy_is_never_dropped(tmp_path, shm):
    d = tmp_path / "run"
    probe = MemoryTier(tmp_path / "probe")
    try:
        gdsckpt.save_async(state_for(0), tmp_path / "p", memory=MemoryTarget(probe, 0), **OPTS).result()
        room = probe.held_bytes()
    finally:
        probe.release_all()
        probe.close()
    with Checkpointer(d, memory=True, every_local=100, memory_bytes=int(room * 1.5), save_options=OPTS) as ck:
        ck.save(1, state_for(1))  # memory, and on disk (the 1st save)
        ck.save(2, state_for(2))  # room: step 1 goes, it is on disk
        assert ck.memory.steps() == [2] and ck.layout.local_steps() == [1]
        ck.save(3, state_for(3))  # step 2 is the only copy of the newest step: step 3 goes to disk
        assert ck.memory.steps() == [2] and ck.layout.local_steps() == [1, 3]
        fb = ck.status()["memory"]["fallbacks"]
        assert [f["step"] for f in fb] == [3] and "the only copy of the newest step" in fb[0]["why"]
        ck.save(4, state_for(4))  # step 2 is no longer the newest (step 3 is on disk): it goes
        assert ck.memory.steps() == [4]
        r = ck.restore()
        assert (r.step, r.source) == (4, "memory")
        assert_same(r.state, state_for(4))
    with Checkpointer(tmp_path / "small", memory=True, memory_bytes=room // 2, save_options=OPTS) as ck:
        ck.save(1, state_for(1))  # larger than the cap: on disk, and said so
        assert ck.memory.steps() == [] and "more than the memory tier's cap" in \
            ck.status()["memory"]["fallbacks"][0]["why"]


# ---------------------------------------------------------------- torn and damaged copies


def test_torn_or_damaged_copies_are_never_restored(tmp_path, shm):
    d = tmp_path / "run"
    with Checkpointer(d, memory=True, every_local=2, keep_memory=5, save_options=OPTS) as ck:
        for s in (1, 2, 3, 4, 5):
            ck.save(s, state_for(s))
        folder = ck.memory.tier.folder
        recs = {int(n[5:13]): json.loads((folder / n).read_text()) for n in os.listdir(folder) if n.endswith(".commit")}
    assert sorted(recs) == [1, 2, 3, 4, 5]
    # step 5: its segment cut short; step 4: overwritten by another image (its footer differs);
    # a slot no record names (a writer killed before its commit record); a record never renamed
    slot5 = folder / recs[5]["slot"]
    os.truncate(slot5, recs[5]["bytes"] - 100)
    slot4 = folder / recs[4]["slot"]
    with open(slot4, "r+b") as f:
        f.seek(recs[4]["bytes"] - 8)
        f.write(b"\xff" * 8)
    (folder / "slot-99").write_bytes(b"GDSCKPT\x00" + bytes(10000))
    (folder / ".step_00000006.commit.123").write_text("{")
    # step 3: a flipped byte inside a chunk (its footer intact: found by the chunk checksum)
    slot3 = folder / recs[3]["slot"]
    with gdsckpt.open(d / step_name(3, False)) as ck3:
        off = ck3.index.records[0].file_offset
    with open(slot3, "r+b") as f:
        f.seek(off + 10)
        b = f.read(1)
        f.seek(off + 10)
        f.write(bytes([b[0] ^ 0x40]))
    with Checkpointer(d, memory=True, every_local=2, keep_memory=5, save_options=OPTS) as ck:
        why = {r["name"]: r["why"] for r in ck.memory.tier.reclaimed}
        assert "holds" in why["step_00000005.commit"] and "footer" in why["step_00000004.commit"]
        assert "torn" in why["slot-99"] and "torn" in why[recs[5]["slot"]] and "torn" in why[recs[4]["slot"]]
        assert ck.memory.steps() == [1, 2, 3] and "slot-99" not in slot_files(ck)
        assert not any(n.startswith(".step") for n in os.listdir(folder))
        target = zeros_like(state_for(3))
        r = ck.restore(target)  # step 5 is on disk; step 4 was in memory only and is gone
        assert (r.step, r.source, r.skipped) == (5, "local", [])
        with pytest.warns(UserWarning, match=r"restored step 3 \(local\), not the newer step 3 \(memory\)"):
            r = ck.restore(target, step=3)  # the damaged copy: skipped, then the disk's
        assert (r.step, r.source) == (3, "local")
        assert r.skipped[0][:2] == (3, "memory") and "ChecksumError" in r.skipped[0][2]
        assert_same(target, state_for(3))
        assert ck.memory.steps() == [1, 2]  # the damaged copy was dropped


_KILLED_MID_WRITE = r"""
import os, sys, threading
sys.path.insert(0, sys.argv[2])
import torch
from gdsckpt import Checkpointer
from gdsckpt.manager.memory import snapshot as memory_snapshot
from test_memory_tier import state_for, OPTS
ck = Checkpointer(sys.argv[1], memory=True, every_local=100, save_options=OPTS)
ck.save(1, state_for(1))
ck.save(2, state_for(2))
real = memory_snapshot.SlotFile.pwrite
calls = []
def pwrite(self, *a):  # the third save: its first records land, then the process is killed
    calls.append(1)
    if len(calls) == 3:
        print("mid-write", flush=True)
        threading.Event().wait()
    return real(self, *a)
memory_snapshot.SlotFile.pwrite = pwrite
ck.save(3, state_for(3))
"""


def _child(code: str, *args, tmp: Path) -> subprocess.Popen:
    script = tmp / "child.py"
    script.write_text(code)
    path = os.pathsep.join([str(REPO), str(REPO / "tests")] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.Popen([sys.executable, str(script), *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_killed_mid_write_leaves_nothing_restored_and_is_reclaimed(tmp_path, shm):
    d = tmp_path / "run"
    child = _child(_KILLED_MID_WRITE, d, REPO / "tests", tmp=tmp_path)
    try:
        line = child.stdout.readline()
        assert line.strip() == "mid-write", child.stderr.read()
        folder = tier_folder(d, 0)
        torn = set(n for n in os.listdir(folder) if n.startswith("slot-"))
        named = {json.loads((folder / n).read_text())["slot"] for n in os.listdir(folder) if n.endswith(".commit")}
        assert len(torn - named) == 1  # step 3's slot, holding its first records and no commit record
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL
    with Checkpointer(d, memory=True, save_options=OPTS) as ck:
        assert [r["name"] for r in ck.memory.tier.reclaimed] == sorted(torn - named)
        assert set(slot_files(ck)) == named
        r = ck.restore()
        assert (r.step, r.source) == (2, "memory")
        assert_same(r.state, state_for(2))


_SAVE_UNTIL_KILLED = r"""
import sys
sys.path.insert(0, sys.argv[2])
import torch
torch.set_num_threads(1)
from gdsckpt import Checkpointer
from test_memory_tier import state_for, OPTS
ck = Checkpointer(sys.argv[1], memory=True, every_local=1000, save_options=OPTS)
first = (ck.latest_step() or 0) + 1
ck.save(first, state_for(first, n=400_000))
print("saving", flush=True)
for s in range(first + 1, first + 100_000):
    ck.save_async(s, state_for(s, n=400_000))
"""


def test_sigkill_at_random_moments_then_restore_from_memory(tmp_path, shm):
    """A process saving into memory as fast as it can is SIGKILLed at a random moment, three
    times over; each time a new process restores the newest intact step from memory, bit-exact
    (never a torn one), and the next manager leaves no slot that no record names."""
    d = tmp_path / "run"
    rng = random.Random(0)
    last = 0
    for _ in range(3):
        child = _child(_SAVE_UNTIL_KILLED, d, REPO / "tests", tmp=tmp_path)
        try:
            assert child.stdout.readline().strip() == "saving", child.stderr.read()
            time.sleep(rng.uniform(0.2, 1.5))
        finally:
            child.send_signal(signal.SIGKILL)
            child.communicate(timeout=60)
        assert child.returncode == -signal.SIGKILL
        with Checkpointer(d, memory=True, save_options=OPTS) as ck:
            r = ck.restore()
            assert r.source == "memory" and r.step > last and r.skipped == []
            assert_same(r.state, state_for(r.step, n=400_000))
            named = {json.loads((ck.memory.tier.folder / n).read_text())["slot"]
                     for n in os.listdir(ck.memory.tier.folder) if n.endswith(".commit")}
            assert set(slot_files(ck)) == named
            last = r.step
            ck.release_memory()  # the next child starts with the newest step on disk (close() flushed nothing)
            ck.save(last + 1, state_for(last + 1, n=400_000))
            last += 1


_KEEP_AND_DIE = r"""
import os, sys
sys.path.insert(0, sys.argv[2])
from gdsckpt import Checkpointer
from test_memory_tier import state_for, OPTS
ck = Checkpointer(sys.argv[1], memory=True, every_local=4, save_options=OPTS)
for s in range(1, 7):
    ck.save_async(s, state_for(s))
ck.wait()
ck.memory.wait_local()
print("saved", ck.memory.steps(), ck.layout.local_steps(), flush=True)
os.kill(os.getpid(), 9)
"""


def test_sigkill_then_a_new_process_restores_from_memory(tmp_path, shm):
    d = tmp_path / "run"
    child = _child(_KEEP_AND_DIE, d, REPO / "tests", tmp=tmp_path)
    out, err = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL, err
    assert out.strip() == "saved [5, 6] [1, 5]"
    assert local_files(d) == [step_name(1, False), step_name(5, False)]  # step 6: in memory only
    model = zeros_like(state_for(6))
    with Checkpointer(d, memory=True, every_local=4, save_options=OPTS) as ck:
        assert ck.steps() == [1, 5, 6]
        r = ck.restore(model)
        assert (r.step, r.source) == (6, "memory")
        assert_same(model, state_for(6))
        ck.release_memory()
        r = ck.restore(model)  # the copies gone: the directory's newest
        assert (r.step, r.source) == (5, "local")
        assert_same(model, state_for(5))


# ---------------------------------------------------------------- two runs, two ranks


def test_two_managers_on_one_host(tmp_path, shm):
    a, b = tmp_path / "a", tmp_path / "b"
    with Checkpointer(a, memory=True, save_options=OPTS) as ca, Checkpointer(b, memory=True, save_options=OPTS) as cb:
        ca.save(1, state_for(1))
        cb.save(1, state_for(2))
        assert ca.memory.tier.folder != cb.memory.tier.folder
        assert_same(ca.restore().state, state_for(1))
        assert_same(cb.restore().state, state_for(2))
        with pytest.raises(CheckpointLockedError):
            Checkpointer(a, memory=True)
    # two ranks of one directory: a tier each, each locked
    t0, t1 = MemoryTier(a, rank=0), MemoryTier(a, rank=1)
    try:
        assert t0.folder != t1.folder and t0.folder.name.endswith("-r0") and t1.folder.name.endswith("-r1")
        assert t0.steps() == [1] and t1.steps() == []
        with pytest.raises(CheckpointLockedError, match="in use by another Checkpointer"):
            MemoryTier(a, rank=1)
    finally:
        t0.close()
        t1.close()


def test_a_directory_made_anew_does_not_restore_the_old_runs_copies(tmp_path, shm):
    d = tmp_path / "run"
    with Checkpointer(d, memory=True, every_local=10, save_options=OPTS) as ck:
        ck.save(1, state_for(1))
        ck.save(2, state_for(2))
        ck.release_memory()
        ck.save(3, state_for(3))
    shutil.rmtree(d)
    d.mkdir()
    assert not (d / ID_NAME).exists()
    with Checkpointer(d, memory=True, save_options=OPTS) as ck:
        assert ck.steps() == [] and ck.memory.tier.reclaimed
        with pytest.raises(gdsckpt.NoCheckpointError):
            ck.restore()


# ---------------------------------------------------------------- the throughput-aware policy


def test_local_writes_coalesce_when_the_disk_falls_behind(tmp_path, shm, monkeypatch):
    real = os.fsync

    def slow_fsync(fd):  # a disk that takes 0.4 s per step, saves every few ms
        time.sleep(0.4)
        real(fd)
    monkeypatch.setattr(os, "fsync", slow_fsync)
    d = tmp_path / "run"
    with Checkpointer(d, memory=True, every_local=1, keep_memory=3, save_options=OPTS) as ck:
        for s in range(1, 9):
            ck.save_async(s, state_for(s)).result()
            time.sleep(0.02)
        st = ck.status()["memory"]
        ck.memory.wait_local()
        st_after = ck.status()["memory"]
        written = st_after["local_writes"]["written"]
    coalesced = st_after["coalesced"]
    assert coalesced and st_after["local_writes"]["coalesced_count"] == len(coalesced)
    assert written[0] == 1 and written[-1] == 8 and len(written) < 8
    assert sorted(written + [c["step"] for c in coalesced]) == list(range(1, 9))
    for c in coalesced:
        assert c["by"] > c["step"] and "the disk is behind" in c["why"] and "steps are due every" in c["why"]
    assert st["local_writes"]["in_flight"] is not None  # still writing when the saves ended: never queued 7 deep
    assert st_after["local_writes"]["MBps"] > 0
    assert local_files(d) == [step_name(s, False) for s in sorted(written)][-3:]  # keep=3


# ---------------------------------------------------------------- the CLI


def test_cli_ls_and_clean_memory(tmp_path, shm, capsys):
    from gdsckpt.cli import main
    d = tmp_path / "run"
    with Checkpointer(d, memory=True, every_local=2, save_options=OPTS) as ck:
        for s in (1, 2, 3, 4):
            ck.save(s, state_for(s))
        capsys.readouterr()
        assert main(["ls", str(d)]) == 0
        out = capsys.readouterr().out
        lines = {int(l.split()[0]): l for l in out.splitlines()[1:]}
        assert lines[4].split()[1] == "memory" and "memory: ok" in lines[4]
        assert lines[3].split()[1] == "memory+local" and "memory: ok; local: ok" in lines[3]
        assert lines[1].split()[1] == "local"
        assert main(["ls", str(d), "--json", "--verify"]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert [(r["step"], r["memory_state"]) for r in rows] == [(1, None), (3, "ok"), (4, "ok")]
        assert main(["restore-test", str(d)]) == 0
        assert "restore() would use step 4" in capsys.readouterr().out
        assert main(["clean", str(d), "--memory"]) == 1  # 1: failed (the manager holds its tier)
        assert "in use by another Checkpointer" in capsys.readouterr().err
    # close() wrote step 4 (in memory only) to the directory
    assert main(["clean", str(d), "--memory"]) == 0
    assert "dropped the memory copies of rank 0 (steps [3, 4]" in capsys.readouterr().out
    assert not tier_folder(d, 0).exists()
    assert main(["ls", str(d)]) == 0
    out = capsys.readouterr().out
    assert "memory" not in out.split("\n", 1)[1]
    assert main(["clean", str(d), "--memory"]) == 0
    assert "no memory copies" in capsys.readouterr().out
    with Checkpointer(d, memory=True) as ck:
        r = ck.restore()
        assert (r.step, r.source) == (4, "local")
    # a directory removed whole, its copies left on this host: --memory frees them (it exited 3)
    with Checkpointer(d, memory=True, every_local=2, save_options=OPTS) as ck:
        ck.save(5, state_for(5))
    shutil.rmtree(d)
    capsys.readouterr()
    assert main(["clean", str(d), "--memory"]) == 0
    assert "dropped the memory copies of rank 0" in capsys.readouterr().out
    assert main(["clean", str(d)]) == 3  # without --memory: no such directory


def test_ls_verify_finds_a_damaged_copy(tmp_path, shm, capsys):
    from gdsckpt.cli import main
    d = tmp_path / "run"
    with Checkpointer(d, memory=True, every_local=5, save_options=OPTS) as ck:
        ck.save(1, state_for(1))
        ck.save(2, state_for(2))
        with ck.memory.reading(2) as src:
            off = gdsckpt.open(src).index.records[1].file_offset
        ck.memory.tier.copy(2).slot.tensor[off + 5] ^= 1
        capsys.readouterr()
        assert main(["ls", str(d), "--verify"]) == 0
        out = capsys.readouterr().out
        assert "memory: DAMAGED: ChecksumError" in out
        assert main(["restore-test", str(d)]) == 1
        assert "restore() would use step 1, not the newer step 2" in capsys.readouterr().out
        with ck.memory.reading(2) as src, pytest.raises(ChecksumError):
            gdsckpt.load(src)
        ck.release_memory()


# ---------------------------------------------------------------- uploads follow the directory's steps


def test_uploads_follow_the_steps_written_to_the_directory(tmp_path, shm, s3_env):
    url = f"s3://{s3_env.new_bucket()}/mem"
    d = tmp_path / "run"
    with Checkpointer(d, memory=True, every_local=2, remote=url, save_options=OPTS) as ck:
        for s in range(1, 8):
            ck.save(s, state_for(s))
        ck.wait(uploads=True, timeout=120)
        st = ck.status()
        # steps 1, 3, 5, 7 reached the directory; the store has those of them the uploader did
        # not coalesce (a newer one committed while it waited), the newest always
        assert st["local_steps"][-1] == 7 and set(st["local_steps"]) <= {1, 3, 5, 7}
        assert st["uploaded"][-1] == 7 and set(st["uploaded"]) | set(st["skipped"]) == {1, 3, 5, 7}
        assert [c["step"] for c in st["coalesced_uploads"]] == st["skipped"]
        assert all("a newer step was committed while it waited for the store" in c["why"]
                   for c in st["coalesced_uploads"])
        assert ck.memory.steps() == [6, 7]
    with Checkpointer(tmp_path / "elsewhere", remote=url) as other:  # another host: the store's newest
        r = other.restore()
        assert (r.step, r.source) == (7, "remote")
        assert_same(r.state, state_for(7))


# ---------------------------------------------------------------- on a GPU (the lead's H100 runs these)

_GPU_RESTORE = r"""
import sys, json
sys.path.insert(0, sys.argv[2])
import torch
from gdsckpt import Checkpointer
want = {k: torch.load(sys.argv[3])[k] for k in ("w", "m")}
target = {"model": {"w": torch.zeros(200_000, device="cuda")}, "optim": {"m": torch.zeros(100_000, device="cuda")}}
with Checkpointer(sys.argv[1], memory=True) as ck:
    r = ck.restore(target)
print(json.dumps({"source": r.source, "step": r.step,
                  "exact": torch.equal(target["model"]["w"].cpu(), want["w"]) and
                           torch.equal(target["optim"]["m"].cpu(), want["m"])}))
"""


@pytest.mark.gpu
def test_gpu_snapshot_into_pinned_slots_and_restore_in_a_new_process(tmp_path, shm):
    d = tmp_path / "run"
    g = torch.Generator(device="cuda").manual_seed(1)
    state = {"model": {"w": torch.randn(200_000, device="cuda", generator=g)},
             "optim": {"m": torch.randn(100_000, device="cuda", generator=g)}}
    torch.save({"w": state["model"]["w"].cpu(), "m": state["optim"]["m"].cpu()}, tmp_path / "want.pt")
    with Checkpointer(d, memory=True, every_local=10) as ck:
        st = ck.save_async(1, state).result()
        assert st.io_path == "memory" and st.backend == "gpu"
        ck.save_async(2, state).result()
        assert ck.status()["memory"]["pinned_bytes"] > 0  # the slots are page-locked
        r = ck.restore(step=2)  # in this process: from page-locked memory
        assert (r.source, r.step) == ("memory", 2)
        assert torch.equal(r.state["model"]["w"].cpu(), state["model"]["w"].cpu())
        ck.release_memory()
        ck.save_async(3, state).result()
    child = _child(_GPU_RESTORE, d, REPO / "tests", tmp_path / "want.pt", tmp=tmp_path)
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == {"source": "memory", "step": 3, "exact": True}


@pytest.mark.gpu
def test_gpu_device_snapshot_into_memory_lets_the_copy_go(tmp_path, shm):
    """snapshot="device" with the memory tier on a GPU: the copy is compressed into the tier's slots
    and goes back to torch's cache once the step is committed there; the step restores bit-exact."""
    g = torch.Generator(device="cuda").manual_seed(2)
    state = {"model": {"w": torch.randn(2_000_000, device="cuda", generator=g)},
             "optim": {"m": torch.randn(1_000_000, device="cuda", generator=g)}}
    want = {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in state.items()}
    with Checkpointer(tmp_path / "run", memory=True, every_local=10, save_options={"snapshot": "device"}) as ck:
        ck.save_async(1, state).result()  # the backend warmed, the slot made
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        fut = ck.save_async(2, state)
        state["model"]["w"].fill_(7)  # the copy was taken in the call
        st = fut.result()
        assert (st.mode, st.io_path, st.backend) == ("device", "memory", "gpu")
        assert st.device_copy_bytes >= 12_000_000
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before  # the copy went back with the snapshot
        r = ck.restore(step=2)
        assert r.source == "memory"
        assert all(torch.equal(r.state[k][kk], want[k][kk]) for k in want for kk in want[k])
