"""torch.distributed.checkpoint plugin (gdsckpt.dcp) and gdsckpt.save_async, on the CPU.

Two ranks over gloo (spawned once for the whole module) save a DTensor-sharded state (uneven
and empty shards, a replicated DTensor, a plain replicated tensor, non-tensor values) with
dcp.save and dcp.async_save through GdsckptWriter and load it back with GdsckptReader
bit-exact; the checkpoints are resharded 2 -> 1 (plain tensors in this process), 1 -> 2
(saved here without a process group, loaded into shards) and 2 -> 2 with another sharding;
a rank that fails in write_data leaves no .metadata (fresh directory and overwrite) and an
error on every rank; CachedSavePlanner reuses a plan only while nothing changed, dtype included.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

import torch.distributed.checkpoint as dcp  # noqa: E402

import gdsckpt  # noqa: E402
from gdsckpt.writing import async_save as async_mod  # noqa: E402
from gdsckpt.dcp import staging as dcp_staging  # noqa: E402
from gdsckpt.dcp import writer as dcp_writer  # noqa: E402
from gdsckpt.dcp import CachedSavePlanner, GdsckptReader, GdsckptWriter, item_key  # noqa: E402
from conftest import SlowSnapshot, assert_same, same  # noqa: E402
from ckpt_tools import end_rank, start_ranks  # noqa: E402

WORLD = 2


# ---------------------------------------------------------------- states


def full_state(seed: int) -> dict:
    """The logical (unsharded) state: float32 7x5 (uneven 4/3 rows), bf16 10x4, int64 9,
    fp16 1x3 (rank 1's shard is empty), float64 3x3 (replicated), a scalar, plain values."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(7, 5, generator=g),
        "emb": torch.randn(10, 4, generator=g).to(torch.bfloat16),
        "ids": torch.randint(-1000, 1000, (9,), generator=g),
        "tiny": torch.randn(1, 3, generator=g).to(torch.float16),
        "rep": torch.randn(3, 3, generator=g, dtype=torch.float64),
        "scalar": torch.tensor(float(seed) + 0.5),
        "meta": {"step": seed, "name": f"run{seed}", "lrs": [0.1 * seed, 0.2]},
    }


SHARDED = ("w", "emb", "ids", "tiny")


def sharded_state(full: dict, mesh, shard_dim: dict | None = None) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    out = {}
    for k, v in full.items():
        if k in SHARDED:
            out[k] = distribute_tensor(v, mesh, [Shard((shard_dim or {}).get(k, 0))])
        elif k == "rep":
            out[k] = distribute_tensor(v, mesh, [Replicate()])
        elif isinstance(v, torch.Tensor):
            out[k] = v.clone()
        else:
            out[k] = {kk: (list(vv) if isinstance(vv, list) else vv) for kk, vv in v.items()}
    return out


def local(v):
    from torch.distributed.tensor import DTensor
    return v.to_local() if isinstance(v, DTensor) else v


