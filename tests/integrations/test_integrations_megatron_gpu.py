"""gdsckpt.integrations.megatron with the real megatron-core on one GPU (marked gpu): what the CPU
test (test_integrations_megatron.py) cannot run there.

A GPTModel (megatron-core's local layer spec: no Transformer Engine needed), wrapped in its
DistributedDataParallel, with the optimizer get_megatron_optimizer builds (Adam, fp32), trains as
Megatron-LM's loop trains it; the checkpoint is the state Megatron-LM saves (the model's and the
optimizer's sharded_state_dict, the iteration). A child process trains 8 steps uninterrupted (the
reference), then afresh to step 5: async saves at steps 2 and 5 scheduled on gdsckpt's
AsyncCallsQueue, one at step 4 on megatron-core's own AsyncCallsQueue (it runs it without forking:
the request has no async_fn), a sync save at step 3, and the same step 3 through Megatron's own
torch_dist strategy. A second child resumes from gdsckpt's steps 3 and 5 and from torch_dist's
step 3 (read through the gdsckpt load strategy, which falls back to Megatron's reader there), and
trains to step 8: weights and optimizer state equal the reference's bit for bit.

    pytest -q tests/integrations/test_integrations_megatron_gpu.py   (one GPU, megatron-core installed)
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from integration_tools import digests, report, run_child  # noqa: E402

STEPS, STOP_AT, ASYNC_OURS, ASYNC_MEGATRON, SYNC_AT = 8, 5, (2, 5), 4, 3
DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")]


def setup(root: Path, phase: str):
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{root}/pg-{phase}", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    torch.use_deterministic_algorithms(True, warn_only=True)  # deterministic kernels where an op has one


def build():
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128,
                     max_sequence_length=32).cuda()
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1, clip_grad=1.0), [ddp])
    return ddp, opt


def train_step(ddp, opt, step: int) -> None:
    import torch
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 128, (2, 32), generator=g).cuda()
    position_ids = torch.arange(32).expand(2, 32).cuda()
    mask = torch.ones(2, 1, 32, 32, dtype=torch.bool).triu(1).cuda()
    ddp.zero_grad_buffer()
    opt.zero_grad()
    ddp(tokens, position_ids, mask, labels=tokens).float().mean().backward()
    ddp.finish_grad_sync()
    opt.step()


def sharded_state(ddp, opt, step: int, loading: bool = False) -> dict:
    from megatron.core import parallel_state
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    state = {"model": ddp.module.sharded_state_dict(metadata=metadata), "iteration": step}
    state["optimizer"] = opt.sharded_state_dict(state, is_loading=loading, metadata=metadata)
    return state


def final(ddp, opt) -> dict:
    return {"model": digests(ddp.module.state_dict()), "optimizer": digests(opt.state_dict())}


def child_first(root: Path) -> dict:
    import multiprocessing

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue as MegatronQueue
    from gdsckpt.integrations.megatron import AsyncCallsQueue, save_strategy
    setup(root, "first")
    ddp, opt = build()
    for step in range(1, STEPS + 1):
        train_step(ddp, opt, step)
    out = {"reference": final(ddp, opt), "children": []}

    ddp, opt = build()
    queue, megatron_queue, strategy = AsyncCallsQueue(), MegatronQueue(), save_strategy()
    for step in range(1, STOP_AT + 1):
        train_step(ddp, opt, step)
        queue.maybe_finalize_async_calls(blocking=False)
        path = root / f"step-{step}"
        path.mkdir()
        if step in ASYNC_OURS or step == ASYNC_MEGATRON:
            # counted against the children before the save: Megatron's own torch_dist save (step 3)
            # leaves its multiprocessing Manager's server process running
            before = {p.pid for p in multiprocessing.active_children()}
            request = dist_checkpointing.save(sharded_state(ddp, opt, step), str(path), sharded_strategy=strategy,
                                              async_sharded_save=True)
            (queue if step in ASYNC_OURS else megatron_queue).schedule_async_request(request)
            out["children"].append(len({p.pid for p in multiprocessing.active_children()} - before))
        elif step == SYNC_AT:
            dist_checkpointing.save(sharded_state(ddp, opt, step), str(path), sharded_strategy=strategy)
            (root / "torch_dist-3").mkdir()
            dist_checkpointing.save(sharded_state(ddp, opt, step), str(root / "torch_dist-3"))
    queue.maybe_finalize_async_calls(blocking=True)
    megatron_queue.maybe_finalize_async_calls(blocking=True)
    return out


def child_resume(root: Path) -> dict:
    from megatron.core import dist_checkpointing
    from gdsckpt.integrations.megatron import load_strategy
    setup(root, "resume")
    out = {}
    for directory in (f"step-{SYNC_AT}", f"step-{ASYNC_MEGATRON}", f"step-{STOP_AT}", "torch_dist-3"):
        ddp, opt = build()
        loaded = dist_checkpointing.load(sharded_state(ddp, opt, 0, loading=True), str(root / directory),
                                         sharded_strategy=load_strategy())
        ddp.module.load_state_dict(loaded["model"], strict=False)  # loaded in place already; extra state aside
        opt.load_state_dict(loaded["optimizer"])
        for s in range(loaded["iteration"] + 1, STEPS + 1):
            train_step(ddp, opt, s)
        out[directory] = final(ddp, opt) | {"step": loaded["iteration"],
                                            "files": sorted(p.name for p in (root / directory).iterdir())}
    return out


def test_gpt_train_save_resume_on_the_gpu_is_bit_identical(tmp_path):
    first = run_child(Path(__file__), "first", str(tmp_path), env=DETERMINISTIC)
    assert first["children"] == [0, 0, 0]  # no process forked or spawned for an async save
    resumed = run_child(Path(__file__), "resume", str(tmp_path), env=DETERMINISTIC)
    ref = first["reference"]
    for directory, step in ((f"step-{SYNC_AT}", SYNC_AT), (f"step-{ASYNC_MEGATRON}", ASYNC_MEGATRON),
                            (f"step-{STOP_AT}", STOP_AT), ("torch_dist-3", 3)):
        got = resumed[directory]
        assert got["step"] == step, directory
        assert got["model"] == ref["model"], f"{directory}: final weights differ from the uninterrupted run's"
        assert got["optimizer"] == ref["optimizer"], f"{directory}: final optimizer state differs"
        gdsckpt_files = [f for f in got["files"] if f.endswith(".gdsckpt")]
        assert bool(gdsckpt_files) == (directory != "torch_dist-3"), got["files"]


if __name__ == "__main__":
    os.environ.update(DETERMINISTIC)
    report((child_first if sys.argv[1] == "first" else child_resume)(Path(sys.argv[2])))
