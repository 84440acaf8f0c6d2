"""gdsckpt.integrations.megatron with the real megatron-core on the CPU (gdsckpt[megatron]): two
gloo processes, tensor-parallel 2.

megatron-core's own modules: its MLP of ColumnParallelLinear / RowParallelLinear (each rank holds
half of each weight), whose sharded_state_dict() gives the ShardedTensors, and AdamW's state
turned into ShardedTensors by megatron-core's optimizer helpers (get_param_id_to_sharded_param_map,
optim_state_to_sharding_state: what its FP32Optimizer does; that optimizer, its DDP and GPTModel's
attention need CUDA, so the GPT run is tests/integrations/test_integrations_megatron_gpu.py).
Checkpoints go through dist_checkpointing.save / load with the gdsckpt strategies: async saves
(scheduled on gdsckpt's AsyncCallsQueue, finalized while training goes on) at steps 2, 4 and 5,
a sync save at step 3. A new pair of processes resumes from steps 3, 4 and 5 and trains to
step 8: weights and AdamW moments equal the uninterrupted run's bit for bit. Also: no process is
started by an async save, the host pool reserved ahead (strategy.reserve) is not grown by the saves, and a damaged
rank file is a gdsckpt error naming it; and a GPTModel's sharded state (built on the CPU), whose
stacked layers megatron-core hands DCP as torch's legacy ShardedTensor, round-trips sync and async.
(Megatron's own torch_dist save needs CUDA, so the switch from torch_dist checkpoints is tested in
the GPU test.) Run as a script (by the test, once per rank), this file is a rank."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from integration_tools import PREFIX, REPO, child_pythonpath, digests, report  # noqa: E402

WORLD, STEPS, STOP_AT = 2, 8, 5
ASYNC_AT, SYNC_AT = (2, 4, 5), 3

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")


# ---------------------------------------------------------------- a rank


def setup(root: Path, phase: str):
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{root}/pg-{phase}", rank=int(os.environ["RANK"]),
                            world_size=WORLD)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=WORLD)
    torch.manual_seed(0)


def build():
    import torch
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig
    config = TransformerConfig(num_layers=1, hidden_size=16, ffn_hidden_size=64, num_attention_heads=4,
                               use_cpu_initialization=True, gradient_accumulation_fusion=False)
    torch.manual_seed(0)
    model = MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    return model, opt


def train_step(model, opt, step: int) -> None:
    import torch
    g = torch.Generator().manual_seed(1000 + step)  # the same batch for a step in every run
    x = torch.randn(4, 2, 16, generator=g)
    opt.zero_grad()
    out, bias = model(x)  # the MLP leaves its output bias to the caller (Megatron fuses it later)
    (out + bias).pow(2).mean().backward()
    opt.step()


def sharded_state(model, opt, step: int, loading: bool = False) -> dict:
    """The state as Megatron checkpoints it: the model's ShardedTensors, AdamW's moments as
    ShardedTensors of the same sharding, its param_groups and one step common (FP32Optimizer's way)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map, optim_state_to_sharding_state,
    )
    import torch
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    model_sd = model.sharded_state_dict(prefix="", metadata=metadata)
    if loading and not opt.state:  # the moments to load into, as Megatron's init_state_fn makes them
        for p in model.parameters():
            opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    opt_sd = opt.state_dict()
    # one step for all, as FP32Optimizer keeps it (common_step); state_dict()'s per-parameter dicts
    # are the optimizer's own
    opt_sd["state"] = {i: {k: v for k, v in s.items() if k != "step"} for i, s in opt_sd["state"].items()}
    id_map = get_param_id_to_sharded_param_map(model_sd, list(model.parameters()))
    optim_state_to_sharding_state(opt_sd, id_map, exclude_keys="step")
    return {"model": model_sd, "optimizer": opt_sd, "step": step}


def final(model, opt) -> dict:
    return {"model": digests(model.state_dict()), "optimizer": digests(opt.state_dict()["state"])}


