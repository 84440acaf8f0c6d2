"""A distributed Checkpointer keeps its ranks in step with each other and with the training loop
(2 CPU ranks over gloo, real processes): save_async's collectives, which run on DCP's thread,
never pair with the loop's own on the default group; a step one rank's memory tier kept and
another's lost (a rank killed while saving it) counts on no rank, so that the resumed run saves
it again on every rank; a value that differs across ranks under one key is refused at the save,
naming the key, never restored on every rank as one rank's."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

from ckpt_tools import end_rank, logged, start_ranks  # noqa: E402
from test_manager_dcp import WORLD, full_state, run_ranks, same_local, sharded  # noqa: E402

OPTS = {"chunk_bytes": 64 << 10}


def _restores_exactly(ck, mesh, step: int, source: str) -> None:
    target = sharded(full_state(0), mesh)
    r = ck.restore(target)
    assert (r.step, r.source) == (step, source), r
    same_local(target, sharded(full_state(step), mesh))


# ---------------------------------------------------------------- save_async beside the loop's collectives

def _training_collectives(rank: int, step: int, device: str = "cpu") -> None:
    """What a training loop runs on the default group between checkpoints: DDP's all_reduces, a
    loss averaged, a barrier; each result checked (a collective paired with another's buffer
    would be wrong, not only late). On a CUDA mesh the tensors are on the GPU: NCCL's."""
    for i in range(3):
        t = torch.full((16,), float(rank + step + i), device=device)
        dist.all_reduce(t)
        assert t.tolist() == [float(2 * (step + i) + 1)] * 16, (step, i, t)
    dist.barrier()


def _save_async_beside_training(rank: int, root: Path, mesh) -> None:
    from gdsckpt import Checkpointer
    ck = Checkpointer(root / "ck", keep=2, save_options=OPTS)
    for s in range(1, 6):
        ck.save_async(s, sharded(full_state(s), mesh))  # DCP plans and commits on its thread
        _training_collectives(rank, s, mesh.device_type)  # meanwhile, on the main thread
    ck.wait()
    dist.barrier()  # rank 0's retention is done
    assert ck.layout.local_steps() == [4, 5]
    # the memory tier's steps due in the directory are DCP checkpoints, saved the same way
    memory = Checkpointer(root / "ck-memory", memory=True, every_local=2, save_options=OPTS)
    for s in range(1, 5):
        memory.save_async(s, sharded(full_state(s), mesh))
        _training_collectives(rank, s, mesh.device_type)
    memory.wait()
    dist.barrier()
    assert memory.layout.local_steps() == [1, 3] and memory.memory.steps() == [2, 4]
    _restores_exactly(ck, mesh, 5, "local")
    _restores_exactly(memory, mesh, 4, "memory")
    ck.close()
    memory.release_memory()
    memory.close()


def test_two_ranks_save_async_beside_the_loops_collectives(tmp_path, monkeypatch):
    """Before, save_async ran DCP's collectives on the default group from its thread: the main
    thread's all_reduce paired with DCP's gather, and the ranks hung until the group's timeout
    (short here, so that the failure is an error)."""
    root = Path(tempfile.mkdtemp(prefix="gdsckpt-test-", dir="/dev/shm"))
    try:
        run_ranks(tmp_path, _save_async_beside_training, env={"GDSCKPT_MEMORY_ROOT": str(root)}, pg_timeout=15,
                  timeout=120)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_ranks_save_async_beside_the_loops_nccl_collectives(tmp_path):
    """The same on two GPUs: the loop's all_reduces over NCCL, the state's shards on the GPUs,
    saved through the GPU pipeline; DCP's collectives on the Checkpointer's own group."""
    root = Path(tempfile.mkdtemp(prefix="gdsckpt-test-", dir="/dev/shm"))
    try:
        run_ranks(tmp_path, _save_async_beside_training, env={"GDSCKPT_MEMORY_ROOT": str(root)}, pg_timeout=60,
                  timeout=300, backend="cpu:gloo,cuda:nccl")
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------- a step one rank's memory tier kept alone

def _own_memory_root(rank: int) -> None:
    """Each rank its own memory root, as each node has its own /dev/shm."""
    os.environ["GDSCKPT_MEMORY_ROOT"] = os.path.join(os.environ["TEST_MEMORY_ROOTS"], f"r{rank}")


