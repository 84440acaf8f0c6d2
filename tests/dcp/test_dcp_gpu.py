"""gdsckpt.dcp on 2 GPUs with NCCL: an FSDP2 (fully_shard) transformer with AdamW state.

    .venv/bin/python -m pytest -v tests/dcp/test_dcp_gpu.py

Each test spawns its ranks with torch.multiprocessing (one process per GPU, a FileStore
rendezvous, "cpu:gloo,cuda:nccl" so that dcp.async_save has its CPU backend):

* the sharded model and optimizer state after a few AdamW steps is saved with GdsckptWriter
  (each rank compresses its shards on its own GPU) and loaded with GdsckptReader into a fresh
  FSDP2 model and optimizer through get_state_dict / set_state_dict: bit-exact; then
  resharded onto 1 GPU (a plain, unsharded model) and compared with the full tensors;
* dcp.async_save with GdsckptWriter's compressed staging (DCP's collectives on a separate gloo
  group), then with its overlapped staging (optimizer=: the snapshot runs during the next
  forward/backward, the AdamW step waits for it): training steps run while the save is in
  flight, and the checkpoint holds the state as it was when async_save was called.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ckpt_tools import end_rank

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs 2 CUDA GPUs"),
]

VOCAB, D, HEADS, LAYERS, CTX = 257, 128, 4, 2, 64  # VOCAB odd: the head's rows shard unevenly (129/128)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.qkv, self.proj = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.ln2, self.fc, self.out = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, HEADS, d // HEADS).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(CTX, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build(seed: int, mesh=None):
    """TinyLM on the current GPU (FSDP2-sharded over `mesh` if given) and its AdamW."""
    torch.manual_seed(seed)
    model = TinyLM().cuda()
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt


def train(model, opt, steps: int, seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, VOCAB, (4, 33), device="cuda", generator=g)
        logits = model(idx[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def flat(obj, prefix=""):
    """(path, leaf) of a model/optimizer state dict; DTensors are leaves."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from flat(v, f"{prefix}/{k}")
    elif isinstance(obj, list) and any(isinstance(v, dict) for v in obj):
        for i, v in enumerate(obj):
            yield from flat(v, f"{prefix}/{i}")
    else:
        yield prefix, obj


def same_bytes(a: torch.Tensor, b: torch.Tensor, where: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype, a.shape, b.shape)
    ab = a.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    bb = b.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    assert torch.equal(ab, bb), f"bytes differ at {where}"


def compare_sharded(got: dict, want: dict) -> int:
    from torch.distributed.tensor import DTensor
    g, w = dict(flat(got)), dict(flat(want))
    assert set(g) == set(w), set(g) ^ set(w)
    n = 0
    for k, v in w.items():
        if isinstance(v, DTensor):
            assert isinstance(g[k], DTensor) and tuple(g[k].placements) == tuple(v.placements), k
            same_bytes(g[k].to_local(), v.to_local(), k)
            n += 1
        elif isinstance(v, torch.Tensor):
            same_bytes(g[k], v, k)
            n += 1
        else:
            assert g[k] == v, (k, g[k], v)
    return n


def local_copy(state: dict) -> dict:
    from torch.distributed.tensor import DTensor
    out = {}
    for k, v in flat(state):
        if isinstance(v, DTensor):
            out[k] = ("dtensor", v.to_local().clone())
        elif isinstance(v, torch.Tensor):
            out[k] = ("tensor", v.clone())
        else:
            out[k] = ("value", v)
    return out


def compare_with_copy(state: dict, copy: dict) -> None:
    from torch.distributed.tensor import DTensor
    got = dict(flat(state))
    assert set(got) == set(copy)
    for k, (kind, v) in copy.items():
        if kind == "value":
            assert got[k] == v, k
        else:
            same_bytes(got[k].to_local() if isinstance(got[k], DTensor) else got[k], v, k)


# ---------------------------------------------------------------- ranks


def _init(rank: int, world: int, root: Path, tag: str) -> None:
    import torch.distributed as dist
    warnings.filterwarnings("ignore")
    torch.cuda.set_device(rank)
    store = dist.FileStore(str(root / f"store-{tag}"), world)
    dist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=180))