def rank_first(root: Path) -> dict:
    import multiprocessing

    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from gdsckpt.engine import pinned_pool
    from gdsckpt.integrations.megatron import AsyncCallsQueue, save_strategy
    setup(root, "first")
    model, opt = build()
    for step in range(1, STEPS + 1):
        train_step(model, opt, step)
    out = {"reference": final(model, opt), "pool": [], "children": []}

    model, opt = build()
    queue, strategy = AsyncCallsQueue(), save_strategy()
    for step in range(1, STOP_AT + 1):
        train_step(model, opt, step)
        if step == 1:  # the moments exist: the async saves' pool, made ahead of them
            held = strategy.reserve(sharded_state(model, opt, step), wait=True).result().held_bytes
            out["reserved"] = [held, pinned_pool.pools().get("cpu", {}).get("capacity_bytes")]
        queue.maybe_finalize_async_calls(blocking=False)  # as Megatron-LM's loop, every step
        path = root / f"step-{step}"
        if dist.get_rank() == 0:
            path.mkdir()
        dist.barrier()
        if step in ASYNC_AT:
            request = dist_checkpointing.save(sharded_state(model, opt, step), str(path), sharded_strategy=strategy,
                                              async_sharded_save=True)
            queue.schedule_async_request(request)
            out["children"].append(len(multiprocessing.active_children()))
            out["pool"].append(pinned_pool.pools().get("cpu", {}).get("capacity_bytes"))
        elif step == SYNC_AT:
            dist_checkpointing.save(sharded_state(model, opt, step), str(path), sharded_strategy=strategy)
    queue.maybe_finalize_async_calls(blocking=True)
    out["files"] = sorted(p.name for p in (root / f"step-{STOP_AT}").iterdir())
    return out


def resume(root: Path, directory: str) -> tuple[dict, int]:
    from megatron.core import dist_checkpointing
    from gdsckpt.integrations.megatron import load_strategy
    model, opt = build()
    loaded = dist_checkpointing.load(sharded_state(model, opt, 0, loading=True), str(root / directory),
                                     sharded_strategy=load_strategy())
    model.load_state_dict(loaded["model"], strict=False)
    import torch
    for param_state in loaded["optimizer"]["state"].values():
        param_state["step"] = torch.tensor(float(loaded["step"]))
    opt.load_state_dict(loaded["optimizer"])
    return (model, opt), loaded["step"]


