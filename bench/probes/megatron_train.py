"""Megatron-core training checkpointed through gdsckpt's dist_checkpointing strategy against
Megatron's own default (torch_dist), in one run: GPU idle per checkpoint, peak host memory, and
restore time (issue 48 part 5).

    python bench/probes/megatron_train.py --out DIR                          # one GPU, ~4.5 GB of state
    python bench/probes/megatron_train.py --out DIR --size-gb 0.05 --device cpu

One process (world 1, NCCL on the GPU, gloo on the CPU). The model: on the GPU a GPTModel
(megatron-core's local layer spec) wrapped in its DistributedDataParallel, with the optimizer
get_megatron_optimizer builds (Adam, fp32: weights and two moments, 12 bytes a parameter), its
layers chosen for --size-gb of state; on the CPU (where GPTModel's attention, Megatron's DDP and
its optimizers need CUDA) a stack of megatron-core MLPs with torch AdamW, whose moments are
sharded by megatron-core's optimizer helpers. The checkpoint is the state Megatron-LM saves: the
model's and the optimizer's sharded_state_dict and the iteration, through dist_checkpointing.save.

Modes, one after the other, each with --saves checkpoints and --train-steps steps between them:
* gdsckpt-sync, gdsckpt-async: gdsckpt.integrations.megatron's save strategy; async scheduled on
  its AsyncCallsQueue (no worker process), its host pool reserved before the loop (reserve_s).
* gdsckpt-async-megatron-queue: the same saves scheduled on megatron-core's own AsyncCallsQueue,
  which runs them without forking but finalizes each at its next call, waiting there (GPU only:
  that queue all-reduces a CUDA tensor).
* torch_dist-sync, torch_dist-async: Megatron's default strategy; async scheduled on megatron-core's
  AsyncCallsQueue as Megatron-LM's loop does (a forked worker per save, async_strategy "mcore";
  nvidia-resiliency-ext's "nvrx" is not assumed installed). GPU only: torch_dist's save calls
  torch.cuda.synchronize.
As Megatron-LM's loop: maybe_finalize_async_calls(blocking=False) before every step, and a
blocking one before the next mode.

Per checkpoint: blocked_s (the save call, and scheduling it), idle_s (blocked_s + how much longer
the following --train-steps steps took than the same steps with no save in flight: work a save
leaves to the background and the loop pays for), the background's drain (the blocking finalize
at the mode's end). Per mode: peak host memory over the mode's start, the process's RSS and its
children's USS (Megatron's forked workers: what the fork added), sampled every 5 ms; restore: a fresh model and optimizer
loaded from the mode's last checkpoint through dist_checkpointing.load (gdsckpt's load strategy,
which reads torch_dist directories through Megatron's own reader), timed, its files first dropped
from the page cache with posix_fadvise(DONTNEED) ("restore_cache": "fadvise_dontneed", not a
cold disk), and the weights checked against those saved (a sum of each tensor's bytes). Writes DIR/megatron_train.json with the device, the
date, the versions and gdsckpt's I/O path.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import threading
import time
from pathlib import Path


def args_of(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--size-gb", type=float, default=4.5, help="model + optimizer state, GB")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--train-steps", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None, help="where checkpoints go (default OUT/ck)")
    p.add_argument("--modes", default="gdsckpt-sync,gdsckpt-async,gdsckpt-async-megatron-queue,"
                                      "torch_dist-sync,torch_dist-async")
    a = p.parse_args(argv)
    a.dir = a.dir or a.out / "ck"
    return a


# ------------------------------------------------------------------ the run
class Run:
    def __init__(self, a):
        import torch
        import torch.distributed as dist
        self.a, self.cuda = a, a.device == "cuda"
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        a.out.mkdir(parents=True, exist_ok=True)
        init = f"file://{a.out.resolve()}/pg-{os.getpid()}"
        if self.cuda:
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if self.cuda else "gloo", init_method=init, rank=0, world_size=1)
        from megatron.core import parallel_state
        parallel_state.initialize_model_parallel(1, 1)
        if self.cuda:
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
            model_parallel_cuda_manual_seed(0)
        self.metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}

    def build(self):
        """(model, optimizer, the module whose sharded_state_dict is the model's)."""
        import torch
        torch.manual_seed(0)
        gb = self.a.size_gb * 1e9
        if self.cuda:
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
            from megatron.core.models.gpt.gpt_model import GPTModel
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
            from megatron.core.transformer.transformer_config import TransformerConfig
            h, vocab = 2048, 32768
            layers = max(1, round((gb / 12 - vocab * h) / (12 * h * h + 13 * h)))
            config = TransformerConfig(num_layers=layers, hidden_size=h, num_attention_heads=16,
                                       hidden_dropout=0.0, attention_dropout=0.0)
            model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                             max_sequence_length=512).cuda()
            ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
            opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, clip_grad=1.0), [ddp])
            return ddp, opt, model
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.mlp import MLP, MLPSubmodules
        from megatron.core.transformer.transformer_config import TransformerConfig
        h = 256
        layers = max(1, round(gb / 12 / (8 * h * h)))
        config = TransformerConfig(num_layers=1, hidden_size=h, ffn_hidden_size=4 * h, num_attention_heads=4,
                                   use_cpu_initialization=True, gradient_accumulation_fusion=False)
        model = torch.nn.ModuleList(MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                              linear_fc2=RowParallelLinear)) for _ in range(layers))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4), model

    def step(self, model, opt, step: int) -> float:
        import torch
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(step)
        if self.cuda:
            tokens = torch.randint(0, 32768, (4, 512), generator=g).cuda()
            pos = torch.arange(512).expand(4, 512).cuda()
            mask = torch.ones(4, 1, 512, 512, dtype=torch.bool).triu(1).cuda()
            model.zero_grad_buffer()
            opt.zero_grad()
            model(tokens, pos, mask, labels=tokens).float().mean().backward()
            model.finish_grad_sync()
            opt.step()
            torch.cuda.synchronize()
        else:
            x = torch.randn(8, 4, 256, generator=g)
            opt.zero_grad()
            for mlp in model:
                out, bias = mlp(x)
                x = out + bias
            x.pow(2).mean().backward()
            opt.step()
        return time.perf_counter() - t0

    def sharded_state(self, model, opt, module, step: int, loading: bool = False) -> dict:
        import torch
        state = {"model": module.sharded_state_dict(prefix="", metadata=self.metadata) if self.cuda else
                 _stack_sharded(module, self.metadata), "iteration": step}
        if self.cuda:
            state["optimizer"] = opt.sharded_state_dict(state, is_loading=loading, metadata=self.metadata)
            return state
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map, optim_state_to_sharding_state,
        )
        if loading and not opt.state:
            for p in module.parameters():
                opt.state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        sd = opt.state_dict()
        sd["state"] = {i: {k: v for k, v in s.items() if k != "step"} for i, s in sd["state"].items()}
        optim_state_to_sharding_state(sd, get_param_id_to_sharded_param_map(state["model"], list(module.parameters())))
        state["optimizer"] = sd
        return state


