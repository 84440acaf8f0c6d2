"""Peer replicas over NCCL on two GPUs, each rank a node with a memory root of its own: the images
go device to device (staging buffers on the wire's own stream, pieces in flight), and the rank
whose node is lost receives its image straight into device memory and decodes it there.
tests/manager/test_peer_replicas.py covers the same over gloo on the CPU."""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ckpt_tools import end_rank, join_ranks
from test_peer_replicas import kill_job, wait_for

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA GPUs")]

SAVES = 4  # the third and fourth reuse or drop the first two's segments, on both sides


def _model(seed: int):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(6)]).cuda()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model, opt, step: int) -> None:
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(step)).cuda()
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _flat(model, opt) -> dict:
    out = {f"model.{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        out.update({f"optim.{i}.{k}": v.detach().cpu().clone() for k, v in s.items() if torch.is_tensor(v)})
    return out


def _rank_main(rank: int, world: int, root: str, phase: str) -> None:
    root = Path(root)
    faulthandler.dump_traceback_later(100, exit=True)  # a hang shows every thread's stack
    # the node each rank runs on: its own in training; at the restore, as the test numbers them
    node = rank if phase == "train" else json.loads((root / "want.json").read_text())["nodes"][rank]
    os.environ["GDSCKPT_MEMORY_ROOT"] = str(root / f"mem-node{node}")
    warnings.filterwarnings("ignore")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(str(root / f"store-{phase}"), world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120),
                            device_id=torch.device("cuda", rank))
    try:
        from gdsckpt import Checkpointer
        # the directory shared, or (node-local) each node's own
        directory = root / f"dir-node{node}" / "ck" if (root / "node-local").exists() else root / "ck"
        ck = Checkpointer(directory, memory=True, every_local=100, replicas=1, node=node)
        if phase == "train":
            model, opt = _model(rank)
            for step in range(1, SAVES + 1):
                _step(model, opt, step)
                ck.save_async(step, {"model": model, "optim": opt})
                ck.wait()
                assert ck.memory.wait_replicas(60)
                torch.save(_flat(model, opt), root / f"state-{step}-r{rank}.pt")
            dist.barrier()
            rep = ck.status()["memory"]["replicas"]
            assert rep["steps"][SAVES]["replicated_on"] == [1 - rank], rep
            assert rep["held"] == {1 - rank: [SAVES - 1, SAVES]}, rep
            (root / f"ready-r{rank}").touch()
            faulthandler.cancel_dump_traceback_later()
            time.sleep(600)  # killed: a crash, no close()
        want = json.loads((root / "want.json").read_text())
        model, opt = _model(99)
        _step(model, opt, 0)  # the moments exist, with other values: the restore fills them all
        r = ck.restore({"model": model, "optim": opt})
        assert (r.step, r.source) == (want["step"], want["sources"][rank]), (rank, r.step, r.source, r.skipped)
        expected = torch.load(root / f"state-{r.step}-r{rank}.pt")
        got = _flat(model, opt)
        assert got.keys() == expected.keys()
        for k, v in got.items():
            assert torch.equal(v, expected[k]), k
        if phase == "again":  # killed before its next save: its step is on its holder by then
            assert ck.memory.wait_replicas(60)
            dist.barrier()
            st = ck.status()["memory"]
            if r.source == "memory":  # (a step received into device memory is in the tier from the next save)
                assert st["replicas"]["steps"][r.step]["replicated_on"] == [1 - rank], st
            assert r.step in st["replicas"]["held"][1 - rank], st
            (root / f"ready-again-r{rank}").touch()
            faulthandler.cancel_dump_traceback_later()
            time.sleep(600)
        ck.close()
    finally:
        dist.destroy_process_group()
    end_rank()


def _spawn(root: Path, phase: str):
    import torch.multiprocessing as mp
    (root / f"store-{phase}").unlink(missing_ok=True)
    return mp.start_processes(_rank_main, args=(2, str(root), phase), nprocs=2, join=False, start_method="spawn")