def rank_resume(root: Path) -> dict:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    setup(root, "resume")
    out = {}
    for directory in (f"step-{SYNC_AT}", "step-4", f"step-{STOP_AT}"):
        (model, opt), step = resume(root, directory)
        for s in range(step + 1, STEPS + 1):
            train_step(model, opt, s)
        out[directory] = final(model, opt) | {"step": step}
    # the metadata.json backend picks the load strategy where megatron-core keeps a registry
    config = json.loads((root / f"step-{SYNC_AT}" / "metadata.json").read_text())
    out["backend"] = config.get("sharded_backend")
    from gdsckpt.integrations.megatron import register
    if register():  # megatron-core 0.16-0.18: dist_checkpointing.load with no strategy given
        (model, opt), _ = resume(root, f"step-{SYNC_AT}")
        other, _ = build()
        dist_checkpointing.load({"model": sharded_state(other, opt, 0)["model"]}, str(root / f"step-{SYNC_AT}"))
        out["by_backend_name"] = digests(other.state_dict()) == digests(model.state_dict())

    # a damaged rank file: a gdsckpt error naming the file, on the rank that read it
    dist.barrier()
    damaged = root / f"step-{STOP_AT}" / "__1_0.gdsckpt"
    if dist.get_rank() == 0:
        data = bytearray(damaged.read_bytes())
        for i in range(len(data) // 2, len(data) // 2 + 64):
            data[i] ^= 0xFF
        damaged.write_bytes(bytes(data))
    dist.barrier()
    model, opt = build()
    try:
        dist_checkpointing.load(sharded_state(model, opt, 0, loading=True), str(root / f"step-{STOP_AT}"),
                                sharded_strategy=__import__("gdsckpt.integrations.megatron", fromlist=["x"]).load_strategy())
        out["damaged"] = None
    except BaseException as e:  # noqa: BLE001 - the test names what it must be
        out["damaged"] = {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "message": str(e)}
    dist.barrier()
    out["gpt"] = gpt_round_trip(root)
    return out


def gpt_round_trip(root: Path) -> dict:
    """A GPTModel's sharded state (built on the CPU, tensor-parallel; its forward needs CUDA): its
    layers' tensors are stacked on a prepended axis, which megatron-core hands DCP as torch's (legacy)
    ShardedTensor. Saved sync and async (the model changed while the async write runs), loaded
    into zeroed weights: every tensor equal to the saved one."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    from gdsckpt.integrations.megatron import AsyncCallsQueue, load_strategy, save_strategy
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                     max_sequence_length=16)
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    saved = digests({k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")})
    out = {"prepended": sorted({v.prepend_axis_num for v in nested_values(model.sharded_state_dict(metadata=metadata))
                               if isinstance(v, ShardedTensor)})}
    for name, is_async in (("gpt-sync", False), ("gpt-async", True)):
        if dist.get_rank() == 0:
            (root / name).mkdir()
        dist.barrier()
        request = dist_checkpointing.save({"model": model.sharded_state_dict(metadata=metadata)}, str(root / name),
                                          sharded_strategy=save_strategy(), async_sharded_save=is_async)
        if is_async:
            queue = AsyncCallsQueue()
            queue.schedule_async_request(request)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1)
            queue.maybe_finalize_async_calls(blocking=True)
    for name in ("gpt-sync", "gpt-async"):
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        dist_checkpointing.load({"model": model.sharded_state_dict(metadata=metadata)}, str(root / name),
                                sharded_strategy=load_strategy())
        got = digests({k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")})
        out[name] = got == saved
    return out


# ---------------------------------------------------------------- the tests


def run_world(phase: str, root: Path, timeout: float = 240, world: int = WORLD) -> list[dict]:
    """The ranks of `phase`, each a process of its own; their RESULTs, by rank."""
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, __file__, phase, str(root)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO) for r in range(world)]
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (stdout, stderr) in zip(procs, outs):
        assert p.returncode == 0, f"rank exited {p.returncode}\n--- stdout\n{stdout[-3000:]}\n--- stderr\n{stderr[-6000:]}"
    results = [json.loads(l[len(PREFIX):]) for stdout, _ in outs for l in stdout.splitlines() if l.startswith(PREFIX)]
    assert len(results) == world
    return results


def test_train_save_resume_in_new_processes_is_bit_identical(tmp_path):
    first = run_world("first", tmp_path)
    for rank in first:
        assert rank["children"] == [0] * len(ASYNC_AT)  # no process forked or spawned by an async save
        # the host pool holds one save's compressed bytes: reserved ahead, not grown by the saves
        held, pool = rank["reserved"]
        assert 0 < held == pool and rank["pool"] == [pool] * len(ASYNC_AT), (rank["reserved"], rank["pool"])
    files = first[0]["files"]  # each rank's tensors, each rank's pickled ShardedObjects, Megatron's files
    assert {".metadata", "__0_0.gdsckpt", "__1_0.gdsckpt", "common.pt", "metadata.json"} <= set(files), files

    resumed = run_world("resume", tmp_path)
    for rank, (ref, got) in enumerate(zip(first, resumed)):
        # step 4: an async save whose write ran while step 5 trained
        for directory, step in ((f"step-{SYNC_AT}", SYNC_AT), ("step-4", 4), (f"step-{STOP_AT}", STOP_AT)):
            assert got[directory]["step"] == step
            assert got[directory]["model"] == ref["reference"]["model"], f"rank {rank} {directory}: weights differ"
            assert got[directory]["optimizer"] == ref["reference"]["optimizer"], f"rank {rank} {directory}: AdamW differs"
        assert got["backend"] == "gdsckpt"
        assert got.get("by_backend_name", True), "dist_checkpointing.load without a strategy read it wrong"
    errors = [r["damaged"] for r in resumed]
    assert all(e is not None for e in errors), errors
    assert any("CheckpointFormatError" in e["mro"] and "__1_0.gdsckpt" in e["message"] for e in errors), errors
    for rank in resumed:
        assert rank["gpt"]["prepended"] == [0, 1]  # both kinds of ShardedTensor were there
        assert rank["gpt"]["gpt-sync"] and rank["gpt"]["gpt-async"], rank["gpt"]


if __name__ == "__main__":
    report((rank_first if sys.argv[1] == "first" else rank_resume)(Path(sys.argv[2])))


def test_a_bad_codec_is_refused_when_the_strategy_is_made():
    """Not at the first checkpoint, hours into the run."""
    from gdsckpt.integrations.megatron import save_strategy
    with pytest.raises(ValueError, match="unknown codec 'lz4'"):
        save_strategy(codec="lz4")


def test_the_queue_runs_another_strategys_request_on_a_thread_of_this_process():
    """A request with an async_fn (torch_dist's, say): preload_fn on the caller's thread, async_fn on
    a thread of this process (no fork), finalize functions after it, in order."""
    import threading

    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from gdsckpt.integrations.megatron import AsyncCallsQueue
    seen, gate = [], threading.Event()

    def write(a, staged, c):
        gate.wait(10)
        seen.append(("write", os.getpid(), threading.current_thread() is threading.main_thread(), staged))

    queue = AsyncCallsQueue()
    request = AsyncRequest(write, (1, "live", 3), [lambda: seen.append("finalized")], preload_fn=lambda: "staged")
    assert queue.schedule_async_request(request) == 0
    assert queue.maybe_finalize_async_calls(blocking=False) == [] and queue.get_num_unfinalized_calls() == 1
    gate.set()
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    assert seen == [("write", os.getpid(), False, "staged"), "finalized"]
