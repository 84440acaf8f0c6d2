"""The memory tier under torch.distributed (2 CPU ranks over gloo): every rank keeps its own
shards in its own tier; a step due in the directory is a DCP checkpoint; a restart (new
processes, same ranks) restores every rank from memory, bit-exact; when one rank's copy is
missing or damaged, every rank falls back together."""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

from ckpt_tools import end_rank, start_ranks  # noqa: E402
from test_manager_dcp import WORLD, full_state, run_ranks, same_local, sharded  # noqa: E402

OPTS = {"chunk_bytes": 64 << 10}


def _rank_main(rank: int, root: str, env: dict, phase: str) -> None:
    os.environ.update(env)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    root = Path(root)
    dist.init_process_group("gloo", store=dist.FileStore(str(root / f"store-{phase}"), WORLD), rank=rank,
                            world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (WORLD,))
        (_save if phase == "save" else _restart)(rank, root / "ck", mesh)
    finally:
        dist.destroy_process_group()
    end_rank()


def _save(rank: int, d: Path, mesh) -> None:
    from gdsckpt import Checkpointer
    from gdsckpt.manager.steps import step_name
    ck = Checkpointer(d, memory=True, every_local=2, save_options=OPTS)
    for s in (1, 2, 3, 4):
        ck.save_async(s, sharded(full_state(s), mesh))
        ck.wait()
        dist.barrier()
    assert ck.memory.steps() == [2, 4], ck.memory.steps()  # steps 1 and 3: DCP checkpoints
    assert ck.layout.local_steps() == [1, 3] and ck.steps() == [1, 2, 3, 4]
    assert {"__0_0.gdsckpt", "__1_0.gdsckpt"} <= set(os.listdir(d / step_name(3, True)))
    assert not (d / step_name(4, True)).exists()
    ck.close()  # under DCP nothing is flushed: step 4 stays in memory only
    assert not (d / step_name(4, True)).exists()


def _restart(rank: int, d: Path, mesh) -> None:
    from gdsckpt import Checkpointer
    ck = Checkpointer(d, memory=True, every_local=2, save_options=OPTS)
    target = sharded(full_state(0), mesh)
    r = ck.restore(target)
    assert (r.step, r.source, r.skipped) == (4, "memory", []), r
    same_local(target, sharded(full_state(4), mesh))
    assert target["meta"] == {"seed": 4}

    if rank == 1:  # damage rank 1's copy of step 4: every rank falls back to step 3, on disk
        copy = ck.memory.tier.copy(4)
        with ck.memory.reading(4) as src:
            import gdsckpt
            off = gdsckpt.open(src).index.records[0].file_offset
        copy.slot.tensor[off + 3] ^= 1
    dist.barrier()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        r = ck.restore(target)
    assert (r.step, r.source) == (3, "local"), r
    assert r.skipped[0][:2] == (4, "memory") and "rank(s) [1] could not restore step 4" in r.skipped[0][2], r.skipped
    same_local(target, sharded(full_state(3), mesh))
    assert ck.memory.steps() == [2]  # the unusable copies were dropped, on every rank

    if rank == 0:  # rank 0 alone lets step 2 go: no rank restores it from memory
        ck.memory.tier.drop(2, "test")
    dist.barrier()
    assert ck.memory.restorable() == []
    r = ck.restore(target, step=3)
    assert (r.step, r.source) == (3, "local")
    ck.release_memory()
    ck.close()


