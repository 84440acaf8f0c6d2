"""Peer replicas (Checkpointer(memory=True, replicas=1)) over gloo, in real processes: each
simulated node is one or more ranks with a memory root of its own (GDSCKPT_MEMORY_ROOT). The
checkpoint directory is shared, as under DCP it is, and holds only an older step (every_local):
the newer steps live in memory only, so a node lost takes them with it unless a peer holds them.

Where each node has a directory of its own (`node_local`: one path, another disk per node), that
directory restores nothing across ranks (rank 0's .metadata names files on other nodes): memory
and the peers' replicas are all there is.

A node is lost by kill -9 of every process of the job (torchrun ends a job's workers when one
node fails) and its memory root wiped; the replacement (new processes, an empty memory root)
restores from the peer that holds its replica."""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

from ckpt_tools import end_rank, join_ranks, logged, start_ranks  # noqa: E402

OPTS = {"chunk_bytes": 64 << 10}
STEPS = 8  # a run's length; saves at every step, the directory gets steps 1 and 1 + EVERY_LOCAL
EVERY_LOCAL = 100


# ------------------------------------------------------------------ a real (small) training run
def make_training(mesh, seed: int = 0):
    """A model whose weight is sharded over the ranks (a DTensor), its AdamW, and each step's data."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(distribute_tensor(torch.randn(16, 8, generator=g), mesh, [Shard(0)]))
    model.b = torch.nn.Parameter(distribute_tensor(torch.zeros(8), mesh, [Replicate()]))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, foreach=False)
    return model, opt


def train_step(model, opt, mesh, step: int) -> float:
    from torch.distributed.tensor import Replicate, distribute_tensor
    g = torch.Generator().manual_seed(1000 + step)
    x = distribute_tensor(torch.randn(32, 16, generator=g), mesh, [Replicate()])
    y = distribute_tensor(torch.randn(32, 8, generator=g), mesh, [Replicate()])
    loss = ((x @ model.w + model.b - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.full_tensor())


def _rank_main(rank: int, world: int, root: str, scenario, nodes: list, phase: str, pg_timeout: float) -> None:
    node = nodes[rank]
    os.environ["GDSCKPT_MEMORY_ROOT"] = str(Path(root) / f"mem-node{node}")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    root = Path(root)
    dist.init_process_group("gloo", store=dist.FileStore(str(root / f"store-{phase}"), world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=pg_timeout))
    try:
        from torch.distributed.device_mesh import init_device_mesh
        scenario(rank, root, init_device_mesh("cpu", (world,)), node, phase)
    finally:
        dist.destroy_process_group()
    end_rank()


def spawn(root: Path, scenario, nodes: list, phase: str, pg_timeout: float = 60):
    for n in set(nodes):
        (root / f"mem-node{n}").mkdir(exist_ok=True)
    (root / f"store-{phase}").unlink(missing_ok=True)
    (root / "nodes.json").write_text(json.dumps(nodes))
    return start_ranks(_rank_main, args=(len(nodes), str(root), scenario, nodes, phase, pg_timeout),
                       nprocs=len(nodes), join=False)


def run(root: Path, scenario, nodes: list, phase: str, timeout: float = 150, pg_timeout: float = 60) -> None:
    join_ranks(spawn(root, scenario, nodes, phase, pg_timeout), f"{scenario.__name__} {phase}", timeout)


def wait_for(path: Path, ctx, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        for p in ctx.processes:
            if p.exitcode is not None and p.exitcode != 0:
                ctx.join(0.1)  # raises the rank's error
        if time.monotonic() > deadline:
            pytest.fail(f"{path.name} never appeared")
        time.sleep(0.1)


def kill_job(ctx, lost: list[int]) -> None:
    """kill -9: the lost node's processes first, then the rest (torchrun ends the job)."""
    order = lost + [r for r in range(len(ctx.processes)) if r not in lost]
    for r in order:
        os.kill(ctx.processes[r].pid, signal.SIGKILL)
    for p in ctx.processes:
        p.join(30)


def losses_path(root: Path, phase: str, rank: int) -> Path:
    return root / f"losses-{phase}-r{rank}.json"


def local_bytes(module) -> dict:
    from torch.distributed.tensor import DTensor
    return {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone() for k, v in module.state_dict().items()}