def _killed_saving_step_2(rank: int, root: str, roots: str) -> None:
    """Step 1 on disk; rank 0 killed while saving step 2 into its memory tier, before its copy's
    commit record; rank 1 commits its copy, then is killed too (the job torn down)."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ["TEST_MEMORY_ROOTS"] = roots
    _own_memory_root(rank)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(root, "store-killed"), WORLD), rank=rank,
                            world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh
    from gdsckpt import Checkpointer
    from gdsckpt.manager.memory.tier import MemoryTier
    mesh = init_device_mesh("cpu", (WORLD,))
    ck = Checkpointer(Path(root) / "ck", memory=True, every_local=2, save_options=OPTS)
    ck.save(1, sharded(full_state(1), mesh))  # a DCP checkpoint
    if rank == 0:
        MemoryTier.commit = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    ck.save_async(2, sharded(full_state(2), mesh)).result()  # memory only
    os.kill(os.getpid(), signal.SIGKILL)


def _resume_after_the_kill(rank: int, root: Path, mesh) -> None:
    from gdsckpt import Checkpointer
    _own_memory_root(rank)
    ck = Checkpointer(root / "ck", memory=True, every_local=2, save_options=OPTS)
    _restores_exactly(ck, mesh, 1, "local")
    ck.save(2, sharded(full_state(2), mesh))  # on every rank (a DCP checkpoint: the manager's first save)
    dropped = ck.status()["memory"]["dropped"]  # rank 1's copy of step 2 went when the manager opened
    assert [(d["step"], d["why"]) for d in dropped] == ([] if rank == 0 else [
        (2, "rank(s) [0] hold no copy of it, so no rank restores it from memory")]), dropped
    ck.save(3, sharded(full_state(3), mesh))  # memory only
    _restores_exactly(ck, mesh, 3, "memory")

    # in the run: rank 0 has no room for step 5, rank 1 keeps it; a restore agrees on step 4, and
    # step 5 is saved again on every rank
    ck.save(4, sharded(full_state(4), mesh))  # a DCP checkpoint
    cap = ck.memory.tier.cap_bytes
    if rank == 0:
        ck.memory.tier.cap_bytes = 1
    ck.save_async(5, sharded(full_state(5), mesh))
    ck.wait()
    ck.memory.tier.cap_bytes = cap
    assert ck.memory.steps() == ([3] if rank == 0 else [3, 5]), ck.memory.steps()
    _restores_exactly(ck, mesh, 4, "local")
    assert ck.memory.steps() == [3] and ck.steps() == [1, 2, 3, 4]  # on every rank
    ck.save(5, sharded(full_state(5), mesh))  # on every rank (a DCP checkpoint: the 5th save)
    _restores_exactly(ck, mesh, 5, "local")
    ck.release_memory()
    ck.close()


def test_two_ranks_a_step_one_ranks_memory_kept_alone_is_saved_again(tmp_path):
    """Before, rank 1's leftover copy of step 2 counted there: the resumed run restored step 1 on
    every rank, then save(2) raised "step 2 is not newer than step 2, already committed" on rank
    1 alone while rank 0 waited in the save's collectives."""
    roots = Path(tempfile.mkdtemp(prefix="gdsckpt-test-", dir="/dev/shm"))
    try:
        for r in range(WORLD):
            (roots / f"r{r}").mkdir()
        ctx = start_ranks(_killed_saving_step_2, args=(str(tmp_path), str(roots)), nprocs=WORLD, join=False)
        deadline = time.monotonic() + 300
        for p in ctx.processes:
            p.join(max(0.1, deadline - time.monotonic()))
        codes = [p.exitcode for p in ctx.processes]
        for p in ctx.processes:
            if p.exitcode is None:
                p.kill()
        assert codes == [-signal.SIGKILL] * WORLD, codes
        records = [sorted(n for f in (roots / f"r{r}").iterdir() for n in os.listdir(f) if n.endswith(".commit"))
                   for r in range(WORLD)]
        assert records == [[], ["step_00000002.commit"]], records  # rank 1's tier alone kept step 2
        run_ranks(tmp_path, _resume_after_the_kill, env={"TEST_MEMORY_ROOTS": str(roots)}, pg_timeout=30, timeout=300)
    finally:
        shutil.rmtree(roots, ignore_errors=True)