def test_two_ranks_memory_tier(tmp_path):
    root = Path(tempfile.mkdtemp(prefix="gdsckpt-test-", dir="/dev/shm"))
    try:
        env = {"GDSCKPT_MEMORY_ROOT": str(root)}
        start_ranks(_rank_main, args=(str(tmp_path), env, "save"), nprocs=WORLD, join=True)
        # the copies outlived the processes: a folder per rank, each with its two steps
        folders = sorted(os.listdir(root))
        assert [f[-3:] for f in folders] == ["-r0", "-r1"], folders
        for f in folders:
            assert sorted(n for n in os.listdir(root / f) if n.endswith(".commit")) == \
                ["step_00000002.commit", "step_00000004.commit"]
        start_ranks(_rank_main, args=(str(tmp_path), env, "restart"), nprocs=WORLD, join=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def memory_env():
    root = Path(tempfile.mkdtemp(prefix="gdsckpt-test-", dir="/dev/shm"))
    try:
        yield {"GDSCKPT_MEMORY_ROOT": str(root)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _rollback(rank: int, root: Path, mesh) -> None:
    from gdsckpt import Checkpointer
    ck = Checkpointer(root / "ck", memory=True, every_local=2, save_options=OPTS)
    for s in (1, 2, 3, 4):  # 1, 3: DCP checkpoints; 2, 4: memory only
        ck.save(s, sharded(full_state(s), mesh))
    assert ck.memory.steps() == [2, 4]
    gone = ck.rollback(2)
    assert set(gone) >= {4} and (rank != 0 or 3 in gone), gone
    assert ck.memory.steps() == [2] and ck.layout.local_steps() == [1] and ck.steps() == [1, 2]  # on every rank
    ck.save(3, sharded(full_state(30), mesh))  # save(step + 1) works, on every rank
    target = sharded(full_state(0), mesh)
    r = ck.restore(target)
    assert r.step == 3, r
    same_local(target, sharded(full_state(30), mesh))
    ck.release_memory()
    ck.close()


def test_two_ranks_rollback_drops_every_ranks_memory_copies(tmp_path, memory_env):
    run_ranks(tmp_path, _rollback, env=memory_env, pg_timeout=30)


def _restore_fails_on_one_rank(rank: int, root: Path, mesh) -> None:
    """A memory copy damaged on rank 1 alone, nothing to fall back to: every rank's copy is
    verified before any state is written, so rank 0's state is left as it was too."""
    from gdsckpt import Checkpointer, NoCheckpointError
    from gdsckpt.manager.steps import step_name
    d = root / "ck"
    ck = Checkpointer(d, memory=True, every_local=2, save_options=OPTS)
    for s in (1, 2):  # 1: a DCP checkpoint; 2: memory only
        ck.save(s, sharded(full_state(s), mesh))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(d / step_name(1, True))
    if rank == 1:
        copy = ck.memory.tier.copy(2)
        with ck.memory.reading(2) as src:
            import gdsckpt
            off = gdsckpt.open(src).index.records[0].file_offset
        copy.slot.tensor[off + 3] ^= 1
    dist.barrier()
    target = sharded(full_state(0), mesh)
    with pytest.raises(NoCheckpointError, match=r"rank\(s\) \[1\] could not restore step 2 from memory"):
        ck.restore(target)
    same_local(target, sharded(full_state(0), mesh))  # untouched, on every rank
    ck.release_memory()
    ck.close()


def test_two_ranks_memory_restore_failing_on_one_rank(tmp_path, memory_env):
    run_ranks(tmp_path, _restore_fails_on_one_rank, env=memory_env, pg_timeout=30)


class _FailsOnRank1:
    """A stateful object whose load_state_dict fails on rank 1 alone, with an error of its own."""

    def __init__(self):
        self.v = torch.zeros(3)

    def state_dict(self):
        return {"v": self.v}

    def load_state_dict(self, sd):
        if dist.get_rank() == 1:
            raise RuntimeError("this object cannot take that state here")
        self.v.copy_(sd["v"])


def _restore_raises_on_one_rank(rank: int, root: Path, mesh) -> None:
    """A memory restore whose load_state_dict raises its own error on rank 1 (no damage, no
    mismatch): rank 1 raises it, rank 0 a GdsckptError naming rank 1, both at once; before, rank 0
    waited in the agreement's gather for the process group's timeout."""
    from gdsckpt import Checkpointer, GdsckptError
    ck = Checkpointer(root / "ck", memory=True, every_local=2, save_options=OPTS)
    for s in (1, 2):  # 1: a DCP checkpoint; 2: memory only
        ck.save(s, sharded(full_state(s), mesh) | {"obj": _FailsOnRank1()})
    target = sharded(full_state(0), mesh) | {"obj": _FailsOnRank1()}
    if rank == 1:
        with pytest.raises(RuntimeError, match="cannot take that state here"):
            ck.restore(target)
    else:
        with pytest.raises(GdsckptError, match=r"rank\(s\) \[1\] failed restoring step 2 from memory: RuntimeError"):
            ck.restore(target)
    dist.barrier()
    ck.release_memory()
    ck.close()


def test_two_ranks_memory_restore_raising_on_one_rank(tmp_path, memory_env):
    run_ranks(tmp_path, _restore_raises_on_one_rank, env=memory_env, pg_timeout=30, timeout=60)