def ck_dir(root: Path, node: int) -> Path:
    """The checkpoint directory: shared, or the node's own where the run has node-local directories."""
    return root / f"dir-node{node}" / "ck" if (root / "node-local").exists() else root / "ck"


def replicas_of(root: Path) -> int:
    """The run's replicas= (1 unless the crash was made with more)."""
    return int((root / "replicas").read_text()) if (root / "replicas").exists() else 1


def ck_remote(root: Path) -> str | None:
    """The run's object store (remote=), if it has one."""
    return (root / "remote").read_text() if (root / "remote").exists() else None


# ------------------------------------------------------------------ scenarios
def _train(rank, root, mesh, node, phase):
    """The uninterrupted run (its losses), then the same run saving every step (replicas=1),
    which stops after step 5's replicas are committed, says so, and waits to be killed."""
    from gdsckpt import Checkpointer
    model, opt = make_training(mesh)
    reference = {step: train_step(model, opt, mesh, step) for step in range(1, STEPS + 1)}
    losses_path(root, "reference", rank).write_text(json.dumps(reference))
    model, opt = make_training(mesh)
    ck = Checkpointer(ck_dir(root, node), memory=True, every_local=EVERY_LOCAL, save_options=OPTS, replicas=replicas_of(root),
                      node=node, remote=ck_remote(root))
    losses = {}
    for step in range(1, 6):
        losses[step] = train_step(model, opt, mesh, step)
        ck.save_async(step, {"model": model, "optim": opt})
        ck.wait()
        assert ck.memory.wait_replicas(60)
        torch.save(local_bytes(model), root / f"model-at-{step}-r{rank}.pt")
    dist.barrier()  # every origin acknowledged: every holder committed
    if ck_remote(root) is not None:  # step 1, the directory's, on the store: every directory's part of it
        ck.wait(uploads=True, timeout=60)
        dist.barrier()
        if rank == 0:
            assert list(ck.remote_steps()) == [1], ck.status()["errors"]
            names = ck.remote.store.list()
            assert not [n for n in names if ".part-" in n], names  # the parts' records go once committed
            assert {n.rsplit("/", 1)[-1] for n in names if n.startswith("step_00000001/")} >= \
                {f"__{r}_0.gdsckpt" for r in range(dist.get_world_size())}, names
    st = ck.status()["memory"]
    rep = st["replicas"]
    from gdsckpt.manager.replicas.placement import held_for, ring
    placement = ring([str(n) for n in json.loads((root / "nodes.json").read_text())], replicas_of(root))
    assert st["steps"] == [4, 5] and rep["holders"] == placement[rank], rep
    assert rep["held_for"] == held_for(placement, rank), rep
    assert rep["steps"][5]["replicated_on"] == rep["steps"][4]["replicated_on"] == sorted(rep["holders"]), rep
    assert rep["held"] == {o: [4, 5] for o in rep["held_for"]}, rep  # keep_memory=2 replicas too
    assert rep["held_bytes"] > 0 and st["held_bytes"] <= st["cap_bytes"]
    # the wire's timings of the last step, on both ends (status()'s trace of a replication)
    assert rep["last"]["step"] == 5 and rep["last"]["wire"][rep["holders"][0]]["bytes"] == rep["last"]["bytes"]
    assert all(rep["received"][o]["step"] == 5 and rep["received"][o]["seconds"] > 0 for o in rep["held_for"]), rep
    losses_path(root, "crash", rank).write_text(json.dumps(losses))
    (root / f"ready-r{rank}").touch()
    time.sleep(600)  # training goes on, as far as this rank knows; kill -9 ends it


