"""gdsckpt.Checkpointer under torch.distributed (2 CPU ranks over gloo): one DCP directory per step
(GdsckptWriter), the same calls on every rank, rank 0 uploading to a real S3 server (SeaweedFS),
an overlapped save_async (optimizer=, DTensor parameters), restore of a local step, fall-back past a damaged step on every rank alike, and restore of a
step that only the store still has."""

from __future__ import annotations

import datetime
import enum
import os
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

from ckpt_tools import end_rank, join_ranks, logged, start_ranks  # noqa: E402
from gdsckpt.errors import GdsckptError  # noqa: E402
from gdsckpt.manager.steps import step_name  # noqa: E402

WORLD = 2


def full_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(9, 4, generator=g), "emb": torch.randn(6, 3, generator=g).to(torch.bfloat16),
            "step": torch.tensor(float(seed)), "meta": {"seed": seed}}


def sharded(full: dict, mesh) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor
    return {k: distribute_tensor(v, mesh, [Shard(0)]) if k in ("w", "emb") else
            (v.clone() if isinstance(v, torch.Tensor) else dict(v)) for k, v in full.items()}


def same_local(a: dict, b: dict) -> None:
    from torch.distributed.tensor import DTensor
    for k in ("w", "emb", "step"):
        x, y = a[k], b[k]
        x = x.to_local() if isinstance(x, DTensor) else x
        y = y.to_local() if isinstance(y, DTensor) else y
        assert torch.equal(x.view(torch.uint8) if x.dtype == torch.bfloat16 else x,
                           y.view(torch.uint8) if y.dtype == torch.bfloat16 else y), k


def _scenario_rank(rank: int, root: str, scenario, env: dict, pg_timeout: float, backend: str = "gloo") -> None:
    os.environ.update(env)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    root = Path(root)
    device = "cpu"
    if backend != "gloo":  # "cpu:gloo,cuda:nccl": the ranks' GPUs, the state on them, NCCL for CUDA tensors
        torch.cuda.set_device(rank)
        device = "cuda"
    dist.init_process_group(backend, store=dist.FileStore(str(root / f"store-{scenario.__name__}"), WORLD), rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=pg_timeout))
    try:
        from torch.distributed.device_mesh import init_device_mesh
        scenario(rank, root, init_device_mesh(device, (WORLD,)))
    finally:
        dist.destroy_process_group()
    end_rank()


def run_ranks(tmp_path: Path, scenario, env: dict | None = None, timeout: float = 120, pg_timeout: float = 60,
              backend: str = "gloo") -> None:
    """`scenario(rank, root, mesh)` on every rank (spawned); a rank's error is raised here, and a
    hang (a collective one rank never joins) fails within `timeout` seconds, the ranks killed.
    backend "cpu:gloo,cuda:nccl": each rank on its GPU, the mesh a CUDA one (2 GPUs needed)."""
    ctx = start_ranks(_scenario_rank, args=(str(tmp_path), scenario, env or {}, pg_timeout, backend),
                      nprocs=WORLD, join=False)
    join_ranks(ctx, scenario.__name__, timeout)


def _rank_main(rank: int, root: str, url: str, env: dict) -> None:
    os.environ.update(env)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    root = Path(root)
    dist.init_process_group("gloo", store=dist.FileStore(str(root / "store"), WORLD), rank=rank, world_size=WORLD)
    try:
        _scenarios(rank, root, url)
    finally:
        dist.destroy_process_group()
    end_rank()


