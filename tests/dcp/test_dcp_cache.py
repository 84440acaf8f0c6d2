"""DCP's per-save Python prepared once per layout (issue 22): GdsckptWriter's stand-ins,
CachedSavePlanner's local plan, the write results and the `.metadata` pickle are reused only
while the layout holds.

Async saves in one gloo process group of one rank (as gdsckpt-bench --train runs them, so
that DCP's gather and broadcast pickle what they pickle on a GPU node), a new GdsckptWriter
and CachedSavePlanner per save: a steady save builds no plan, no results and no metadata
pickle; a new key, another shape, another dtype and the way back each plan and write afresh;
every checkpoint restores bit-exact, holds the metadata of its own state, is byte for byte the
pickle DCP's FileSystemWriter would write, and reads with DCP's FileSystemReader. A staging
left pending does not make a later dcp.save of another state of the same layout write the
staged data. Two ranks: one rank's layout changes while the other's holds.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import default_planner  # noqa: E402
from torch.distributed.checkpoint.metadata import (Metadata, MetadataIndex, StorageMeta,  # noqa: E402
                                                   TensorStorageMetadata)

from gdsckpt.dcp import CachedSavePlanner, GdsckptReader, GdsckptWriter  # noqa: E402
from gdsckpt.dcp import metadata as dcp_metadata  # noqa: E402
from gdsckpt.dcp import writer as dcp_writer  # noqa: E402
from gdsckpt.dcp.metadata import PreparedMetadata, metadata_pickle, read_metadata  # noqa: E402
from gdsckpt.dcp.standins import StandInElements, StandIns  # noqa: E402
from conftest import assert_same  # noqa: E402
from ckpt_tools import end_rank, start_ranks  # noqa: E402


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of one rank, as the bench's DCP methods set up."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _state(seed: int, layout: str = "a") -> dict:
    """Model + AdamW-like state with a nested optimizer state, plain values among the tensors
    and after them. Layouts: "a";
    "key" (a new tensor); "shape" ("key" and w2 5x4 not 4x4); "dtype" ("shape" and w1 bf16)."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(8, 3, generator=g)
    w2 = torch.randn(5 if layout in ("shape", "dtype") else 4, 4, generator=g)
    if layout == "dtype":
        w1 = w1.to(torch.bfloat16)
    model = {"w1": w1, "name": f"run{seed}", "w2": w2, "b": torch.randn(4, generator=g), "steps": torch.tensor(seed)}
    if layout != "a":
        model["extra"] = torch.randn(2, 6, generator=g).to(torch.float16)
    state = {str(i): {"step": torch.tensor(float(seed)), "exp_avg": torch.randn(t.shape, generator=g),
                      "exp_avg_sq": torch.rand(t.shape, generator=g)}
             for i, t in enumerate(model.values()) if isinstance(t, torch.Tensor) and t.is_floating_point()}
    return {"model": model, "optim": {"state": state, "param_groups": [{"lr": 0.1 * seed, "betas": (0.9, 0.99),
                                                                      "params": list(range(len(state)))}]}}


def _zeros_like(state):
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_zeros_like(v) for v in state]
    return state


def _plain_values(state):
    """The state with every tensor gone: what dcp.load leaves of plain values to compare."""
    if isinstance(state, dict):
        return {k: _plain_values(v) for k, v in state.items() if not isinstance(v, torch.Tensor)}
    return state


def _load(d: Path, like: dict) -> dict:
    target = _zeros_like(like)
    target["optim"]["param_groups"] = [{"lr": -1.0, "betas": (0.0, 0.0), "params": []}]
    dcp.load(target, storage_reader=GdsckptReader(d))
    return target


def _flat_tensors(state, prefix=""):
    out = {}
    for k, v in state.items():
        name = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out[name] = v
        elif isinstance(v, dict):
            out.update(_flat_tensors(v, name + "."))
    return out


def _as_one_rank_made_it(metadata) -> Metadata:
    """The plain Metadata with its storage data's strings shared as within one rank's results."""
    strings: dict[str, str] = {}
    one = lambda s: strings.setdefault(s, s)  # noqa: E731
    plain = dcp_metadata._plain(metadata)
    plain.storage_data = {MetadataIndex(one(i.fqn), i.offset, i.index): {one(k): one(v) for k, v in sd.items()}
                          for i, sd in metadata.storage_data.items()}
    return plain


