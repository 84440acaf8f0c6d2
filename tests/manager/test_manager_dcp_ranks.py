"""A distributed Checkpointer keeps its ranks in step with each other and with the training loop
(2 CPU ranks over gloo, real processes): save_async's collectives, which run on DCP's thread,
never pair with the loop's own on the default group; a step one rank's memory tier kept and
another's lost (a rank killed while saving it) counts on no rank, so that the resumed run saves
it again on every rank."""

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

from ckpt_tools import end_rank  # noqa: E402
from test_manager_dcp import WORLD, full_state, run_ranks, same_local, sharded  # noqa: E402

OPTS = {"chunk_bytes": 64 << 10}


def _restores_exactly(ck, mesh, step: int, source: str) -> None:
    target = sharded(full_state(0), mesh)
    r = ck.restore(target)
    assert (r.step, r.source) == (step, source), r
    same_local(target, sharded(full_state(step), mesh))


# ---------------------------------------------------------------- save_async beside the loop's collectives

def _training_collectives(rank: int, step: int) -> None:
    """What a training loop runs on the default group between checkpoints: DDP's all_reduces, a
    loss averaged, a barrier; each result checked (a collective paired with another's buffer
    would be wrong, not only late)."""
    for i in range(3):
        t = torch.full((16,), float(rank + step + i))
        dist.all_reduce(t)
        assert t.tolist() == [float(2 * (step + i) + 1)] * 16, (step, i, t)
    dist.barrier()


def _save_async_beside_training(rank: int, root: Path, mesh) -> None:
    from gdsckpt import Checkpointer
    ck = Checkpointer(root / "ck", keep=2, save_options=OPTS)
    for s in range(1, 6):
        ck.save_async(s, sharded(full_state(s), mesh))  # DCP plans and commits on its thread
        _training_collectives(rank, s)  # meanwhile, on the main thread
    ck.wait()
    dist.barrier()  # rank 0's retention is done
    assert ck.layout.local_steps() == [4, 5]
    # the memory tier's steps due in the directory are DCP checkpoints, saved the same way
    memory = Checkpointer(root / "ck-memory", memory=True, every_local=2, save_options=OPTS)
    for s in range(1, 5):
        memory.save_async(s, sharded(full_state(s), mesh))
        _training_collectives(rank, s)
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