def _roundtrip(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from gdsckpt.dcp import GdsckptReader, GdsckptWriter

    root = Path(root)
    _init(rank, world, root, "roundtrip")
    try:
        mesh = init_device_mesh("cuda", (world,))
        model, opt = build(0, mesh)
        train(model, opt, 3, seed=100 + rank)
        msd, osd = get_state_dict(model, opt)
        assert any(isinstance(v, DTensor) for v in msd.values())
        writer = GdsckptWriter(root / "ckpt")
        dcp.save({"model": msd, "optim": osd}, storage_writer=writer)
        assert writer.last_stats is not None and writer.last_stats.backend == "gpu", writer.last_stats
        torch.cuda.synchronize()

        # reference full tensors for the 1-GPU reshard (collective: every rank takes part)
        ref = {}
        for k, v in flat({"model": msd, "optim": osd}):
            ref[k] = v.full_tensor().cpu() if isinstance(v, DTensor) else (v.cpu() if isinstance(v, torch.Tensor) else v)
        if rank == 0:
            torch.save(ref, root / "reference.pt")

        # load into a fresh FSDP2 model and optimizer (different init, optimizer state zeros)
        model2, opt2 = build(1, mesh)
        msd2, osd2 = get_state_dict(model2, opt2)
        target = {"model": msd2, "optim": osd2}
        reader = GdsckptReader(root / "ckpt")
        dcp.load(target, storage_reader=reader)
        assert any(s.backend == "gpu" for s in reader.last_stats), reader.last_stats  # decoded on this GPU
        set_state_dict(model2, opt2, model_state_dict=target["model"], optim_state_dict=target["optim"])
        msd3, osd3 = get_state_dict(model2, opt2)
        n = compare_sharded({"model": msd3, "optim": osd3}, {"model": msd, "optim": osd})
        assert n >= 3 * len(msd), n  # weights, exp_avg, exp_avg_sq (+ step) for every parameter
        dist.barrier()
    finally:
        dist.destroy_process_group()
    end_rank()


def _one_gpu(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from gdsckpt.dcp import GdsckptReader

    root = Path(root)
    _init(rank, world, root, "one")
    try:
        model, opt = build(2)  # plain, unsharded, on cuda:0
        msd, osd = get_state_dict(model, opt)
        target = {"model": msd, "optim": osd}
        dcp.load(target, storage_reader=GdsckptReader(root / "ckpt"))
        set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
        msd, osd = get_state_dict(model, opt)
        ref = torch.load(root / "reference.pt", weights_only=True)
        got = dict(flat({"model": msd, "optim": osd}))
        assert set(got) == set(ref), set(got) ^ set(ref)
        for k, v in ref.items():
            if isinstance(v, torch.Tensor):
                same_bytes(got[k], v, k)
            else:
                assert got[k] == v, (k, got[k], v)
    finally:
        dist.destroy_process_group()
    end_rank()


def _async(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from gdsckpt.writing.snapshot.overlap import memory_of, optimizer_memory
    from gdsckpt.dcp import GdsckptReader, GdsckptWriter

    root = Path(root)
    _init(rank, world, root, "async")
    try:
        mesh = init_device_mesh("cuda", (world,))
        model, opt = build(0, mesh)
        train(model, opt, 2, seed=200 + rank)
        # DCP's own collectives on a separate gloo group, as torchtitan does: the background save
        # never shares a communicator with the training steps that run while it is in flight
        ckpt_pg = dist.new_group(backend="gloo")
        for name, overlap in (("async", False), ("async-overlap", True)):
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            before = local_copy(state)
            if overlap:  # FSDP2's shards and AdamW moments are read in the background, not copied
                guarded = optimizer_memory(opt)
                loose = [k for k, (kind, v) in before.items() if kind != "value" and v.numel() > 1
                         and memory_of(dict(flat(state))[k]) not in guarded]
                assert not loose, loose
            writer = GdsckptWriter(root / name, optimizer=opt if overlap else None)
            fut = dcp.async_save(state, storage_writer=writer, process_group=ckpt_pg)
            # the overlap returns before its snapshot: DCP's AsyncSaveResponse. The host staging may
            # return one too: a first save without reserve() stages from a copy of the state on the
            # GPU, off the call (device_copy.copy_first); either way the state may change at once
            # (the training below), as the comparison after the load checks
            assert hasattr(fut, "staging_completion") or not overlap
            train(model, opt, 2, seed=300 + rank)  # mutates the parameters and AdamW state in place
            fut = getattr(fut, "upload_completion", fut)
            fut.result()
            assert writer.last_stats is not None and writer.last_stats.backend == "gpu", writer.last_stats
            assert len(opt._optimizer_step_pre_hooks) == 0
            changed = local_copy(state)
            assert any(kind != "value" and not torch.equal(v, before[k][1]) for k, (kind, v) in changed.items())

            model2, opt2 = build(1, mesh)
            msd2, osd2 = get_state_dict(model2, opt2)
            target = {"model": msd2, "optim": osd2}
            dcp.load(target, storage_reader=GdsckptReader(root / name))
            set_state_dict(model2, opt2, model_state_dict=target["model"], optim_state_dict=target["optim"])
            msd3, osd3 = get_state_dict(model2, opt2)
            compare_with_copy({"model": msd3, "optim": osd3}, before)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    end_rank()


def _launch(fn, world: int, root: Path) -> None:
    import torch.multiprocessing as mp
    # NVLink SHARP multicast off (the lent H200 hosts do not support it reliably)
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    mp.start_processes(fn, args=(world, str(root)), nprocs=world, join=True, start_method="spawn")


def test_fsdp2_adamw_roundtrip_bit_exact_then_reshard_onto_one_gpu(tmp_path):
    _launch(_roundtrip, 2, tmp_path)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".metadata", "__0_0.gdsckpt", "__1_0.gdsckpt"]
    _launch(_one_gpu, 1, tmp_path)


def test_fsdp2_async_save_snapshot_on_gpu(tmp_path):
    _launch(_async, 2, tmp_path)