def _resume(rank, root, mesh, node, phase):
    """A new job after the loss: restore, check the step and each rank's source, the model bit
    for bit against the one saved at that step, then train on to STEPS."""
    from gdsckpt import Checkpointer
    want = json.loads((root / "want.json").read_text())
    model, opt = make_training(mesh, seed=99)  # other values: the restore must fill them all
    ck = Checkpointer(ck_dir(root, node), memory=True, every_local=EVERY_LOCAL, save_options=OPTS, replicas=replicas_of(root),
                      node=node, remote=ck_remote(root))
    if want["step"] is None:  # nothing every rank can restore: every rank says so, and all start afresh
        from gdsckpt.errors import NoCheckpointError
        with pytest.raises(NoCheckpointError, match=want["skipped"][0]):
            ck.restore({"model": model, "optim": opt})
        model, opt = make_training(mesh)
        start = 0
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = ck.restore({"model": model, "optim": opt})
        assert (r.step, r.source) == (want["step"], want["sources"][rank]), (rank, r.step, r.source, r.skipped)
        for text in want["skipped"]:
            assert any(text in why for _, _, why in r.skipped), (text, r.skipped)
        expected = torch.load(root / f"model-at-{r.step}-r{rank}.pt")
        for k, v in local_bytes(model).items():
            assert torch.equal(v, expected[k]), k
        start = r.step
    losses = {}
    for step in range(start + 1, STEPS + 1):
        losses[step] = train_step(model, opt, mesh, step)
        ck.save_async(step, {"model": model, "optim": opt})
        ck.wait()
    assert ck.memory.steps() == [STEPS - 1, STEPS]
    if ck_remote(root) is not None:  # the first step after the restore, written to the directories, is on the store
        ck.wait(uploads=True, timeout=60)
        dist.barrier()
        assert max(ck.remote_steps()) == start + 1, (rank, ck.remote_steps(), ck.status()["errors"])
    losses_path(root, "resume", rank).write_text(json.dumps(losses))
    ck.close()


NODES = [0, 1, 2]  # one rank each: rank r's replica is held by rank r + 1 (mod 3)


def _crash(nodes: list, node_local: bool = False, remote: str | None = None, replicas: int = 1):
    """A job killed (kill -9, every process) after step 5, steps 2-5 in memory only."""
    root = Path(tempfile.mkdtemp(prefix="gdsckpt-peers-", dir="/dev/shm"))
    try:
        if node_local:
            (root / "node-local").touch()
        if replicas != 1:
            (root / "replicas").write_text(str(replicas))
        if remote is not None:
            (root / "remote").write_text(remote)
        ctx = spawn(root, _train, nodes, "crash")
        for r in range(len(nodes)):
            wait_for(root / f"ready-r{r}", ctx, timeout=300)
        kill_job(ctx, [])
        for n in set(nodes):
            assert sorted(p.name for p in ck_dir(root, n).iterdir() if p.name.startswith("step_")) == ["step_00000001"]
        # each test starts from this moment, at the same paths (the memory folders' names hash the
        # checkpoint directory's path)
        shutil.copytree(root, root.with_name(root.name + "-pristine"), symlinks=True)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(root.with_name(root.name + "-pristine"), ignore_errors=True)


@pytest.fixture(scope="module")
def crashed():
    """Three nodes of one rank each, killed after step 5."""
    yield from _crash(NODES)


def _restored_then_killed(rank, root, mesh, node, phase):
    """The job back after a node's loss, killed again before its next save: by then every rank
    holds step 5 in its own memory (a rank that received it too) and on its holder (rank 0's
    holder is the replacement node, which held nothing: the restore sent it step 5 again)."""
    from gdsckpt import Checkpointer
    model, opt = make_training(mesh, seed=99)
    ck = Checkpointer(ck_dir(root, node), memory=True, every_local=EVERY_LOCAL, save_options=OPTS, replicas=replicas_of(root),
                      node=node, remote=ck_remote(root))
    assert ck.restore({"model": model, "optim": opt}).step == 5
    assert ck.memory.wait_replicas(60)
    dist.barrier()  # every origin acknowledged: every holder committed
    st = ck.status()["memory"]
    rep = st["replicas"]
    assert 5 in st["steps"] and rep["steps"][5]["replicated_on"] == sorted(rep["holders"]), (rank, st)
    assert all(5 in rep["held"][o] for o in rep["held_for"]), (rank, rep)
    lost = json.loads((root / "lost.json").read_text())
    # sent again to the holders on the lost nodes only (the others held it all along)
    sent = sorted(h for h in rep["holders"] if NODES[h] in lost)
    assert (sorted(rep["last"]["wire"]) if rep["last"] else []) == sent, (rank, rep["last"], sent)
    (root / f"ready-{phase}-r{rank}").touch()
    time.sleep(600)