def _crash(node_local: bool = False):
    """Two nodes of one GPU each, killed after step 3 (steps 2 and 3 in memory only, each
    replicated on the other node)."""
    root = Path(tempfile.mkdtemp(prefix="gdsckpt-peers-gpu-", dir="/dev/shm"))
    try:
        for n in (0, 1):
            (root / f"mem-node{n}").mkdir()
        if node_local:
            (root / "node-local").touch()
        ctx = _spawn(root, "train")
        for r in (0, 1):
            wait_for(root / f"ready-r{r}", ctx, timeout=300)
        kill_job(ctx, [])
        shutil.copytree(root, root.with_name(root.name + "-pristine"), symlinks=True)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(root.with_name(root.name + "-pristine"), ignore_errors=True)


@pytest.fixture(scope="module")
def crashed():
    yield from _crash()


def _lose(root: Path, node: int) -> None:
    """The node is gone, its memory with it (and its own directory); its replacement's is empty."""
    shutil.rmtree(root / f"mem-node{node}")
    shutil.rmtree(root / f"dir-node{node}", ignore_errors=True)
    (root / f"mem-node{node}").mkdir()


def _after_loss(root: Path, step: int, sources: list, damage=None, nodes=(0, 1), again: bool = False) -> None:
    """Node 1 lost, the job back (again: back, killed before its next save, and node 1's
    replacement lost too)."""
    shutil.rmtree(root)
    shutil.copytree(root.with_name(root.name + "-pristine"), root, symlinks=True)
    _lose(root, 1)
    if again:
        (root / "want.json").write_text(json.dumps({"step": step, "sources": ["memory", "peer"], "nodes": [0, 1]}))
        ctx = _spawn(root, "again")
        for r in (0, 1):
            wait_for(root / f"ready-again-r{r}", ctx, timeout=300)
        kill_job(ctx, [1])
        _lose(root, 1)
    if damage is not None:
        damage(root)
    (root / "want.json").write_text(json.dumps({"step": step, "sources": sources, "nodes": list(nodes)}))
    join_ranks(_spawn(root, "resume"), "restore after the loss", 300)


def test_lost_gpu_node_restores_from_its_peer_over_nccl(crashed):
    _after_loss(crashed, SAVES, ["memory", "peer"])


def test_lost_gpu_node_twice_before_the_next_save(crashed):
    """Node 1 lost and the job back: rank 0's step, whose replica went with node 1, is sent again
    to the replacement over NCCL (rank 1's stays on node 0); killed before its next save and the
    replacement lost too: rank 1 receives its step from node 0 again, both bit-exact."""
    _after_loss(crashed, SAVES, ["memory", "peer"], again=True)


def test_lost_gpu_node_and_the_job_numbered_anew(crashed):
    """Node 1 lost and the ranks numbered the other way round (rank 0 on the replacement, rank 1
    on node 0): rank 0's copy, left on node 0 under its number, is sent to it over NCCL by rank
    1, which takes its own from the replica of it that node 0 kept (no wire)."""
    _after_loss(crashed, SAVES, ["peer", "memory"], nodes=(1, 0))


def test_damaged_replica_received_into_device_memory_is_refused(crashed):
    """The replica rank 0 holds of rank 1's step 3 damaged: the image received into device
    memory fails its chunk's checksum on the GPU, and both ranks fall back to step 2, which
    rank 1 receives intact."""
    def flip(root: Path) -> None:
        import gdsckpt.format.file as fmt
        folder, = (root / "mem-node0").glob("*-r1.replica-r0")
        rec = json.loads((folder / f"step_{SAVES:08d}.commit").read_text())
        with open(folder / rec["slot"], "r+b") as f:
            f.seek(fmt.HEADER_SIZE + 100)
            b = f.read(1)
            f.seek(fmt.HEADER_SIZE + 100)
            f.write(bytes([b[0] ^ 0x40]))
    _after_loss(crashed, SAVES - 1, ["memory", "peer"], damage=flip)


def test_lost_gpu_node_with_node_local_directories():
    """Each node with a directory of its own, lost with its memory: its rank receives its copy
    over NCCL, as with a shared directory."""
    for root in _crash(node_local=True):
        _after_loss(root, SAVES, ["memory", "peer"])