def _scenarios(rank: int, root: Path, url: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from gdsckpt.manager.checkpointer import Checkpointer, step_name
    mesh = init_device_mesh("cpu", (WORLD,))
    d = root / "ck"
    ck = Checkpointer(d, keep=2, remote=url)
    assert ck.distributed and ck.rank == rank
    for s in (1, 2):
        ck.save(s, sharded(full_state(s), mesh))
        ck.wait(uploads=True, timeout=60)  # rank 0 uploads; the others have nothing to wait for
        dist.barrier()
    # optimizer=: the snapshot overlaps the next forward/backward (GdsckptWriter(optimizer=));
    # the optimizer's DTensor parameters are read until its step, which waits; the rest is
    # copied at the call
    state = sharded(full_state(3), mesh)
    params = [torch.nn.Parameter(state[k]) for k in ("w", "emb")]  # FSDP2's way: DTensor parameters
    opt = torch.optim.SGD(params, lr=1.0)
    from gdsckpt.writing.snapshot.overlap import memory_of, optimizer_memory
    assert {memory_of(state["w"]), memory_of(state["emb"])} <= optimizer_memory(opt)  # read, not copied
    before = params[0].to_local().clone()
    ck.save_async(3, state, optimizer=opt)
    state["step"].fill_(-1)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert not torch.equal(params[0].to_local(), before)  # no collective here: DCP's run in the background
    ck.wait(uploads=True, timeout=60)
    dist.barrier()
    listing = sorted(os.listdir(d / step_name(3, True)))
    assert listing[0] == ".metadata" and {"__0_0.gdsckpt", "__1_0.gdsckpt"} <= set(listing), listing
    assert ck.steps() == [1, 2, 3], ck.steps()  # step 1: on the store only (keep=2 locally)
    assert not (d / step_name(1, True)).exists()
    if rank == 0:
        assert ck.status()["uploaded"] == [1, 2, 3], ck.status()

    target = sharded(full_state(0), mesh)
    r = ck.restore(target)
    assert r.step == 3 and r.source == "local" and r.skipped == []
    same_local(target, sharded(full_state(3), mesh))

    r = ck.restore(target, step=1)  # the store's copy: rank 0 downloads it, every rank loads it
    assert r.step == 1 and r.source == "remote"
    same_local(target, sharded(full_state(1), mesh))
    dist.barrier()

    if rank == 0:  # damage rank 1's file of step 3: every rank must fall back to step 2
        from ckpt_tools import flip_chunk_byte
        flip_chunk_byte(d / step_name(3, True) / "__1_0.gdsckpt", 3, 1)
    dist.barrier()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        r = ck.restore(target)
    assert r.step in (2, 3), r  # the store's step 3 is intact: the local copy is skipped for it
    assert r.skipped and r.skipped[0][:2] == (3, "local"), r.skipped
    same_local(target, sharded(full_state(r.step), mesh))
    ck.close()


def test_two_ranks_manager(tmp_path, s3_env):
    url = f"s3://{s3_env.new_bucket()}/dcp"
    start_ranks(_rank_main, args=(str(tmp_path), url, s3_env.env()), nprocs=WORLD, join=True)
    from gdsckpt.stores import open_store
    names = sorted(open_store(url).list())
    assert "step_00000003/.metadata" in names and "step_00000003.uploaded.json" in names, names


def _snapshot_rank_main(rank: int, root: str) -> None:
    """save_options={"snapshot": ...} under torch.distributed, as on one process: a refused mode
    at construction (holding no lock), save() ignoring it, save_async(optimizer=) keeping a copy
    taken in the call ("device": no step waits for it)."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    root = Path(root)
    dist.init_process_group("gloo", store=dist.FileStore(str(root / "store"), WORLD), rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from gdsckpt.manager.checkpointer import Checkpointer
        mesh = init_device_mesh("cpu", (WORLD,))
        with pytest.raises(ValueError, match="snapshot must be one of 'host', 'overlap', 'device', 'cpu', not 'gpu'"):
            Checkpointer(root / "ck", save_options={"snapshot": "gpu"})
        with pytest.raises(ValueError, match="'codecs' is not a save option here; these are async_staging, "
                                             "backend, chunk_bytes, codec, io, io_threads, overwrite, ring_depth, snapshot"):
            Checkpointer(root / "ck", save_options={"codecs": "ans"})  # GdsckptWriter's options
        with pytest.raises(ValueError, match="unknown codec 'lz4'"):
            Checkpointer(root / "ck", save_options={"codec": "lz4"})
        with Checkpointer(root / "ck", keep=3, save_options={"snapshot": "device"}) as ck:  # no lock was left held
            ck.save(1, sharded(full_state(1), mesh))  # a synchronous save takes no snapshot
            state = sharded(full_state(2), mesh)
            params = [torch.nn.Parameter(state[k]) for k in ("w", "emb")]
            opt = torch.optim.SGD(params, lr=1.0)
            ck.save_async(2, state, optimizer=opt)
            assert not opt._optimizer_step_pre_hooks  # the copy is taken: nothing for a step to wait for
            for p in params:
                p.grad = torch.ones_like(p)
            opt.step()
            state["step"].fill_(-1)
            ck.wait()
            assert ck.steps() == [1, 2]
            target = sharded(full_state(0), mesh)
            assert ck.restore(target).step == 2
            same_local(target, sharded(full_state(2), mesh))
        with Checkpointer(root / "ov", save_options={"snapshot": "overlap"}) as ck:
            ck.save(1, sharded(full_state(1), mesh))  # not refused for want of an optimizer: no snapshot here
            assert ck.steps() == [1]
    finally:
        dist.destroy_process_group()
    end_rank()


def test_two_ranks_snapshot_options(tmp_path):
    start_ranks(_snapshot_rank_main, args=(str(tmp_path),), nprocs=WORLD, join=True)


def _missing_rank_file(rank: int, root: Path, mesh) -> None:
    """A DCP step lacking one rank's file (its .metadata names it) is damaged, not intact:
    retention keeps the older intact step, restore falls back to it, and it is never uploaded."""
    from gdsckpt import Checkpointer
    from gdsckpt.errors import CheckpointFormatError
    d = root / "ck"
    ck = Checkpointer(d, keep=2, save_options={"chunk_bytes": 64 << 10})
    ck.save(1, sharded(full_state(1), mesh))
    ck.save(2, sharded(full_state(2), mesh))
    dist.barrier()
    if rank == 0:
        (d / step_name(2, True) / "__1_0.gdsckpt").unlink()
    dist.barrier()
    why = ck.layout.damage(2, deep=True)
    assert why is not None and "__1_0.gdsckpt" in why and "missing" in why, why
    assert ck.layout.damage(1, deep=True) is None
    with pytest.raises(CheckpointFormatError, match="step 2 is incomplete: __1_0.gdsckpt"):
        ck.layout.files(2)  # what the remote tier uploads
    assert [rel for _, rel in ck.layout.files(1)] == [f"{step_name(1, True)}/{n}" for n in
                                                      ("__0_0.gdsckpt", "__1_0.gdsckpt", ".metadata")]
    ck.close()
    dist.barrier()
    ck = Checkpointer(d, keep=1, save_options={"chunk_bytes": 64 << 10})
    ck.prune()
    dist.barrier()
    assert 1 in ck.layout.local_steps(), ck.layout.local_steps()  # the only intact step stays
    target = sharded(full_state(0), mesh)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        r = ck.restore(target)
    assert r.step == 1 and r.source == "local", r
    same_local(target, sharded(full_state(1), mesh))
    ck.close()


def test_two_ranks_step_missing_a_rank_file(tmp_path):
    run_ranks(tmp_path, _missing_rank_file)


def _rollback_record_at_open(rank: int, root: Path, mesh) -> None:
    """A rollback record found at open is rank 0's to finish; no other rank keeps it pending
    (it would hide the steps saved after it on that rank alone), and every rank restores the step
    rank 0 chooses, whatever its own view of the directory."""
    from gdsckpt import Checkpointer
    from gdsckpt.manager.rollback import PendingRollback, RollbackJournal
    d = root / "ck"
    ck = Checkpointer(d, keep=5, save_options={"chunk_bytes": 64 << 10})
    for s in (1, 2, 3):
        ck.save(s, sharded(full_state(s), mesh))
    ck.close()
    dist.barrier()
    if rank == 0:  # a rollback to step 2 killed after its record was written, before any removal
        RollbackJournal(d).write(PendingRollback(local_to=2, store_to=None))
    dist.barrier()
    ck = Checkpointer(d, keep=5, save_options={"chunk_bytes": 64 << 10})  # the restart, every rank at once
    assert ck._rollback is None and ck.steps() == [1, 2], (ck._rollback, ck.steps())
    assert not RollbackJournal(d).path.exists()
    for s in (3, 4):  # training goes on from step 2
        ck.save(s, sharded(full_state(10 + s), mesh))
    assert ck.steps() == [1, 2, 3, 4]
    if rank == 1:  # a rank whose own view differs: it restores rank 0's choice all the same
        ck._local_steps = lambda: [1]
    target = sharded(full_state(0), mesh)
    r = ck.restore(target)
    assert (r.step, r.source) == (4, "local"), r
    same_local(target, sharded(full_state(14), mesh))
    ck.close()


def test_two_ranks_rollback_record_at_open(tmp_path):
    run_ranks(tmp_path, _rollback_record_at_open)


def _stage_fails_on_one_rank(rank: int, root: Path, mesh) -> None:
    """A staging that fails on rank 1 alone (its pinned pool cannot grow): the save fails on every
    rank, at once, nothing is committed, and the next save works on every rank (rank 0 is not
    left in DCP's collectives for the process group's timeout)."""
    from gdsckpt import Checkpointer
    from gdsckpt.dcp import writer as W
    d = root / "ck"
    ck = Checkpointer(d, keep=1, save_options={"chunk_bytes": 64 << 10})
    ck.save(1, sharded(full_state(1), mesh))
    real = W.stage_compressed
    if rank == 1:
        def boom(*a, **k):
            raise MemoryError("pinned host memory exhausted (injected)")
        W.stage_compressed = boom
    t0 = time.monotonic()
    try:
        ck.save_async(2, sharded(full_state(2), mesh))  # the failure is the save's, not the call's
        W.stage_compressed = real
        with pytest.raises(GdsckptError, match=r"saving step 2 to .* failed on rank\(s\) \[1\]: rank 1: "
                                                 "MemoryError: pinned host memory exhausted"):
            ck.wait()  # on every rank
    finally:
        W.stage_compressed = real
    ck.save_async(3, sharded(full_state(3), mesh))
    ck.wait()
    assert time.monotonic() - t0 < 20, time.monotonic() - t0  # the process group's timeout: 60 s
    dist.barrier()
    assert ck.layout.local_steps() == [3] and not (d / step_name(2, True) / ".metadata").exists()
    _restores_exactly(ck, mesh, 3)
    ck.close()


def _restores_exactly(ck, mesh, step: int) -> None:
    target = sharded(full_state(0), mesh)
    assert ck.restore(target).step == step
    same_local(target, sharded(full_state(step), mesh))


def test_two_ranks_staging_fails_on_one_rank(tmp_path):
    run_ranks(tmp_path, _stage_fails_on_one_rank)


def _write_fails_on_one_rank(rank: int, root: Path, mesh) -> None:
    """save() whose rank file cannot be written on rank 1: a GdsckptError (an Exception, not DCP's
    CheckpointException, a BaseException) on every rank naming the step and rank 1; nothing is
    committed, and the older step is restored."""
    from gdsckpt import Checkpointer
    d = root / "ck"
    ck = Checkpointer(d, keep=1, save_options={"chunk_bytes": 64 << 10})
    ck.save(1, sharded(full_state(1), mesh))
    if rank == 1:  # rank 1's file cannot be created: a directory in its place
        (d / step_name(2, True) / "__1_0.gdsckpt").mkdir(parents=True)
    dist.barrier()
    with pytest.raises(GdsckptError, match=r"saving step 2 to .*step_00000002' failed on rank\(s\) \[1\]: rank 1: "):
        ck.save(2, sharded(full_state(2), mesh))
    dist.barrier()
    assert ck.layout.local_steps() == [1]
    _restores_exactly(ck, mesh, 1)
    ck.close()


def test_two_ranks_write_fails_on_one_rank(tmp_path):
    run_ranks(tmp_path, _write_fails_on_one_rank)


class Mode(enum.Enum):  # a value DCP pickles, which a restore's torch.load(weights_only=True) refuses
    A = 1


def _value_a_restore_would_refuse(rank: int, root: Path, mesh) -> None:
    """save() of a state holding a non-tensor value that no restore could load (an Enum: loading
    never unpickles a class): refused at the save on every rank, naming the value, nothing
    committed; before, the step was saved and every restore then skipped it as damaged (a run that
    resumes would have silently started from an older step, or from nothing)."""
    from gdsckpt import Checkpointer
    d = root / "ck"
    ck = Checkpointer(d, keep=2)
    ck.save(1, sharded(full_state(1), mesh))
    state = sharded(full_state(2), mesh) | {"mode": Mode.A}
    with pytest.raises(GdsckptError, match=r"saving step 2 .*'mode' cannot be restored: .*Mode"):
        ck.save(2, state)
    dist.barrier()
    assert ck.layout.local_steps() == [1]
    _restores_exactly(ck, mesh, 1)
    ck.close()


def test_two_ranks_value_a_restore_would_refuse(tmp_path):
    run_ranks(tmp_path, _value_a_restore_would_refuse)


class _OpensAFile:
    """A stateful object whose load_state_dict fails on rank 1 alone for step 2: its file gone
    (an OSError: damage), or an error of its own."""

    def __init__(self, step: int, error: str = ""):
        self.pos, self.error = torch.tensor(float(step)), error

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, sd):
        if dist.get_rank() == 1 and int(sd["pos"]) == 2:
            raise FileNotFoundError("the loader's shard file is gone") if self.error == "gone" else \
                RuntimeError("cannot take that state here")
        self.pos.copy_(sd["pos"])


def _load_state_dict_fails_on_one_rank(rank: int, root: Path, mesh) -> None:
    """A restore whose load_state_dict fails on rank 1 alone (after DCP's collectives): a file of
    its own gone is damage, and every rank falls back to step 1 alike; an error of its own is
    raised there, and a GdsckptError naming rank 1 on the others. Before, rank 1 alone fell back
    while rank 0 went on with step 2: their collectives no longer matched, and both hung."""
    from gdsckpt import Checkpointer
    ck = Checkpointer(root / "ck", keep=3)
    for s in (1, 2):
        ck.save(s, sharded(full_state(s), mesh) | {"loader": _OpensAFile(s)})
    target = sharded(full_state(0), mesh) | {"loader": _OpensAFile(0, "gone")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = ck.restore(target)
    assert r.step == 1 and r.skipped[0][0] == 2 and "rank(s) [1] could not restore" in r.skipped[0][2], r.skipped
    same_local(target, sharded(full_state(1), mesh))
    target = sharded(full_state(0), mesh) | {"loader": _OpensAFile(0, "own")}
    if rank == 1:
        with pytest.raises(RuntimeError, match="cannot take that state here"):
            ck.restore(target)
    else:
        with pytest.raises(GdsckptError, match=r"rank\(s\) \[1\] failed restoring step_00000002: RuntimeError"):
            ck.restore(target)
    dist.barrier()
    ck.close()


def test_two_ranks_load_state_dict_fails_on_one_rank(tmp_path):
    run_ranks(tmp_path, _load_state_dict_fails_on_one_rank, timeout=90, pg_timeout=30)


def _each_rank_its_own_generators(rank: int, root: Path, mesh) -> None:
    """gdsckpt.RNG() in a distributed Checkpointer's state: each rank's generators come back its own.
    DCP took the value every rank names alike for replicated, and every rank loaded one rank's:
    rank 0's random streams came back as rank 1's, without a word."""
    import random
    import gdsckpt
    from gdsckpt import Checkpointer
    torch.manual_seed(1000 + rank)
    random.seed(rank)
    state = sharded(full_state(1), mesh) | {"rng": gdsckpt.RNG()}
    ck = Checkpointer(root / "ck", keep=2)
    ck.save(1, state)
    want = (torch.randn(3), random.random())
    torch.randn(50)
    random.random()
    assert ck.restore(state).step == 1
    assert torch.equal(torch.randn(3), want[0]) and random.random() == want[1], rank
    assert isinstance(state["rng"], gdsckpt.RNG) and set(state) == {"w", "emb", "step", "meta", "rng"}
    ck.close()


def test_two_ranks_each_rank_restores_its_own_generators(tmp_path):
    run_ranks(tmp_path, _each_rank_its_own_generators)


def _linked_base_step(rank: int, root: Path, mesh) -> None:
    """Issue 44, 4: a run directory whose step_00000000 is a link to another run's step (a shared
    base checkpoint linked in), saved on with keep=2. Retention unlinked the other run's
    .metadata, its commit point, through the link (then its rmtree of the link failed, silently);
    now the link alone goes, with a warning naming it and its target, and the other run's step
    stays whole and restorable."""
    from gdsckpt import Checkpointer
    base, d = root / "base", root / "ck"
    ck = Checkpointer(base, keep=1)
    ck.save(0, sharded(full_state(0), mesh))
    ck.close()
    shared = base / step_name(0, True)
    files = sorted(os.listdir(shared))
    if rank == 0:
        d.mkdir()
        (d / step_name(0, True)).symlink_to(shared)
    dist.barrier()
    said = logged("gdsckpt.manager.checkpointer")
    ck = Checkpointer(d, keep=2)
    assert ck.steps() == [0]
    for s in (1, 2):
        ck.save(s, sharded(full_state(s), mesh))
    dist.barrier()  # rank 0's retention is done: its save waited for it
    assert ck.steps() == [1, 2], ck.steps()
    assert not os.path.lexists(d / step_name(0, True))
    assert sorted(os.listdir(shared)) == files and ".metadata" in files, files
    if rank == 0:
        assert any(f"{d / step_name(0, True)} is a symlink to {shared}: removing the link only" in m
                   for m in said), said
    ck.close()
    ck = Checkpointer(base, keep=1)
    _restores_exactly(ck, mesh, 0)
    ck.close()


def test_two_ranks_retention_unlinks_a_linked_base_step(tmp_path):
    run_ranks(tmp_path, _linked_base_step)