class Counting:
    """Counts calls of a module function, calling it."""

    def __init__(self, monkeypatch, module, name):
        self.calls, fn = 0, getattr(module, name)

        def counted(*a, **kw):
            self.calls += 1
            return fn(*a, **kw)
        monkeypatch.setattr(module, name, counted)

    def take(self) -> int:
        n, self.calls = self.calls, 0
        return n


def test_steady_saves_reuse_and_changed_layouts_start_afresh(tmp_path, one_rank_group, monkeypatch):
    plans = Counting(monkeypatch, default_planner, "create_default_local_save_plan")
    results = Counting(monkeypatch, dcp_writer, "prepare_write")
    pickles = Counting(monkeypatch, dcp_metadata, "_prepare")
    layouts = ["a", "a", "key", "shape", "dtype", "a", "a", "a"]
    built = []
    for i, layout in enumerate(layouts):
        d = tmp_path / f"ck-{i}"  # one length: the metadata pickle's ids keep their lengths
        state = _state(i, layout)
        want = _state(i, layout)
        resp = dcp.async_save(state, storage_writer=GdsckptWriter(d), planner=CachedSavePlanner(cache_key="cache-test"))
        for t in _flat_tensors(state).values():
            t.fill_(-7)  # training goes on: none of this may reach the checkpoint
        state["optim"]["param_groups"][0]["lr"] = -1.0
        metadata = getattr(resp, "upload_completion", resp).result()
        built.append((plans.take(), results.take(), pickles.take()))

        got = _load(d, want)
        assert_same(_flat_tensors(got), _flat_tensors(want), f"save {i} ({layout})")
        assert got["optim"]["param_groups"] == want["optim"]["param_groups"]

        # the metadata is this state's, as DCP's FileSystemWriter would pickle it, and DCP reads it
        ours = read_metadata(d / ".metadata")
        tensors = _flat_tensors(want)
        sdm = {k: v for k, v in ours.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        assert set(sdm) == set(tensors), (i, layout)
        assert [index.fqn for index in ours.storage_data] == list(ours.state_dict_metadata)  # the plan's order
        for k, t in tensors.items():
            assert (sdm[k].size, sdm[k].properties.dtype) == (t.shape, t.dtype), (i, k)
        data = (d / ".metadata").read_bytes()[:-16]
        assert data == pickle.dumps(dcp_metadata._plain(metadata)), f"save {i}: not pickle.dumps' bytes"
        # and the bytes of the storage data as the rank's one list of results made it before
        # (one pickle through DCP's gather: every equal string one object, the "file" key too)
        assert data == pickle.dumps(_as_one_rank_made_it(metadata)), f"save {i}: not the bytes of before"
        assert ours.storage_meta.checkpoint_id == str(d) and ours.storage_meta.save_id == metadata.storage_meta.save_id
        theirs = dcp.FileSystemReader(d).read_metadata()
        assert theirs.state_dict_metadata == ours.state_dict_metadata and theirs.storage_data == ours.storage_data
        assert type(theirs) is Metadata
    # (local plans built, write results prepared, metadata pickles prepared) per save: the
    # first of each layout builds all three, a steady save none
    assert built == [(1, 1, 1), (0, 0, 0), (1, 1, 1), (1, 1, 1), (1, 1, 1), (1, 1, 1), (0, 0, 0), (0, 0, 0)], built


def test_a_pending_staging_does_not_stand_in_for_another_state(tmp_path, one_rank_group):
    """A writer staged (by stage(), its write never came); a dcp.save of another state of the
    same layout through it, planned from the same cached plan, writes that state."""
    planner = lambda: CachedSavePlanner(cache_key="pending-test")  # noqa: E731
    for i in range(2):
        dcp.async_save(_state(i), storage_writer=GdsckptWriter(tmp_path / f"a{i}"), planner=planner()).result()
    w = GdsckptWriter(tmp_path / "b")
    w.stage(_state(50))
    dcp.save(_state(60), storage_writer=w, planner=planner())
    got = _load(tmp_path / "b", _state(60))
    assert_same(_flat_tensors(got), _flat_tensors(_state(60)))
    assert w._staged[0] is None  # the staging was dropped, its pool given back


def test_prepared_metadata_unpickles_without_gdsckpt_as_plain_metadata(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        md = dcp.save(_state(1), storage_writer=GdsckptWriter(tmp_path / "ck"), planner=CachedSavePlanner("pm"),
                      no_dist=True)
    assert isinstance(md, PreparedMetadata)  # what DCP broadcasts to every rank
    data = pickle.dumps(md)
    assert len(data) < len((tmp_path / "ck" / ".metadata").read_bytes()) + 200  # the file's pickle, wrapped
    code = ("import pickle, sys; m = pickle.loads(sys.stdin.buffer.read()); "
            "from torch.distributed.checkpoint.metadata import Metadata; "
            "assert type(m) is Metadata, type(m); print(any(n.startswith('gdsckpt') for n in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, check=True,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": ""})
    assert out.stdout.strip() == b"False", out
    back = pickle.loads(data)
    assert type(back) is Metadata and back.state_dict_metadata == md.state_dict_metadata
    assert back.storage_meta == md.storage_meta


@pytest.mark.parametrize("checkpoint_id", ["/ckpt/step-000100", "/ckpt/ä/ü-100", "ab", "", "/c/\udcff-1"])
def test_metadata_pickle_is_pickle_dumps(checkpoint_id):
    """Patched ids (other lengths, non-ASCII, surrogate-escaped bytes of a path, too short to
    patch, empty) give pickle.dumps' bytes, a second time from the prepared pickle."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
        planner = DefaultSavePlanner()
        planner.set_up_planner(_state(3), is_coordinator=True)
        _, md = planner.create_global_plan([planner.create_local_plan()])
    md.storage_data = {}
    for save_id in ("0" * 32, "f" * 32, "x"):
        md.storage_meta = StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id)
        assert metadata_pickle(md) == pickle.dumps(md)
        assert metadata_pickle(PreparedMetadata.of(md)) == pickle.dumps(md)
    md.storage_meta = None
    assert metadata_pickle(md) == pickle.dumps(md)


def test_stand_ins_are_reused_while_their_layout_holds_and_stay_bounded():
    stand_ins = StandIns()
    t = {f"k{i}": torch.randn(3, i + 1) for i in range(5)}
    with stand_ins.round() as first:
        made = {k: first.stand_in(k, v) for k, v in t.items()}
    with stand_ins.round() as again:
        assert all(again.stand_in(k, v.clone()) is made[k] for k, v in t.items())
    assert again.layout is first.layout and again.keys == first.keys
    with stand_ins.round() as changed:
        assert changed.stand_in("k0", torch.randn(3, 2)) is not made["k0"]  # another shape
        assert changed.stand_in("k1", t["k1"].double()) is not made["k1"]  # another dtype
        assert changed.stand_in("k2", t["k2"].requires_grad_()) is not made["k2"]
    assert changed.layout is not first.layout
    with stand_ins.round() as fewer:  # the same stand-ins, a key fewer: another layout
        fewer.stand_in("k0", torch.randn(3, 2))
    assert fewer.layout is not changed.layout
    for r in range(4 * StandInElements.BLOCK // 100):  # every round new keys: the elements start over
        with stand_ins.round() as rnd:
            for i in range(100):
                rnd.stand_in(f"r{r}-{i}", torch.randn(2))
        assert stand_ins.elements.taken <= 2 * 100 + StandInElements.BLOCK + 100
        assert len(set(rnd.keys)) == 100


# ---------------------------------------------------------------- two ranks


def _rank_main(rank: int, root: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    root = Path(root)
    dist.init_process_group("gloo", store=dist.FileStore(str(root / "store"), 2), rank=rank, world_size=2)
    try:
        # each rank its own tensors (plain tensors of one name would be deduplicated); on the
        # third save rank 1's change shape, rank 0's do not; the fourth is steady again
        for i, grow in enumerate((False, False, True, True)):
            state = {f"r{rank}": {"w": torch.full((3 + (grow and rank == 1), 2), float(10 * i + rank)),
                                  "b": torch.arange(4.0) + i}, "step": i}
            want = {k: (v if not isinstance(v, dict) else {kk: vv.clone() for kk, vv in v.items()})
                    for k, v in state.items()}
            resp = dcp.async_save(state, storage_writer=GdsckptWriter(root / f"ck{i}"),
                                  planner=CachedSavePlanner(cache_key="two-ranks"))
            state[f"r{rank}"]["w"].fill_(-1)
            getattr(resp, "upload_completion", resp).result()
            dist.barrier()
            target = {f"r{rank}": {k: torch.zeros_like(v) for k, v in want[f"r{rank}"].items()}, "step": -1}
            dcp.load(target, storage_reader=GdsckptReader(root / f"ck{i}"))
            assert_same(target, want, f"rank {rank} save {i}")
            dist.barrier()
    finally:
        dist.destroy_process_group()
    end_rank()


def test_two_ranks_one_layout_changes(tmp_path):
    start_ranks(_rank_main, args=(str(tmp_path),), nprocs=2, join=True)


def test_reserve_makes_the_stagings_pool_before_the_first_save(tmp_path, one_rank_group):
    """gdsckpt.dcp.reserve grows the host pool GdsckptWriter's compressed staging compresses
    into, ahead of the first dcp.async_save (on the H100 a staging that grew it made the
    optimizer step wait up to 0.19 s): that save grows nothing and is bit-exact."""
    import gdsckpt.dcp
    from gdsckpt.engine import pinned_pool as pp
    pp.release_pools()
    state, want = _state(5), _state(5)
    r = gdsckpt.dcp.reserve(state, wait=True, chunk_bytes=64 << 10, overwrite=True).result()
    assert r.where == "pool cpu" and r.allocated_bytes == r.held_bytes > 0
    resp = dcp.async_save(state, storage_writer=GdsckptWriter(tmp_path / "a", chunk_bytes=64 << 10),
                          planner=CachedSavePlanner(cache_key="reserve-test"))
    getattr(resp, "upload_completion", resp).result()
    assert pp.pools()["cpu"]["capacity_bytes"] == r.held_bytes  # the staging grew nothing
    assert_same(_flat_tensors(_load(tmp_path / "a", want)), _flat_tensors(want))
    assert gdsckpt.dcp.reserve(state, snapshot="cpu").result() is None  # DCP's own staging: no pool of ours
    pp.release_pools()


def test_reserve_takes_the_tensors_the_staging_saves_under_its_keys(one_rank_group):
    """What dcp.reserve reserves and warms (codec="auto"'s choice is kept per keys and shapes) is
    what the compressed staging saves: the same tensors, under the same keys, in the same order."""
    from gdsckpt.dcp.staging import stage_compressed, staged_tensors
    from gdsckpt.writing.save import SaveOptions
    state = _state(7)
    _, staged = stage_compressed(state, SaveOptions(chunk_bytes=64 << 10))
    try:
        reserved = staged_tensors(state)
        assert list(reserved) == list(staged.shapes)
        assert all(tuple(t.shape) == tuple(staged.shapes[k]) for k, t in reserved.items())
    finally:
        staged.drop()


def test_checkpointer_reserve_under_torch_distributed(tmp_path, one_rank_group):
    """Checkpointer.reserve under torch.distributed reserves the staging's pool for this rank's
    tensors (it reserved nothing before): its first save grows nothing."""
    from gdsckpt import Checkpointer
    from gdsckpt.engine import pinned_pool as pp
    pp.release_pools()
    with Checkpointer(tmp_path / "ck", save_options={"chunk_bytes": 64 << 10}) as ck:
        assert ck.distributed
        r = ck.reserve(_state(6), wait=True).result()
        assert r.where == "pool cpu" and r.held_bytes > 0
        ck.save_async(1, _state(6))
        ck.wait()
        assert pp.pools()["cpu"]["capacity_bytes"] == r.held_bytes
        assert ck.steps() == [1]
    pp.release_pools()


def test_device_staging_lets_its_copies_go_without_the_collector(tmp_path, one_rank_group, monkeypatch):
    """GdsckptWriter(snapshot="device")'s copies go back once the staging has compressed them,
    with Python's cyclic collector off (saves pause it): no reference cycle holds them (a
    recursive closure over the copies did, and a device-mode loop on the H100 peaked at ~6
    copies of its state)."""
    import gc
    import weakref
    from gdsckpt.dcp.staging import state_tensors
    copies = []

    def tracked(obj, keep=lambda t: False, block=None):
        out = real(obj, keep=keep, block=block)
        copies.extend(weakref.ref(t) for t in state_tensors(out))
        return out

    real = dcp_writer.snapshot_state_dict
    monkeypatch.setattr(dcp_writer, "snapshot_state_dict", tracked)
    gc.collect()
    gc.disable()
    try:
        for i in range(2):
            state, want = _state(7 + i), _state(7 + i)
            resp = dcp.async_save(state, storage_writer=GdsckptWriter(tmp_path / f"d{i}", snapshot="device",
                                                                      chunk_bytes=64 << 10))
            getattr(resp, "upload_completion", resp).result()
            assert copies and not [r for r in copies if r() is not None]
            assert_same(_flat_tensors(_load(tmp_path / f"d{i}", want)), _flat_tensors(want))
    finally:
        gc.enable()


def _to_cuda(obj):
    if isinstance(obj, torch.Tensor):
        return obj.cuda()
    if isinstance(obj, dict):
        return {k: _to_cuda(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cuda(v) for v in obj]
    return obj


def _tensors_as(state, make):
    """The model's and the optimizer state's tensors of a {"model", "optim", "step"} state dict,
    each made by `make` from the tensor there."""
    return {"model": {k: make(v) for k, v in state["model"].items()},
            "optim": {"state": {p: {k: make(v) for k, v in s.items()} for p, s in state["optim"]["state"].items()}}}


@pytest.mark.gpu
@pytest.mark.parametrize("snapshot", ["host", "overlap"])
def test_gpu_first_staging_copies_the_state_on_the_gpu(tmp_path, one_rank_group, monkeypatch, snapshot):
    """A staging that finds the GPU's pool empty (no gdsckpt.dcp.reserve) copies the state on the
    GPU, outside torch's cache, and compresses it into the pool on a background thread, as
    save_async's first save does (no optimizer step waits): the checkpoint is the state at the
    call although the state changes right after it; the next staging finds the pool and copies
    nothing."""
    from gdsckpt.engine import pinned_pool as pp
    copies = []

    def outside_cache(nbytes, device, stream):  # the real block; the test counts the copies
        copies.append(nbytes)
        return real(nbytes, device, stream)

    real = dcp_writer.outside_cache
    monkeypatch.setattr(dcp_writer, "outside_cache", outside_cache)
    pp.release_pools()
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    opt.step()
    kw = {"snapshot": snapshot, "chunk_bytes": 64 << 10} | ({"optimizer": opt} if snapshot == "overlap" else {})
    for i in range(2):
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": i}
        want = _to_cuda(_tensors_as(state, torch.Tensor.clone))
        resp = dcp.async_save(state, storage_writer=GdsckptWriter(tmp_path / f"a{i}", **kw))
        model(torch.randn(8, 64, device="cuda")).sum().backward()
        opt.step()  # training goes on (overlap: the step waits for a snapshot that reads in place)
        getattr(resp, "upload_completion", resp).result()
        assert len(copies) == 1 and copies[0] > 0  # the first staging only
        assert pp.pools()[f"cuda:{torch.cuda.current_device()}"]["capacity_bytes"] > 0
        target = _tensors_as(state, torch.zeros_like)
        dcp.load(target, storage_reader=GdsckptReader(tmp_path / f"a{i}"))
        assert_same(target, want)
    pp.release_pools()


@pytest.mark.gpu
def test_gpu_reserve_makes_the_stagings_codec_choice(tmp_path, one_rank_group):
    """After gdsckpt.dcp.reserve the first staging samples nothing: codec="auto"'s choice was made
    from the state's bytes under the staging's keys."""
    import gdsckpt.dcp
    from gdsckpt.engine import pinned_pool as pp
    pp.release_pools()
    g = torch.Generator(device="cuda").manual_seed(3)
    state = {"model": {"w": torch.randn(3_000_000, device="cuda", generator=g)},
             "optim": {"state": {"0": {"exp_avg_sq": torch.rand(3_000_000, device="cuda", generator=g) ** 4}}},
             "step": 1}
    want = _tensors_as(state, torch.Tensor.clone)
    gdsckpt.dcp.reserve(state, wait=True).result()
    writer = GdsckptWriter(tmp_path / "a")
    getattr(resp := dcp.async_save(state, storage_writer=writer), "upload_completion", resp).result()
    assert writer.last_stats.backend == "gpu" and "codec_choice" not in writer.last_stats.stages
    target = _tensors_as(state, torch.zeros_like)
    dcp.load(target, storage_reader=GdsckptReader(tmp_path / "a"))
    assert_same(target, want)
    pp.release_pools()


@pytest.mark.gpu
def test_gpu_device_staging_copies_every_staging_and_compresses_it_into_the_pool(tmp_path, one_rank_group,
                                                                                   monkeypatch):
    """GdsckptWriter(snapshot="device") copies the state on the GPU (torch's cache) in every
    staging and compresses the copy into the pool on a background thread, as
    save_async(snapshot="device") does: the checkpoint is the state at the call although
    training changes it right after, and no optimizer step waits."""
    from gdsckpt.engine import pinned_pool as pp
    blocks = []

    def counted(obj, keep=lambda t: False, block=None):
        blocks.append(block)
        return real(obj, keep=keep, block=block)

    real = dcp_writer.snapshot_state_dict
    monkeypatch.setattr(dcp_writer, "snapshot_state_dict", counted)
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    opt.step()
    for i in range(2):
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": i}
        want = _to_cuda(_tensors_as(state, torch.Tensor.clone))
        resp = dcp.async_save(state, storage_writer=GdsckptWriter(tmp_path / f"d{i}", snapshot="device",
                                                                  chunk_bytes=64 << 10))
        model(torch.randn(8, 64, device="cuda")).sum().backward()
        opt.step()  # no hook: the staging reads its own copy
        assert not opt._optimizer_step_pre_hooks
        getattr(resp, "upload_completion", resp).result()
        assert blocks == [None] * (i + 1)  # a copy in torch's cache, every staging
        assert pp.pools()[f"cuda:{torch.cuda.current_device()}"]["capacity_bytes"] > 0
        target = _tensors_as(state, torch.zeros_like)
        dcp.load(target, storage_reader=GdsckptReader(tmp_path / f"d{i}"))
        assert_same(target, want)
    pp.release_pools()


def test_a_step_without_this_ranks_generators_restores_the_rest_and_says_so(tmp_path, one_rank_group, monkeypatch):
    """A DCP step saved without this rank's RNG() key (by fewer ranks, or by a gdsckpt that keyed
    it alike on every rank) restores everything else; the generators are left as they are, with a
    warning, instead of the whole restore failing on a missing key."""
    import random
    import gdsckpt
    from gdsckpt import Checkpointer
    from gdsckpt.format import stateful
    state = {"w": torch.arange(6.0), "rng": gdsckpt.RNG()}
    with monkeypatch.context() as m:
        m.setattr(stateful, "rank_key", lambda key: key)  # the key every rank named alike
        with Checkpointer(tmp_path / "ck") as ck:
            ck.save(1, state)
    random.seed(5)
    now = random.getstate()
    state["w"].zero_()
    with Checkpointer(tmp_path / "ck") as ck:
        with pytest.warns(UserWarning, match="'rng@rank0' is not in the checkpoint"):
            assert ck.restore(state).step == 1
    assert torch.equal(state["w"], torch.arange(6.0)) and random.getstate() == now


def test_a_dcp_restore_applies_strict(tmp_path, one_rank_group):
    """Checkpointer.restore of a DCP step: strict=True refuses a tensor whose dtype or shape differs
    (DCP's planner converted the dtype) and a key the step lacks, as a StateMismatchError naming it,
    before anything is read; strict=False loads the dtype converted and leaves a missing key alone
    (it failed on the missing key)."""
    import gdsckpt
    from gdsckpt import Checkpointer
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"w": torch.arange(4.0), "meta": {"a": 1}})
        half = {"w": torch.zeros(4, dtype=torch.float16), "meta": {"a": 0}}
        with pytest.raises(gdsckpt.StateMismatchError, match=r"'w' is torch.float32\[4\] in the checkpoint but "
                                                             r"torch.float16\[4\]"):
            ck.restore(half)
        assert not half["w"].any() and half["meta"] == {"a": 0}  # nothing read
        with pytest.raises(gdsckpt.StateMismatchError, match="'new' not in the checkpoint"):
            ck.restore({"w": torch.zeros(4), "meta": {"a": 0}, "new": torch.zeros(3)})
        assert ck.restore(half, strict=False).step == 1
        assert torch.equal(half["w"], torch.arange(4.0).half()) and half["meta"] == {"a": 1}
        more = {"w": torch.zeros(4), "meta": {"a": 0}, "new": torch.full((3,), 7.0)}
        ck.restore(more, strict=False)
        assert torch.equal(more["w"], torch.arange(4.0)) and torch.equal(more["new"], torch.full((3,), 7.0))