# ---------------------------------------------------------------- values that differ across ranks under one key

def _values_that_differ_across_ranks(rank: int, root: Path, mesh) -> None:
    from gdsckpt import RNG, Checkpointer
    from gdsckpt.errors import UnsupportedStateError
    ck = Checkpointer(root / "ck", keep=2, save_options=OPTS)
    loader = {"epoch": 3, "pos": 100 + rank, "seen": {"a", "b", "c"}}  # a set: alike, whatever each hash seed
    with pytest.raises(UnsupportedStateError, match=r"^'loader\.pos' differ across ranks: DCP keeps one copy"):
        ck.save(1, sharded(full_state(1), mesh) | {"loader": loader})
    torch.manual_seed(rank)
    # the CUDA generators too, one per GPU of the host (the message names five, then "and N more")
    names = (r"^('extra\.rng\.cuda\.\d+', )*('extra\.rng\.numpy', )?('extra\.rng\.python\.1', "
             r"'extra\.rng\.torch'|'extra\.rng\.[\w.]+' and \d+ more) differ across ranks")
    with pytest.raises(UnsupportedStateError, match=names):  # an RNG() deeper than the top level
        ck.save_async(1, sharded(full_state(1), mesh) | {"extra": {"rng": RNG()}})  # refused in the call
    assert ck.steps() == []

    # each rank's under a key of its own, a top-level RNG(), values alike on every rank: saved, and
    # each rank restores its own
    state = sharded(full_state(1), mesh) | {f"loader_{rank}": loader, "rng": RNG(),
                                            "alike": {"epoch": 3, "seen": {"a", "b", "c"}}}
    ck.save_async(1, state)
    ck.wait()
    expected = torch.rand(4)
    torch.manual_seed(1000)
    target = sharded(full_state(0), mesh) | {f"loader_{rank}": {"epoch": 0, "pos": 0, "seen": set()}, "rng": RNG(),
                                             "alike": {"epoch": 0, "seen": set()}}
    assert ck.restore(target).step == 1
    same_local(target, sharded(full_state(1), mesh))
    assert target[f"loader_{rank}"] == loader and target["alike"] == {"epoch": 3, "seen": {"a", "b", "c"}}
    assert torch.equal(torch.rand(4), expected)  # this rank's generator, as it was at the save
    ck.close()


def test_two_ranks_values_that_differ_across_ranks(tmp_path):
    """Before, DCP saved rank 0's loader position (and RNG state) once, and rank 1 restored it as
    its own, without a word."""
    run_ranks(tmp_path, _values_that_differ_across_ranks, pg_timeout=30)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_ranks_values_that_differ_across_ranks_on_gpus(tmp_path):
    """The same with the shards on two GPUs and NCCL beside gloo."""
    run_ranks(tmp_path, _values_that_differ_across_ranks, pg_timeout=60, timeout=300, backend="cpu:gloo,cuda:nccl")


def _prune_on_every_rank(rank: int, root: Path, mesh) -> None:
    """prune() called on every rank (as every other call is): rank 0 removes what the policy lets
    go, and no rank fails on another's removals."""
    import logging
    from gdsckpt import Checkpointer
    ck = Checkpointer(root / "ck", keep=10, save_options=OPTS)
    for step in range(1, 5):
        ck.save(step, sharded(full_state(step), mesh))
    ck.close()
    warned = logged(level=logging.WARNING)
    ck = Checkpointer(root / "ck", keep=2, save_options=OPTS)
    assert ck.prune(dry_run=True)["local"] == [1, 2]
    dist.barrier()
    out = ck.prune()  # not a collective: another rank says what goes as it sees it, rank 0 done or not
    assert out["local"] == [1, 2] if rank == 0 else set(out["local"]) <= {1, 2}, out
    dist.barrier()
    assert ck.steps() == [3, 4] and not warned, warned
    ck.close()


def test_two_ranks_prune_on_every_rank(tmp_path):
    run_ranks(tmp_path, _prune_on_every_rank)