def _stack_sharded(stack, metadata) -> dict:
    out = {}
    for i, mlp in enumerate(stack):
        out.update(mlp.sharded_state_dict(prefix=f"layers.{i}.", metadata=metadata))
    return out


class RssPeak:
    """The largest RSS of this process plus its children's USS, sampled every 5 ms while it runs."""

    def __init__(self):
        import psutil
        self.proc, self.peak, self.stop = psutil.Process(), 0, threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def rss(self) -> int:
        """This process's RSS plus its children's USS: a forked worker's RSS counts the pages it
        shares with this process (copy-on-write) again; its USS is what the fork added."""
        total = self.proc.memory_info().rss
        for c in self.proc.children(recursive=True):
            try:
                total += c.memory_full_info().uss
            except Exception:  # noqa: BLE001 - a worker that just exited
                pass
        return total

    def sample(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.005)

    def __enter__(self):
        self.start = self.rss()
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def checksums(model) -> list[int]:
    """Per tensor of the model's state, the sum of its bytes (on its device)."""
    import torch
    out = []
    for t in model.state_dict().values():
        if isinstance(t, torch.Tensor) and t.numel():
            out.append(int(t.detach().contiguous().view(torch.uint8).to(torch.int64).sum().item()))
    return out


def drop_cache(folder: Path) -> str:
    for f in folder.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise_dontneed"