def check_local(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        if isinstance(want[k], torch.Tensor):
            assert_same(local(got[k]), local(want[k]), k)
        else:
            assert got[k] == want[k], k


# ---------------------------------------------------------------- failing writer


class FailingWriter(GdsckptWriter):
    """Fails in write_data on one rank, after the other rank may already have written its file."""

    def __init__(self, path, fail_rank: int, **kw):
        super().__init__(path, **kw)
        self.fail_rank = fail_rank

    def write_data(self, plan, planner):
        if self.rank == self.fail_rank:
            raise RuntimeError(f"injected failure on rank {self.rank}")
        return super().write_data(plan, planner)


# ---------------------------------------------------------------- the ranks


def _rank_main(rank: int, root: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    root = Path(root)
    store = dist.FileStore(str(root / "store"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    try:
        _scenarios(rank, root)
    finally:
        dist.destroy_process_group()
    end_rank()


def _scenarios(rank: int, root: Path) -> None:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (WORLD,))

    # 1. dcp.save / dcp.load, same sharding: bit-exact
    d = root / "sync"
    state = sharded_state(full_state(0), mesh)
    dcp.save(state, storage_writer=GdsckptWriter(d))
    dist.barrier()
    assert sorted(os.listdir(d)) == [".metadata", "__0_0.gdsckpt", "__1_0.gdsckpt"], os.listdir(d)
    target = sharded_state(full_state(100), mesh)
    dcp.load(target, storage_reader=GdsckptReader(d))
    check_local(target, state)

    # 2. 2 -> 2 with another sharding: "w" and "emb" by columns (each target piece spans both files)
    other = sharded_state(full_state(101), mesh, {"w": 1, "emb": 1})
    other = {k: other[k] for k in ("w", "emb")}
    dcp.load(other, storage_reader=GdsckptReader(d))
    want = sharded_state(full_state(0), mesh, {"w": 1, "emb": 1})
    for k in other:
        assert_same(local(other[k]), local(want[k]), k)

    # 3. 1 -> 2: saved by the test process with no process group
    target = sharded_state(full_state(102), mesh)
    dcp.load(target, storage_reader=GdsckptReader(root / "single"))
    check_local(target, sharded_state(full_state(3), mesh))

    # 4. dcp.async_save: the state is safe to mutate once it returns (compressed host staging, the
    # default; device staging; CPU staging)
    for staging, seed in (("host", 9), ("device", 2), ("cpu", 4)):
        state = sharded_state(full_state(seed), mesh)
        fut = dcp.async_save(state, storage_writer=GdsckptWriter(root / f"async-{staging}", async_staging=staging))
        for k in SHARDED + ("rep", "scalar"):
            local(state[k]).fill_(-7)  # training goes on: none of this may reach the checkpoint
        state["meta"]["step"] = -1
        state["meta"]["lrs"].append(9.9)
        fut = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse where staging is a future
        fut.result()
        target = sharded_state(full_state(103), mesh)
        dcp.load(target, storage_reader=GdsckptReader(root / f"async-{staging}"))
        check_local(target, sharded_state(full_state(seed), mesh))

    # 5. a rank fails in write_data: an error on every rank, no .metadata (fresh and overwrite)
    over = root / "overwrite"
    dcp.save(sharded_state(full_state(5), mesh), storage_writer=GdsckptWriter(over))
    dist.barrier()
    assert (over / ".metadata").exists()
    for where in (root / "failed", over):
        with pytest.raises(CheckpointException) as info:
            dcp.save(sharded_state(full_state(6), mesh), storage_writer=FailingWriter(where, fail_rank=1))
        assert "injected failure on rank 1" in str(info.value)
        assert list(info.value.failures) == [1]
        dist.barrier()
        assert not (where / ".metadata").exists(), os.listdir(where)
        assert not any("tmp" in n for n in os.listdir(where)), os.listdir(where)
    dist.barrier()

    # 6. overwrite=False refuses a committed checkpoint, on every rank
    with pytest.raises(CheckpointException, match="overwrite=False"):
        dcp.save(state, storage_writer=GdsckptWriter(d, overwrite=False))
    dist.barrier()

    # 7. CachedSavePlanner: the second async save reuses the plan (each rank sends an empty one),
    # a dtype change sends the full plan again; every checkpoint loads bit-exact, the last with
    # the new dtype in DCP's metadata
    def with_rep32(st):
        st["rep"] = sharded_state({"rep": local(st["rep"]).float()}, mesh)["rep"]
        return st

    sent = []
    for i, (seed, change) in enumerate(((10, None), (11, None), (12, with_rep32))):
        state = sharded_state(full_state(seed), mesh)
        if change:
            state = change(state)
        planner = RecordingPlanner()
        fut = dcp.async_save(state, storage_writer=GdsckptWriter(root / f"cached-{i}"), planner=planner)
        local(state["w"]).fill_(-7)
        fut.result()
        sent.append(planner.sent_full_plan)
        target = sharded_state(full_state(103), mesh)
        want = sharded_state(full_state(seed), mesh)
        if change:
            target, want = change(target), change(want)
        dcp.load(target, storage_reader=GdsckptReader(root / f"cached-{i}"))
        check_local(target, want)
    assert sent == [True, False, True], sent
    dist.barrier()


class RecordingPlanner(CachedSavePlanner):
    """Notes whether this rank sent its whole plan or reused the cached one."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        self.sent_full_plan = plan.usable
        return plan


def _spawn(root: Path) -> None:
    start_ranks(_rank_main, args=(str(root),), nprocs=WORLD, join=True)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({k: v for k, v in full_state(3).items()}, storage_writer=GdsckptWriter(root / "single"),
                 no_dist=True)
    t = time.perf_counter()
    _spawn(root)
    return root, time.perf_counter() - t


def _load_full(d: Path, seed_like: int) -> dict:
    target = full_state(seed_like)
    for k in target:
        if isinstance(target[k], torch.Tensor):
            target[k] = torch.zeros_like(target[k])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=GdsckptReader(d), no_dist=True)
    return target


def test_two_ranks_save_load_async_and_failures(two_rank_run):
    """The scenarios run inside the ranks (their assertions fail the spawn); see _scenarios."""
    root, seconds = two_rank_run
    assert (root / "sync" / ".metadata").exists()


def test_reshard_two_ranks_to_one(two_rank_run):
    root, _ = two_rank_run
    assert_same(_load_full(root / "sync", 200), full_state(0))


def test_async_checkpoints_hold_the_state_at_staging(two_rank_run):
    root, _ = two_rank_run
    assert_same(_load_full(root / "async-device", 201), full_state(2))
    assert_same(_load_full(root / "async-cpu", 202), full_state(4))
    assert_same(_load_full(root / "async-host", 204), full_state(9))


def test_files_are_gdsckpt_files_keyed_by_dcp_index(two_rank_run):
    root, _ = two_rank_run
    files = [gdsckpt.open(root / "sync" / f"__{r}_0.gdsckpt") for r in range(WORLD)]
    keys = [set(ck.keys()) for ck in files]
    assert {"w@0,0", "emb@0,0", "ids@0", "tiny@0,0"} <= keys[0]
    assert {"w@4,0", "emb@5,0", "ids@5", "tiny@1,0"} <= keys[1]  # tiny@1,0: rank 1's empty shard
    assert_same(files[0].get_tensor("w@0,0"), full_state(0)["w"][:4])
    # replicated items and plain values are written once (DCP deduplicates), byte items as uint8
    for key in ("rep@0,0", "scalar@", "meta.step", "meta.lrs"):
        (holder,) = [ck for ck in files if key in ck]
        if key.startswith("meta"):
            assert holder.info(key)["dtype"] == "uint8"
    for ck in files:
        ck.close()


def test_a_smaller_world_overwrites_and_drops_unused_rank_files(two_rank_run, tmp_path):
    import shutil
    d = tmp_path / "ck"
    shutil.copytree(two_rank_run[0] / "sync", d)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(full_state(8), storage_writer=GdsckptWriter(d), no_dist=True)
    assert sorted(os.listdir(d)) == [".metadata", "__0_0.gdsckpt"]
    assert_same(_load_full(d, 203), full_state(8))


def test_reader_refuses_a_filesystem_writer_checkpoint(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(full_state(1), storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
        with pytest.raises(BaseException, match="not written by GdsckptWriter"):
            dcp.load(full_state(2), storage_reader=GdsckptReader(tmp_path), no_dist=True)


def test_checkpoint_ids_and_keys():
    from torch.distributed.checkpoint.metadata import MetadataIndex
    assert GdsckptWriter.validate_checkpoint_id("/tmp/some/dir")
    assert not GdsckptWriter.validate_checkpoint_id("s3://bucket/x")
    assert not GdsckptReader.validate_checkpoint_id(123)
    assert item_key(MetadataIndex("a.b", [4, 0])) == "a.b@4,0"
    assert item_key(MetadataIndex("meta.step")) == "meta.step"
    w = GdsckptWriter("/tmp/a")
    w.reset("/tmp/b")
    assert str(w.checkpoint_id) == "/tmp/b" and w.storage_meta().checkpoint_id == "/tmp/b"


# ---------------------------------------------------------------- gdsckpt.save_async
# _GatedSave holds back the background snapshot of snapshot="device" (save_flat as async_save calls
# it, off the calling thread once the state is copied): these tests pin that mode's semantics (the
# default host snapshot: tests/writing/test_save_async.py).


def _state(seed: int, n: int = 4096) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(n, generator=g), "b": torch.randn(64, generator=g).to(torch.bfloat16)},
            "step": seed, "ids": [torch.arange(10) + seed]}


def _clone(state):
    return dcp_staging.snapshot_state_dict(state)


class _GatedSave:
    """Stands in for save_flat in async_save: records when each save ran and can hold one back."""

    def __init__(self, monkeypatch, hold: float = 0.0):
        self.real = async_mod.save_flat
        self.gate = threading.Event()
        self.hold = hold
        self.spans = []
        monkeypatch.setattr(async_mod, "save_flat", self)

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        assert self.gate.wait(10)
        time.sleep(self.hold)
        stats = self.real(*a, **kw)
        self.spans.append((t0, time.perf_counter()))
        return stats


def test_save_async_state_is_safe_to_mutate_on_return(tmp_path, monkeypatch):
    gated = _GatedSave(monkeypatch)
    state = _state(1)
    want = _clone(state)
    fut = gdsckpt.save_async(state, tmp_path / "a.gdsckpt", backend="cpu", snapshot="device")
    assert not fut.done()  # the save has not even started writing
    state["model"]["w"].fill_(0)
    state["model"]["b"].add_(1)
    state["ids"][0].zero_()
    state["ids"].append(torch.ones(3))
    state["step"] = -1
    gated.gate.set()
    stats = fut.result(10)
    assert isinstance(stats, gdsckpt.Stats) and stats.op == "save"
    assert_same(gdsckpt.load(tmp_path / "a.gdsckpt"), want)


def test_save_async_second_call_waits_for_the_first(tmp_path, monkeypatch):
    gated = _GatedSave(monkeypatch, hold=0.2)
    gated.gate.set()
    p = tmp_path / "same.gdsckpt"
    first = gdsckpt.save_async(_state(1), p, snapshot="device")
    second = gdsckpt.save_async(_state(2), p, snapshot="device")  # blocks here until the first's snapshot ended
    assert len(gated.spans) == 1
    first.result(10)
    second.result(10)
    (a0, a1), (b0, b1) = gated.spans
    assert a1 <= b0  # never interleaved
    assert_same(gdsckpt.load(p), _state(2))

    # from two threads at once: serialized too, and the file is one whole state
    gated.spans.clear()
    futs = []
    threads = [threading.Thread(target=lambda s=s: futs.append(gdsckpt.save_async(_state(s), p, snapshot="device"))) for s in (3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for f in futs:
        f.result(10)
    (a0, a1), (b0, b1) = sorted(gated.spans)
    assert a1 <= b0
    got = gdsckpt.load(p)
    assert any(same(got, _state(s)) for s in (3, 4))


def test_save_async_wait_false_fails_clearly_while_busy(tmp_path, monkeypatch):
    gated = _GatedSave(monkeypatch)
    first = gdsckpt.save_async(_state(1), tmp_path / "a.gdsckpt", snapshot="device")
    with pytest.raises(async_mod.SaveInFlightError, match="still in flight"):
        gdsckpt.save_async(_state(2), tmp_path / "b.gdsckpt", wait=False, snapshot="device")
    gated.gate.set()
    first.result(10)
    gdsckpt.save_async(_state(2), tmp_path / "b.gdsckpt", wait=False, snapshot="device").result(10)
    assert_same(gdsckpt.load(tmp_path / "b.gdsckpt"), _state(2))


def test_save_async_errors(tmp_path):
    with pytest.raises(gdsckpt.UnsupportedStateError):
        gdsckpt.save_async({"x": object()}, tmp_path / "x.gdsckpt")  # raised here, nothing copied
    with pytest.raises(FileNotFoundError, match="missing-dir"):  # refused at the call, before any copy
        gdsckpt.save_async(_state(1), tmp_path / "missing-dir" / "x.gdsckpt")
    # the lock was released both times
    gdsckpt.save_async(_state(5), tmp_path / "ok.gdsckpt", wait=False).result(10)
    assert_same(gdsckpt.load(tmp_path / "ok.gdsckpt"), _state(5))


def test_stand_ins_never_share_an_address():
    """GdsckptWriter finds a staged tensor's key by its stand-in's address: more stand-ins than
    one block holds, empty ones among them, every address distinct while the staging lives."""
    from gdsckpt.dcp.staging import StandInElements, data_address
    elements, seen = StandInElements(), set()
    for i in range(2 * StandInElements.BLOCK + 10):
        one = elements.take(torch.float32 if i % 2 else torch.bfloat16, torch.device("cpu"), i % 3 == 0)
        stand_in = one.reshape(()).expand((0, 3) if i % 5 == 0 else (4, 2))
        seen.add(data_address(stand_in))
        assert stand_in.requires_grad == (i % 3 == 0)
    assert len(seen) == 2 * StandInElements.BLOCK + 10


# ---------------------------------------------------------------- GdsckptWriter(optimizer=): overlapped staging


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _forward_backward(model)
    opt.step()
    return model, opt


def _forward_backward(model):
    model(torch.randn(16, 32)).square().mean().backward()  # forward updates BatchNorm's running statistics


def _dcp_state(model, opt) -> dict:
    moments = {f"{i}": {k: v for k, v in opt.state[p].items()} for i, p in enumerate(model.parameters())}
    return {"model": model.state_dict(), "adam": moments, "meta": {"step": 1, "lrs": [0.01]}}


def _dcp_load(d: Path, like: dict) -> dict:
    target = dcp_staging.snapshot_state_dict(like)
    for t in dcp_staging.state_tensors(target):
        t.zero_()
    dcp.load(target, storage_reader=GdsckptReader(d), no_dist=True)
    return target


def test_overlapped_staging_returns_at_once_and_the_step_waits(tmp_path, monkeypatch):
    """dcp.async_save with GdsckptWriter(optimizer=opt) returns DCP's AsyncSaveResponse while the
    compressed snapshot still runs; buffers and plain values may change at once, the
    parameters and AdamW moments until opt.step(), which waits; the checkpoint holds the state
    of the call, and the step hook is gone afterwards."""
    model, opt = _trained()
    state = _dcp_state(model, opt)
    want = _clone(state)
    slow = SlowSnapshot(monkeypatch)
    t = time.perf_counter()
    resp = dcp.async_save(state, storage_writer=GdsckptWriter(tmp_path / "c", optimizer=opt), no_dist=True)
    returned = time.perf_counter() - t
    assert slow.started.wait(10) and not resp.staging_completion.done()
    assert len(opt._optimizer_step_pre_hooks) == 1
    _forward_backward(model)  # reads the parameters the snapshot is reading; writes BatchNorm's buffers
    model[1].running_var.add_(100.0)
    state["meta"]["step"] = 2
    state["meta"]["lrs"].append(9.9)
    threading.Timer(0.4, slow.gate.set).start()
    t = time.perf_counter()
    opt.step()  # the pre-hook waits for the snapshot before AdamW changes a parameter or a moment
    waited = time.perf_counter() - t
    assert slow.gate.is_set() and waited >= 0.3 and returned < waited
    assert len(opt._optimizer_step_pre_hooks) == 0
    resp.staging_completion.result(30)
    resp.upload_completion.result(30)
    assert (tmp_path / "c" / ".metadata").exists()
    assert_same(_dcp_load(tmp_path / "c", want), want)


def test_overlapped_staging_failure_fails_the_upload_and_the_step_goes_on(tmp_path, monkeypatch):
    model, opt = _trained(1)

    def broken(*a, **kw):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(dcp_writer, "stage_compressed", broken)
    resp = dcp.async_save(_dcp_state(model, opt), storage_writer=GdsckptWriter(tmp_path / "c", optimizer=opt),
                          no_dist=True)
    # the failed staging stages a placeholder and write_data raises its error, inside DCP's
    # collectives: DCP reports it (a CheckpointException) on every rank, none left waiting
    from torch.distributed.checkpoint.api import CheckpointException
    with pytest.raises(CheckpointException) as caught:
        resp.upload_completion.result(30)
    (err, _), = caught.value.failures.values()
    assert isinstance(err, OSError) and "injected" in str(err)
    opt.step()  # not held by a snapshot that failed
    assert not (tmp_path / "c" / ".metadata").exists()
    monkeypatch.undo()
    resp = dcp.async_save(_dcp_state(model, opt), storage_writer=GdsckptWriter(tmp_path / "c", optimizer=opt),
                          no_dist=True)  # the next one goes ahead
    resp.upload_completion.result(30)
    assert (tmp_path / "c" / ".metadata").exists()


def test_overlapped_staging_refuses_what_it_cannot_do(tmp_path):
    import pickle
    model, opt = _trained(2)
    with pytest.raises(ValueError, match="must be a torch.optim.Optimizer, not object"):
        GdsckptWriter(tmp_path, optimizer=object())
    with pytest.raises(gdsckpt.errors.DCPPlanError, match="AsyncCheckpointerType.THREAD"):
        pickle.dumps(GdsckptWriter(tmp_path, optimizer=opt))  # what the PROCESS executor would do


# ---------------------------------------------------------------- one snapshot vocabulary (issue 19, item 5)


def test_writer_takes_save_asyncs_snapshot_names_and_the_earlier_spelling(tmp_path):
    from gdsckpt.writing.save import Snapshot
    model, opt = _trained(4)
    assert GdsckptWriter(tmp_path).snapshot is Snapshot.HOST
    assert GdsckptWriter(tmp_path, optimizer=opt).snapshot is Snapshot.OVERLAP  # as before: optimizer= overlaps
    assert GdsckptWriter(tmp_path, snapshot="overlap", optimizer=opt).snapshot is Snapshot.OVERLAP
    for mode in ("host", "device", "cpu"):
        assert GdsckptWriter(tmp_path, snapshot=mode).snapshot is Snapshot(mode)
        assert GdsckptWriter(tmp_path, async_staging=mode).snapshot is Snapshot(mode)  # the earlier spelling
    assert GdsckptWriter(tmp_path, async_staging="host", optimizer=opt).snapshot is Snapshot.OVERLAP
    with pytest.raises(ValueError, match="snapshot must be one of 'host', 'overlap', 'device', 'cpu', not 'gpu'"):
        GdsckptWriter(tmp_path, snapshot="gpu")
    with pytest.raises(ValueError, match="async_staging must be one of 'host', 'device', 'cpu'"):
        GdsckptWriter(tmp_path, async_staging="overlap")
    with pytest.raises(ValueError, match="pass one"):
        GdsckptWriter(tmp_path, snapshot="host", async_staging="host")
    with pytest.raises(ValueError, match="needs optimizer="):
        GdsckptWriter(tmp_path, snapshot="overlap")
    with pytest.raises(ValueError, match="snapshot='host' takes the snapshot before"):
        GdsckptWriter(tmp_path, snapshot="host", optimizer=opt)
    # a copy taken in the call needs no step to wait: optimizer= is accepted and unused, as
    # save_async(snapshot="device", optimizer=) takes it (the Checkpointer always passes its optimizer)
    import pickle
    for mode in ("device", "cpu"):
        for w in (GdsckptWriter(tmp_path, snapshot=mode, optimizer=opt),
                  GdsckptWriter(tmp_path, async_staging=mode, optimizer=opt)):
            assert w.snapshot is Snapshot(mode) and w.optimizer is None
    pickle.dumps(GdsckptWriter(tmp_path, snapshot="cpu", optimizer=opt))  # the PROCESS executor's, as without it
    with pytest.raises(ValueError, match="unknown codec"):  # the save options are checked here, once
        GdsckptWriter(tmp_path, codec="lz4")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("mode", ["host", "device", "cpu"])
def test_async_save_with_each_snapshot_name(tmp_path, mode):
    model, opt = _trained(5)
    state = _dcp_state(model, opt)
    want = _clone(state)
    fut = dcp.async_save(state, storage_writer=GdsckptWriter(tmp_path / mode, snapshot=mode), no_dist=True)
    for t in dcp_staging.state_tensors(state):
        t.zero_()  # training goes on: none of this may reach the checkpoint
    getattr(fut, "upload_completion", fut).result(30)
    assert_same(_dcp_load(tmp_path / mode, want), want)