def _after_loss(root: Path, lost: list, step: int, sources: list, skipped=(), damage=None, nodes=NODES,
                left=None, again=()) -> None:
    """The job of the pristine crash back after the nodes `lost` (then, `again`: back, killed
    before its next save and the nodes `again` lost too), restored and trained on to STEPS."""
    shutil.rmtree(root)
    shutil.copytree(root.with_name(root.name + "-pristine"), root, symlinks=True)
    for n in lost:  # the node is gone, its memory with it (and its own directory, if it had one)
        shutil.rmtree(root / f"mem-node{n}")
        shutil.rmtree(root / f"dir-node{n}", ignore_errors=True)
    if again:
        (root / "lost.json").write_text(json.dumps(lost))
        ctx = spawn(root, _restored_then_killed, nodes, "again")
        for r in range(len(nodes)):
            wait_for(root / f"ready-again-r{r}", ctx, timeout=300)
        kill_job(ctx, [r for r, n in enumerate(nodes) if n in again])
        for n in again:
            shutil.rmtree(root / f"mem-node{n}")
            shutil.rmtree(root / f"dir-node{n}", ignore_errors=True)
    if damage is not None:
        damage(root)
    (root / "want.json").write_text(json.dumps({"step": step, "sources": sources, "skipped": list(skipped)}))
    try:
        run(root, _resume, nodes, "resume", timeout=300)
        for r in range(len(nodes)):
            ref = json.loads(losses_path(root, "reference", r).read_text())
            before = {k: v for k, v in json.loads(losses_path(root, "crash", r).read_text()).items()
                      if int(k) <= (step or 0)}
            after = json.loads(losses_path(root, "resume", r).read_text())
            assert {**before, **after} == ref, (r, before, after, ref)  # bit-equal floats, every step
        if left is not None:  # {node: the memory folders' names it holds after the resumed run}
            names = {n: sorted(re.search(r"-(r\d+(?:\.replica-r\d+)?)$", p.name).group(1)
                               for p in (root / f"mem-node{n}").iterdir()) for n in set(nodes)}
            assert names == left, names
    finally:
        (root / "want.json").unlink(missing_ok=True)


def test_node_lost_restores_from_its_peer(crashed):
    """Node 1 lost: its replacement's rank receives step 5 from rank 2, which held its replica;
    every rank restores step 5 (not step 1, the newest on disk), bit-exact; the losses of the
    resumed run equal the uninterrupted run's."""
    _after_loss(crashed, lost=[1], step=5, sources=["memory", "peer", "memory"])


def test_node_lost_again_before_the_next_save(crashed):
    """Node 1 lost, the job back from its peers, then killed before its next save and node 0 lost
    too: rank 0's replica of step 5 was on node 1 and went with the first loss, but the restore
    sent it again to the replacement, so rank 0 receives step 5 from it (not step 1 from the
    directory), rank 1 restores the copy it received the first time, all bit-exact, and the
    resumed losses equal the uninterrupted run's."""
    _after_loss(crashed, lost=[1], again=[0], step=5, sources=["peer", "memory", "memory"])


@pytest.fixture(scope="module")
def crashed_replicas2():
    """Three nodes of one rank each, replicas=2 (every rank's steps on both other nodes)."""
    yield from _crash(NODES, replicas=2)


def test_replicas2_node_lost_again_before_the_next_save(crashed_replicas2):
    """replicas=2: node 1 lost, the job back: each of ranks 0 and 2 sends step 5 again to node 1
    alone (its other holder kept it); killed before the next save, then nodes 0 and 2 both lost:
    their ranks receive step 5 from node 1, bit-exact, losses as uninterrupted."""
    _after_loss(crashed_replicas2, lost=[1], again=[0, 2], step=5, sources=["peer", "memory", "peer"])


def test_node_and_its_replica_holder_lost_all_fall_back_together(crashed):
    """Nodes 1 and 2 lost: rank 1's step 5 was on node 1 and its replica on node 2, so no step
    after 1 can be had by every rank: all restore step 1 from the directory, rank 0 too, whose
    memory still holds steps 4 and 5 (dropped then: the run goes on from step 1)."""
    _after_loss(crashed, lost=[1, 2], step=1, sources=["local"] * 3)