def run_mode(r: Run, mode: str, base_step_s: float) -> dict:
    import torch
    from megatron.core import dist_checkpointing
    a = r.a
    ours = mode.startswith("gdsckpt")
    is_async = "async" in mode
    save_kwargs = {}
    if ours:
        from gdsckpt.integrations.megatron import AsyncCallsQueue, save_strategy
        strategy, queue = save_strategy(), AsyncCallsQueue()
        if mode.endswith("megatron-queue"):
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue as MegatronQueue
            queue = MegatronQueue()
    else:
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue as MegatronQueue
        strategy, queue = get_default_save_sharded_strategy(), MegatronQueue()
        if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
            save_kwargs["async_strategy"] = "mcore"  # 0.17+: megatron-core's own worker, as 0.16's
    model, opt, module = r.build()
    step = 0
    for _ in range(2):  # the moments exist; kernels warm
        step += 1
        r.step(model, opt, step)
    reserved_s = None
    if ours and is_async:  # the pool made before the loop, as a run would (GdsckptSaveShardedStrategy.reserve)
        t0 = time.perf_counter()
        strategy.reserve(r.sharded_state(model, opt, module, step), wait=True)
        reserved_s = time.perf_counter() - t0
    saves = []
    with RssPeak() as rss:
        for i in range(a.saves):
            path = a.dir / mode / f"iter_{step:07d}"
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            if r.cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            request = dist_checkpointing.save(r.sharded_state(model, opt, module, step), str(path),
                                              sharded_strategy=strategy, async_sharded_save=is_async, **save_kwargs)
            if is_async:
                queue.schedule_async_request(request)
            blocked = time.perf_counter() - t0
            if i == a.saves - 1:  # what the restore must give back (weights: a checksum of their bytes)
                saved_sums = checksums(module)
            slower = 0.0
            for _ in range(a.train_steps):
                step += 1
                t1 = time.perf_counter()
                if is_async:
                    queue.maybe_finalize_async_calls(blocking=False)
                r.step(model, opt, step)
                slower += max(0.0, time.perf_counter() - t1 - base_step_s)
            saves.append({"step": path.name, "blocked_s": blocked, "idle_s": blocked + slower})
        t0 = time.perf_counter()
        if is_async:
            queue.maybe_finalize_async_calls(blocking=True)
        drain = time.perf_counter() - t0
    last = a.dir / mode / saves[-1]["step"]
    files = [f for f in last.rglob("*") if f.is_file()]
    cache = drop_cache(last)
    del model, opt, module
    if r.cuda:
        torch.cuda.empty_cache()
    model, opt, module = r.build()
    from gdsckpt.integrations.megatron import load_strategy
    if r.cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    loaded = dist_checkpointing.load(r.sharded_state(model, opt, module, 0, loading=True), str(last),
                                     sharded_strategy=load_strategy())  # into the model's own tensors
    if r.cuda:  # as Megatron-LM's load_checkpoint
        module.load_state_dict(loaded["model"], strict=False)
        opt.load_state_dict(loaded["optimizer"])
        torch.cuda.synchronize()
    restore_s = time.perf_counter() - t0
    return {"mode": mode, "reserve_s": reserved_s, "saves": saves, "drain_s": drain, "idle_s_median": sorted(s["idle_s"] for s in saves)[len(saves) // 2],
            "peak_rss_over_start_gb": (rss.peak - rss.start) / 1e9, "rss_start_gb": rss.start / 1e9,
            "restore_s": restore_s, "restore_cache": cache, "restored_iteration": loaded["iteration"],
            "checkpoint_bytes": sum(f.stat().st_size for f in files), "files": len(files),
            "restored_bit_exact": checksums(module) == saved_sums}


def main(argv=None):
    a = args_of(argv)
    import torch
    r = Run(a)
    model, opt, module = r.build()
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # weights + Adam's two moments
    times = [r.step(model, opt, s) for s in range(1, 6)]
    base = sorted(times[1:])[len(times[1:]) // 2]
    del model, opt, module
    if r.cuda:
        torch.cuda.empty_cache()
    modes = [m for m in a.modes.split(",") if m]
    results, skipped = [], {}
    for mode in modes:
        if mode.startswith("torch_dist") and not r.cuda:
            skipped[mode] = "megatron-core's torch_dist save calls torch.cuda.synchronize (GPU only)"
            continue
        if mode.endswith("megatron-queue") and not r.cuda:
            skipped[mode] = "megatron-core's AsyncCallsQueue all-reduces a CUDA tensor (GPU only)"
            continue
        results.append(run_mode(r, mode, base))
        print(json.dumps(results[-1]), flush=True)
    from gdsckpt.engine.backend import gpu_status
    import megatron.core
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "device": torch.cuda.get_device_name(0) if r.cuda else "cpu", "gpu_status": list(gpu_status()),
           "megatron_core": getattr(megatron.core, "__version__", "?"), "torch": torch.__version__,
           "state_bytes": state_bytes, "base_step_s": base, "saves": a.saves, "train_steps": a.train_steps,
           "io": os.environ.get("GDSCKPT_IO", "auto"), "results": results, "skipped": skipped,
           "notes": "restore after posix_fadvise(DONTNEED) of the checkpoint's files; idle_s = blocked_s + the "
                    "slowdown of the next train_steps steps over base_step_s"}
    (a.out / "megatron_train.json").write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "results"}, indent=1))
    import torch.distributed as dist
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
