"""Checkpointer.restore's fall-back leaves the caller's state holding exactly the step it restored
(every chunk verified before a byte reaches the caller's tensors), past damaged file steps and
damaged DCP `.metadata` alike (and a rollback under torch.distributed)."""

from __future__ import annotations

import os

import pytest
import torch

import gdsckpt
from gdsckpt.manager.checkpointer import Checkpointer, step_name
from conftest import assert_same
from ckpt_tools import end_rank, flip_chunk_byte, start_ranks
from test_manager import OPTS, state_for


def _with_extra(step: int) -> dict:
    s = state_for(step)
    s["extra"] = torch.full((40_000,), float(step))  # a tensor only the newer step has
    return s


@pytest.mark.parametrize("damage", ["last-chunk", "first-chunk", "truncated"])
def test_fallback_leaves_exactly_the_restored_step(tmp_path, damage):
    with Checkpointer(tmp_path, keep=3, save_options=OPTS) as ck:
        ck.save(2, state_for(2))
        ck.save(3, _with_extra(3))
        newest = tmp_path / step_name(3, False)
        with gdsckpt.open(newest) as c:
            n = len(c.index.records)
        if damage == "truncated":
            os.truncate(newest, newest.stat().st_size - 5000)  # its index and footer gone
        else:
            flip_chunk_byte(newest, 100, 0x10, chunk=n - 1 if damage == "last-chunk" else 0)
        target = _with_extra(0)
        untouched = target["extra"].clone()
        with pytest.warns(UserWarning, match="restored step 2"):
            r = ck.restore(target, strict=False)
        assert r.step == 2 and r.state is target and [s for s, _, _ in r.skipped] == [3]
        for k in ("model", "optim"):
            assert_same(target[k], state_for(2)[k])
        assert torch.equal(target["extra"], untouched)  # not a byte of step 3 in it


@pytest.mark.parametrize("how", ["save", "save_async"])
def test_a_run_that_fell_back_past_a_damaged_step_saves_that_step_again(tmp_path, how):
    """The README's resume loop: step 30 damaged, a new process restores step 20 and trains on; its
    save of step 30 replaces the damaged copy (it was refused as 'not newer than step 30', so every
    restart stopped there), and the next restore takes the new step 30. An intact step still
    refuses its number."""
    with Checkpointer(tmp_path, keep=5, save_options=OPTS) as ck:
        for s in (10, 20, 30):
            ck.save(s, state_for(s))
    flip_chunk_byte(tmp_path / step_name(30, False), 100, 0x10, chunk=0)
    with Checkpointer(tmp_path, keep=5, save_options=OPTS) as ck:
        with pytest.warns(UserWarning, match="restored step 20"):
            assert ck.restore(state_for(0)).step == 20
        with pytest.raises(ValueError, match="step 20 is not newer than step 20"):
            ck.save(20, state_for(99))
        again = state_for(31)
        if how == "save":
            ck.save(30, again)
        else:
            ck.save_async(30, again).result()
        assert ck.steps() == [10, 20, 30]
    with Checkpointer(tmp_path, keep=5, save_options=OPTS) as ck:
        target = state_for(0)
        r = ck.restore(target)
        assert r.step == 30 and r.skipped == []
        assert_same(target, state_for(31))


# ---------------------------------------------------------------- DCP steps (2 CPU ranks over gloo)

WORLD = 2


def _dcp_rank(rank: int, root: str) -> None:
    import warnings
    from pathlib import Path

    import torch.distributed as dist
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    root = Path(root)
    dist.init_process_group("gloo", store=dist.FileStore(str(root / "store"), WORLD), rank=rank, world_size=WORLD)
    try:
        d = root / "ck"
        ck = Checkpointer(d, keep=3)
        for s in (1, 2):
            ck.save(s, {"w": torch.full((64,), float(s)), "step": torch.tensor(s)})
        meta = d / step_name(2, True) / ".metadata"
        data = meta.read_bytes()
        for damage in ("flip", "truncated", "empty"):
            dist.barrier()
            if rank == 0:
                if damage == "flip":
                    meta.write_bytes(data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF])
                                     + data[len(data) // 2 + 1:])
                else:
                    meta.write_bytes(data[:len(data) // 2] if damage == "truncated" else b"")
            dist.barrier()
            target = {"w": torch.zeros(64), "step": torch.tensor(0)}
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                r = ck.restore(target)
            assert r.step == 1 and [(s, w) for s, w, _ in r.skipped] == [(2, "local")], (damage, r.skipped)
            assert ".metadata" in r.skipped[0][2], r.skipped
            assert any("restored step 1" in str(w.message) for w in seen), damage
            assert torch.equal(target["w"], torch.full((64,), 1.0)) and int(target["step"]) == 1
        # and back to step 1 on every rank: rank 0 removes step 2, every rank saves a new one
        assert ck.rollback(1) == ([2] if rank == 0 else [])
        ck.save(2, {"w": torch.full((64,), 22.0), "step": torch.tensor(22)})
        r = ck.restore(target)
        assert r.step == 2 and r.skipped == [] and int(target["step"]) == 22
        ck.close()
    finally:
        dist.destroy_process_group()
    end_rank()


def test_dcp_step_with_a_damaged_metadata_falls_back(tmp_path):
    import torch.distributed as dist
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")

    start_ranks(_dcp_rank, args=(str(tmp_path),), nprocs=WORLD, join=True)