def _flip_replica_byte(root: Path) -> None:
    """A byte of rank 1's replica of step 5, held on node 2, flipped (a chunk's, past the header)."""
    folder, = (root / "mem-node2").glob("*-r1.replica-r2")
    rec = json.loads((folder / "step_00000005.commit").read_text())
    import gdsckpt.format.file as fmt
    with open(folder / rec["slot"], "r+b") as f:
        f.seek(fmt.HEADER_SIZE + 100)
        b = f.read(1)
        f.seek(fmt.HEADER_SIZE + 100)
        f.write(bytes([b[0] ^ 0x40]))


def test_damaged_replica_is_refused_and_all_fall_back(crashed):
    """Node 1 lost, and its replica of step 5 on node 2 damaged: the replacement refuses it
    (a chunk's checksum) and every rank falls back together, to step 4, which rank 1 receives
    intact from the same holder."""
    _after_loss(crashed, lost=[1], step=4, sources=["memory", "peer", "memory"],
                skipped=["rank(s) [1] could not restore step 5 from a peer's replica"], damage=_flip_replica_byte)


def test_node_lost_and_the_job_numbered_anew(crashed):
    """Node 1 lost, and the new job numbers the nodes otherwise (torchrun's rendezvous orders them
    by host name: a replacement's may sort first): rank 0 now runs on node 2, rank 1 on node 0,
    rank 2 on the replacement. No rank finds its copy under its own number, yet each is on some
    node: rank 0's own copy on node 0, rank 1's replica on node 2, rank 2's own copy on node 2.
    Every rank receives its step 5 from the node that has it, bit-exact, the losses as the
    uninterrupted run's; the copies left under the old numbers are removed after the restore."""
    left = {2: ["r0", "r2.replica-r0"], 0: ["r0.replica-r1", "r1"], 1: ["r1.replica-r2", "r2"]}
    _after_loss(crashed, lost=[1], step=5, sources=["peer", "peer", "peer"], nodes=[2, 0, 1], left=left)


def _resume_in_another_world(rank, root, mesh, node, phase):
    """Two ranks where three saved: their memory copies and replicas are another sharding's, so
    every rank restores step 1 from the directory, which DCP reshards, and a warning says why."""
    from gdsckpt import Checkpointer
    from torch.distributed.tensor import DTensor
    model, opt = make_training(mesh, seed=99)
    said = logged()
    ck = Checkpointer(ck_dir(root, node), memory=True, every_local=EVERY_LOCAL, save_options=OPTS, replicas=1,
                      node=node)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = ck.restore({"model": model, "optim": opt})
    assert (r.step, r.source) == (1, "local"), (rank, r.step, r.source, r.skipped)
    saved = [torch.load(root / f"model-at-1-r{o}.pt") for o in range(3)]
    whole = torch.cat([s["w"] for s in saved])  # the weight, sharded by rows over the three ranks
    got = model.w.full_tensor() if isinstance(model.w, DTensor) else model.w
    assert torch.equal(got, whole) and torch.equal(local_bytes(model)["b"], saved[0]["b"])
    said = " ".join(said)
    if rank == 0:
        assert "were kept for a job of 3 ranks, and this one has 2" in said and "DCP reshards" in said, said
    ck.close()


def test_another_world_size_restores_from_the_directory_resharded(crashed):
    """The job back on two nodes where it ran on three (node 1 lost, no replacement): every rank
    restores step 1 from the directory, resharded, and the log says why not from memory."""
    root = crashed
    shutil.rmtree(root)
    shutil.copytree(root.with_name(root.name + "-pristine"), root, symlinks=True)
    shutil.rmtree(root / "mem-node1")
    run(root, _resume_in_another_world, [0, 2], "resume", timeout=300)


def test_two_nodes_of_two_ranks_node_lost():
    """Two nodes of two processes each (ranks 0, 1 on node 0; 2, 3 on node 1): each rank's replica
    is held by the rank of the same local index on the other node. Node 1 lost: ranks 2 and 3
    receive step 5 from ranks 0 and 1. Then, from the same moment, no node lost but the job
    numbered the other way round (ranks 0, 1 on node 1): each rank finds its step 5 on its own
    node, in the replica the other numbering kept there, and takes it without the wire."""
    nodes = [0, 0, 1, 1]
    for root in _crash(nodes):
        _after_loss(root, lost=[1], step=5, sources=["memory", "memory", "peer", "peer"], nodes=nodes)
        left = {1: ["r0", "r1", "r2.replica-r0", "r3.replica-r1"], 0: ["r0.replica-r2", "r1.replica-r3", "r2", "r3"]}
        _after_loss(root, lost=[], step=5, sources=["memory"] * 4, nodes=[1, 1, 0, 0], left=left)


@pytest.fixture(scope="module")
def crashed_node_local():
    """Three nodes of one rank each, each with a directory of its own, killed after step 5."""
    yield from _crash(NODES, node_local=True)


def test_node_local_directories_node_lost_restores_from_its_peer(crashed_node_local):
    """Each node with its own directory (its memory and directory lost together): rank 1's
    replacement receives step 5 from its peer, as with a shared directory."""
    _after_loss(crashed_node_local, lost=[1], step=5, sources=["memory", "peer", "memory"])


@pytest.fixture
def crashed_node_local_with_store(s3_server):
    """As crashed_node_local, with an object store of its own (a resumed run uploads to it): step
    1 uploaded, each node sending its part."""
    saved = dict(os.environ)
    os.environ.update(s3_server.env())
    try:
        yield from _crash(NODES, node_local=True, remote=f"s3://{s3_server.new_bucket()}/run")
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_node_local_directories_with_a_store_node_lost_restores_from_its_peer(crashed_node_local_with_store):
    """Node 1 lost with its directory: its rank restores from its peer; the replacement has no
    part of the step the store already has, and the new run does not wait for one."""
    _after_loss(crashed_node_local_with_store, lost=[1], step=5, sources=["memory", "peer", "memory"])


def test_node_local_directories_with_a_store_rank_0s_node_lost(crashed_node_local_with_store):
    """Node 0 lost, and with it the directory that held the .metadata of every step: rank 0
    restores from its peer; the next step written to the directories reaches the store."""
    root = crashed_node_local_with_store
    _after_loss(root, lost=[0], step=5, sources=["peer", "memory", "memory"])


def test_node_local_directories_node_and_its_holder_lost_back_to_the_store(crashed_node_local_with_store):
    """Nodes 1 and 2 lost with their directories, and an object store: every rank restores step 1
    from it (downloaded onto each node's directory, the three nodes' parts of it), bit-exact, and
    the resumed losses are the uninterrupted run's."""
    _after_loss(crashed_node_local_with_store, lost=[1, 2], step=1, sources=["remote"] * 3)


def test_node_local_directories_node_and_its_holder_lost(crashed_node_local):
    """Nodes 1 and 2 lost with their directories: step 1, in node 0's directory, names files that
    were on the others, and no step is in memory on every rank. Every rank raises
    NoCheckpointError saying the directory is not shared; all start afresh, and step 1 saved again
    (rank 0 still has a folder of it) runs on every rank alike: the run's losses are the
    uninterrupted run's."""
    _after_loss(crashed_node_local, lost=[1, 2], step=None, sources=[],
                skipped=[r"the ranks do not share the directory: ranks \[0\] \| \[1\] \| \[2\]"])


def _node_local_retention(rank, root, mesh, node, phase):
    """Two nodes of two ranks, each node a directory of its own, no memory tier, keep=2: rank 0's
    retention removes steps from its directory, and the other node's first rank removes its
    folders of them at the next save; both say the directory is node-local."""
    from gdsckpt import Checkpointer
    ck = Checkpointer(ck_dir(root, node), keep=2, save_options=OPTS)
    assert ck.sharing.node_local and ck.status()["node_local_directory"] == "ranks [0, 1] | [2, 3]"
    state = {f"w{rank}": torch.full((64, 16), float(rank))}
    for step in range(1, 6):
        ck.save(step, state)
    dist.barrier()
    if node == 0:
        assert ck.layout.local_steps() == [4, 5], (rank, ck.layout.local_steps(), ck.layout.folders())
    else:  # no .metadata here: folders of its ranks' files only, those of step 3 left for the next save
        assert ck.layout.local_steps() == [] and ck.layout.folders() == [3, 4, 5], ck.layout.folders()
    ck.rollback(4)  # rank 0 removes step 5; the other directory follows at the next save
    ck.save(5, {f"w{rank}": torch.full((64, 16), -float(rank))})
    dist.barrier()
    if node == 1:
        assert ck.layout.folders() == [4, 5], ck.layout.folders()
    ck.close()


def test_node_local_directories_found_and_kept_in_step(shm_tmp):
    """(Also: the probe files an open killed midway left, an hour old or more, are removed by the
    next open; a newer one, maybe another open's now, is left.)"""
    (shm_tmp / "node-local").touch()
    for n in (0, 1):
        ck_dir(shm_tmp, n).mkdir(parents=True)
        old, new = ck_dir(shm_tmp, n) / ".gdsckpt-probe-0123456789abcdef-r3", ck_dir(shm_tmp, n) / ".gdsckpt-probe-fe-r1"
        old.touch()
        new.touch()
        os.utime(old, (time.time() - 7200, time.time() - 7200))
    run(shm_tmp, _node_local_retention, [0, 0, 1, 1], "retention")
    for n in (0, 1):
        assert [p.name for p in ck_dir(shm_tmp, n).iterdir() if p.name.startswith(".gdsckpt-probe")] == \
            [".gdsckpt-probe-fe-r1"]


# ------------------------------------------------------------------ replicas' segments made ahead
def _reserved(rank, root, mesh, node, phase):
    """Checkpointer.reserve makes the segments of the replicas a rank holds, with its own, before
    any save: the replicas then go into those (none is made beside training)."""
    from gdsckpt import Checkpointer
    model, opt = make_training(mesh)
    train_step(model, opt, mesh, 1)
    ck = Checkpointer(ck_dir(root, node), memory=True, every_local=EVERY_LOCAL, save_options=OPTS, replicas=1,
                      node=node, remote=ck_remote(root))
    ck.reserve({"model": model, "optim": opt}, wait=True)
    folder, = (root / f"mem-node{node}").glob(f"*.replica-r{rank}")
    made = {p.name for p in folder.glob("slot-*")}
    assert len(made) == 2, made  # keep_memory's two
    dist.barrier()
    for step in range(1, 5):
        train_step(model, opt, mesh, step + 1)
        ck.save_async(step, {"model": model, "optim": opt})
        ck.wait()
        assert ck.memory.wait_replicas(60)
    dist.barrier()
    used = {json.loads(p.read_text())["slot"] for p in folder.glob("step_*.commit")}
    assert len(used) == 2 and used <= made and {p.name for p in folder.glob("slot-*")} == made, (used, made)
    ck.close()


def test_reserve_makes_the_replicas_segments_ahead(shm_tmp):
    run(shm_tmp, _reserved, [0, 1], "reserve")


# ------------------------------------------------------------------ a holder that hangs, then dies
def _hung_holder(rank, root, mesh, node, phase):
    """Rank 1 (rank 0's holder) is stopped (SIGSTOP) by the test, then killed: rank 0's saves
    are not blocked; its step 2 is not replicated within the bound, and status() says so."""
    import gdsckpt.manager.replicas.wire
    from gdsckpt import Checkpointer
    gdsckpt.manager.replicas.wire.REPLICA_TIMEOUT_S = 2.0  # the bound, short for the test
    ck = Checkpointer(ck_dir(root, node), memory=True, every_local=EVERY_LOCAL, save_options=OPTS, replicas=1,
                      node=node, remote=ck_remote(root))
    # each rank's values under keys of its own (DCP keeps one copy of a key every rank names)
    state = {f"w{rank}": torch.full((256, 64), float(rank)), f"b{rank}": torch.arange(100.0) + rank}
    for step in (1, 2):  # 1: a DCP checkpoint in the directory; 2: in memory, replicated
        ck.save_async(step, state)
        ck.wait()
    assert ck.memory.wait_replicas(60)
    dist.barrier()
    assert ck.status()["memory"]["replicas"]["steps"][2]["replicated_on"] == [1 - rank]
    if rank == 1:
        (root / "stop-me").touch()
        time.sleep(600)  # stopped, then killed, by the test
    while not (root / "stopped").exists():
        time.sleep(0.05)
    t = time.perf_counter()
    ck.save_async(3, state)
    ck.wait()
    save_seconds = time.perf_counter() - t
    t = time.perf_counter()
    assert ck.memory.wait_replicas(60)
    replication_seconds = time.perf_counter() - t
    ck.save_async(4, state)  # after the channel closed: not sent at all
    ck.wait()
    assert ck.memory.wait_replicas(10)
    st = ck.status()["memory"]
    rep = st["replicas"]
    assert st["steps"] == [3, 4] and rep["steps"][3]["replicated_on"] == [] and rep["steps"][4]["replicated_on"] == []
    assert rep["steps"][3]["holders"][1].startswith("failed: receiving from rank 1"), rep
    assert rep["steps"][4]["holders"][1].startswith("not sent: the channel to rank 1 is closed"), rep
    assert 1 in rep["closed"]
    (root / "result.json").write_text(json.dumps({"save": save_seconds, "replication": replication_seconds}))
    while not (root / "killed").exists():
        time.sleep(0.05)
    ck.close()  # not blocked by the dead holder either
    (root / "closed").touch()
    end_rank()  # no destroy_process_group: its peer is dead


def test_holder_hung_then_killed_mid_replication_blocks_nothing(shm_tmp):
    root = shm_tmp
    ctx = spawn(root, _hung_holder, [0, 1], "hang", pg_timeout=60)
    try:
        wait_for(root / "stop-me", ctx)
        os.kill(ctx.processes[1].pid, signal.SIGSTOP)
        (root / "stopped").touch()
        wait_for(root / "result.json", ctx)
        os.kill(ctx.processes[1].pid, signal.SIGKILL)
        (root / "killed").touch()
        ctx.processes[0].join(60)
        assert ctx.processes[0].exitcode == 0 and (root / "closed").exists()
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    result = json.loads((root / "result.json").read_text())
    assert result["save"] < 1.5, result  # the save never waits for replication
    assert 1.5 < result["replication"] < 10, result  # the bound: REPLICA_TIMEOUT_S, 2 s here


# ------------------------------------------------------------------ the cap, shared with replicas
def _tight_cap(rank, root, mesh, node, phase):
    """A cap of two own segments and one and a half replicas per rank (a replica's segment is its
    image's size; an own one has the index's allowance): every own step is kept in memory
    (replicas give way to it where they may), an offer that finds no room is refused and
    reported, the newest replica held is never given up, and what the rank holds never passes
    the cap."""
    from gdsckpt import Checkpointer
    torch.manual_seed(rank)
    state = {"model": torch.nn.Linear(64, 128), f"n{rank}": torch.arange(50) + rank}  # a module: room from its shards
    ck = Checkpointer(root / "measure", memory=True, every_local=EVERY_LOCAL, save_options=OPTS, replicas=1,
                      node=node)
    for step in (1, 2):
        ck.save(step, state)
    segment, image = ck.memory.tier.copy(2).slot.size(), ck.memory.tier.copy(2).nbytes
    ck.release_memory()
    ck.close()
    ck = Checkpointer(root / "ck", memory=True, every_local=EVERY_LOCAL, save_options=OPTS, replicas=1, node=node,
                      memory_bytes=2 * segment + image + image // 2)
    for step in range(1, 7):
        for turn in (1, 0):  # rank 1 first: rank 0 holds rank 1's replica of a step before its own copy of it
            if rank == turn or step == 1:  # (step 1: a DCP checkpoint, a collective)
                ck.save(step, state)
                assert ck.memory.wait_replicas(60)
            dist.barrier()
            if step == 1:
                break
        st = ck.status()["memory"]
        assert st["held_bytes"] + st["replicas"]["held_bytes"] <= st["cap_bytes"], st
        assert not st["fallbacks"], st["fallbacks"]  # no own step went without its memory copy
    st = ck.status()["memory"]
    rep = st["replicas"]
    assert st["steps"] == [5, 6], st
    outcomes = {s: rep["steps"][s]["holders"][1 - rank] for s in st["steps"]}
    assert all(w == "committed" or w.startswith("refused by rank") for w in outcomes.values()), outcomes
    refused = [r for r in rep["refused"] if r["origin"] == 1 - rank]
    assert all("no room" in r["why"] for r in refused), rep
    if rank == 0:  # replicas it held gave way to its own steps
        assert any(d["why"] == "room for the rank's own step" for d in rep["dropped"]), rep
    else:  # its own two copies left no room beside the newest replica: offers refused
        assert refused, rep
    assert len(rep["held"][1 - rank]) >= 1  # the newest replica held is never given up for room
    ck.close()


def test_replicas_share_the_memory_cap(shm_tmp):
    run(shm_tmp, _tight_cap, [0, 1], "cap")
