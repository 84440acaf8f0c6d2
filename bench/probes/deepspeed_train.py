"""DeepSpeed's checkpoints through gdsckpt's CheckpointEngine against DeepSpeed's own, in one run:
GPU idle per checkpoint, peak host memory, restore time (issue 48 part 5).

    python bench/probes/deepspeed_train.py --out DIR                                  # one GPU, ~4.5 GB of state
    python bench/probes/deepspeed_train.py --out DIR --device cpu --size-gb 0.05      # the CPU, end to end

A GPT (token embedding, pre-norm transformer blocks, tied head) sized so that its training state
(bf16 weights + ZeRO-1's fp32 master copy + AdamW's two moments: 14 bytes a parameter; fp32 on
the CPU: 12) is about --size-gb, trained by `deepspeed.initialize` (ZeRO stage 1, torch AdamW),
world size 1. For each engine of --engines, in a process of its own (its peak RSS is its own):
* save: warm-up steps, the step time without checkpoints (median of 2 x --train-steps steps),
  then --saves checkpoints with `engine.save_checkpoint`, --train-steps steps after each. Per
  checkpoint: blocked_s (the save_checkpoint call, CUDA synchronized), after_s (how much longer
  the steps after it took than steps without a save: a decoupled commit waits in the next step),
  idle_s = blocked_s + max(after_s, 0); the host RSS above the process's RSS before the first
  save, sampled every 5 ms (peak_rss_above_base_bytes), and VmHWM; a digest of every weight
  the last checkpoint holds, and its bytes on disk.
* restore: a new process, the model built with another seed, `load_checkpoint` of the last tag
  timed to the weights on the device, its digests compared with the save's (bit-exact). "cold":
  the checkpoint's files evicted from the page cache first (os.sync + posix_fadvise DONTNEED on
  each: no root needed; a page still cached by another mapping stays), else "warm".
Engines: torch (DeepSpeed's default TorchCheckpointEngine, torch.save, not fsync'd: its files may
be in the page cache only when it returns), gdsckpt (use_gdsckpt(engine): save_async per file,
the commit before `latest` waits until every file is durable), gdsckpt-decoupled (the commit at
the next step), fastpersist (DeepSpeed's FastPersist writer, "checkpoint": {"writer": {"type":
"fast"}}: needs DeepSpeed's async_io op; a wheel built with DS_BUILD_OPS=0 JIT-compiles it with
libaio-dev and a compiler, minutes, so it runs only where the op is prebuilt or --engines names
it; otherwise it is reported as skipped, with why).
Writes DIR/summary.json (device, date, DeepSpeed's and torch's versions, I/O paths) and
DIR/<phase>-<engine>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ENGINES = ("torch", "gdsckpt", "gdsckpt-decoupled", "fastpersist")
DEFAULT_ENGINES = ("torch", "gdsckpt", "gdsckpt-decoupled")


def args_of(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--phase", choices=("run", "save", "restore"), default="run")
    p.add_argument("--engine", choices=ENGINES, default=None, help="save / restore: the engine")
    p.add_argument("--engines", default=None, help=f"run: comma-separated, of {','.join(ENGINES)} "
                                                  f"(default {','.join(DEFAULT_ENGINES)}, and fastpersist where its op is prebuilt)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--size-gb", type=float, default=4.5, help="training state, GB (1e9 bytes)")
    p.add_argument("--saves", type=int, default=2)
    p.add_argument("--train-steps", type=int, default=3, help="steps after each checkpoint")
    p.add_argument("--dir", type=Path, default=None, help="checkpoint directory (default OUT/ck); one folder an engine")
    p.add_argument("--warm", action="store_true", help="restore without evicting the files from the page cache")
    a = p.parse_args(argv)
    a.dir = a.dir or a.out / "ck"
    return a


# ------------------------------------------------------------------ the model
def gpt(size_gb: float, device: str, seed: int):
    import torch
    bytes_per_param = 14 if device == "cuda" else 12
    params = size_gb * 1e9 / bytes_per_param
    d, vocab = (2048, 32000) if params > 2e8 else (256, 4096)
    layers = max(1, round((params - vocab * d) / (12 * d * d)))
    torch.manual_seed(seed)

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, d)
            self.blocks = torch.nn.ModuleList(
                torch.nn.TransformerEncoderLayer(d, d // 128 if d >= 1024 else 4, 4 * d, dropout=0.0,
                                                 batch_first=True, norm_first=True) for _ in range(layers))
            self.norm = torch.nn.LayerNorm(d)

        def forward(self, tokens):
            x = self.embed(tokens)
            mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=x.device, dtype=x.dtype)
            for block in self.blocks:
                x = block(x, src_mask=mask, is_causal=True)
            return self.norm(x) @ self.embed.weight.t()  # tied head

    return GPT().to(device), vocab


def build(a, engine_name: str, seed: int):
    import deepspeed
    import deepspeed.ops
    import torch
    if a.device == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no C++ build: gloo does it
    model, vocab = gpt(a.size_gb, a.device, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    config = {"train_micro_batch_size_per_gpu": 4 if a.device == "cuda" else 2, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}, "steps_per_print": 10**9,
              "bf16": {"enabled": a.device == "cuda"}}
    if engine_name == "fastpersist":
        # "data_parallel" named: without it 0.19.8 fails (UniversalParallelInfo has no dp_rank) with no mpu
        config["checkpoint"] = {"writer": {"type": "fast", "decoupled": False, "data_parallel": "replica"}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    if engine_name.startswith("gdsckpt"):
        from gdsckpt.integrations.deepspeed import use_gdsckpt
        use_gdsckpt(engine, decoupled=engine_name == "gdsckpt-decoupled")
    return engine, vocab


def step(engine, vocab: int, i: int, sync) -> float:
    import torch
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(i)
    seq = 512 if engine.device.type == "cuda" else 32
    tokens = torch.randint(0, vocab, (engine.train_micro_batch_size_per_gpu(), seq + 1), generator=g).to(engine.device)
    logits = engine(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()
    sync()
    return time.perf_counter() - t0


def digests(engine) -> dict:
    import hashlib
    out = {}
    for name, t in engine.module.state_dict().items():
        t = t.detach().cpu().contiguous()
        out[name] = hashlib.sha256(t.reshape(-1).view(__import__("torch").uint8).numpy().tobytes()).hexdigest()[:16]
    return out


# ------------------------------------------------------------------ host memory
class RSSSampler:
    """The process's RSS every 5 ms on a thread; peak() since the last reset()."""

    def __init__(self):
        self._peak = 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        threading.Thread(target=self._run, daemon=True).start()

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self):
        while not self._stop.wait(0.005):
            self._peak = max(self._peak, self.rss())

    def reset(self):
        self._peak = self.rss()

    def peak(self) -> int:
        return max(self._peak, self.rss())


def vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


# ------------------------------------------------------------------ phases
def phase_save(a) -> dict:
    import torch
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    root = a.dir / a.engine
    shutil.rmtree(root, ignore_errors=True)
    engine, vocab = build(a, a.engine, seed=0)
    sampler = RSSSampler()
    i = 0
    for _ in range(3):  # warm-up
        step(engine, vocab, i, sync); i += 1
    plain = []
    for _ in range(2 * a.train_steps):
        plain.append(step(engine, vocab, i, sync)); i += 1
    step_s = statistics.median(plain)
    base_rss = sampler.rss()
    sampler.reset()
    checkpoints = []
    for k in range(a.saves):
        if k == a.saves - 1:
            saved_digests = digests(engine)  # the weights the last checkpoint holds
        sync()
        t0 = time.perf_counter()
        engine.save_checkpoint(str(root), tag=f"step{i}")
        sync()
        blocked = time.perf_counter() - t0
        after = [step(engine, vocab, i + j, sync) for j in range(a.train_steps)]
        i += a.train_steps
        extra = sum(after) - a.train_steps * step_s
        rec = {"tag": f"step{i - a.train_steps}", "blocked_s": blocked, "after_s": extra,
               "idle_s": blocked + max(extra, 0.0), "steps_after_s": after}
        stats = getattr(engine.checkpoint_engine, "last_stats", None)
        if stats:
            rec["gdsckpt"] = [{"path": Path(s.path).name, "io_path": s.io_path, "ratio": round(s.ratio, 4),
                               "blocked_s": getattr(s, "blocked_s", None), "seconds": s.seconds} for s in stats]
        checkpoints.append(rec)
    t0 = time.perf_counter()
    wait = getattr(engine.checkpoint_engine, "wait", None)
    if wait is not None:
        wait()  # the last checkpoint committed (gdsckpt-decoupled: its `latest` written)
    drain = time.perf_counter() - t0
    last = checkpoints[-1]["tag"]
    files = sorted((root / last).iterdir())
    return {"engine": a.engine, "checkpoint_engine": type(engine.checkpoint_engine).__name__,
            "parameters": sum(p.numel() for p in engine.module.parameters()), "step_s": step_s,
            "checkpoints": checkpoints, "idle_s_mean": statistics.mean(c["idle_s"] for c in checkpoints),
            "drain_s": drain, "base_rss_bytes": base_rss, "peak_rss_above_base_bytes": sampler.peak() - base_rss,
            "vm_hwm_bytes": vm_hwm(), "last_tag": last, "files": {f.name: f.stat().st_size for f in files},
            "checkpoint_bytes": sum(f.stat().st_size for f in files), "durable_on_return": a.engine != "torch",
            "digests": saved_digests}


def evict(folder: Path) -> bool:
    os.sync()
    ok = True
    for f in folder.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                ok = False
            finally:
                os.close(fd)
    return ok


def phase_restore(a) -> dict:
    import torch
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    saved = json.loads((a.out / f"save-{a.engine}.json").read_text())
    root = a.dir / a.engine
    engine, _ = build(a, a.engine, seed=1)
    cache = "warm" if a.warm else ("cold" if evict(root / saved["last_tag"]) else "warm (fadvise failed)")
    sampler = RSSSampler()
    base_rss = sampler.rss()
    sampler.reset()
    sync()
    t0 = time.perf_counter()
    path, _ = engine.load_checkpoint(str(root), tag=saved["last_tag"])
    sync()
    seconds = time.perf_counter() - t0
    got = digests(engine)
    return {"engine": a.engine, "restore_s": seconds, "page_cache": cache, "loaded": path,
            "bit_exact": got == saved["digests"], "peak_rss_above_base_bytes": sampler.peak() - base_rss,
            "vm_hwm_bytes": vm_hwm(), "gb_per_s": saved["checkpoint_bytes"] / seconds / 1e9}


def fastpersist_ready() -> str | None:
    """None where DeepSpeed's async_io op is prebuilt, else why FastPersist is not run by default."""
    try:
        from deepspeed.git_version_info import installed_ops
        if installed_ops.get("async_io"):
            return None
    except Exception as e:  # noqa: BLE001 - reported as the reason
        return f"{type(e).__name__}: {e}"
    return ("DeepSpeed's async_io op is not prebuilt (a DS_BUILD_OPS=0 install JIT-compiles it at the first "
            "FastPersist save: libaio-dev and a C++ compiler, minutes); pass --engines ...,fastpersist to try")


def run(a) -> dict:
    import torch
    a.out.mkdir(parents=True, exist_ok=True)
    skipped = {}
    if a.engines:
        engines = a.engines.split(",")
    else:
        engines = list(DEFAULT_ENGINES)
        why = fastpersist_ready()
        if why is None:
            engines.append("fastpersist")
        else:
            skipped["fastpersist"] = why
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29400 + os.getpid() % 1000),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "CROSS_RANK": "0", "CROSS_SIZE": "1",  # set by the deepspeed launcher; FastPersist reads them
           "DS_ACCELERATOR": a.device, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                                      os.environ.get("PYTHONPATH")]))}
    results = {}
    for name in engines:
        for phase in ("save", "restore"):
            cmd = [sys.executable, __file__, "--phase", phase, "--engine", name, "--out", str(a.out),
                   "--dir", str(a.dir), "--device", a.device, "--size-gb", str(a.size_gb),
                   "--saves", str(a.saves), "--train-steps", str(a.train_steps)] + (["--warm"] if a.warm else [])
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                results.setdefault(name, {})[phase] = {"error": proc.stderr[-3000:]}
                print(f"{name} {phase}: exited {proc.returncode}\n{proc.stderr[-3000:]}", file=sys.stderr)
                break
            results.setdefault(name, {})[phase] = json.loads((a.out / f"{phase}-{name}.json").read_text())
        shutil.rmtree(a.dir / name, ignore_errors=True)
    import deepspeed
    summary = {"probe": "deepspeed_train", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
               "deepspeed": deepspeed.__version__, "torch": torch.__version__, "size_gb": a.size_gb,
               "saves": a.saves, "train_steps": a.train_steps, "checkpoint_dir": str(a.dir), "skipped": skipped,
               "table": {n: _row(r) for n, r in results.items()}, "results": results}
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _row(r: dict) -> dict:
    save, restore = r.get("save", {}), r.get("restore", {})
    io = sorted({s["io_path"] for c in save.get("checkpoints", []) for s in c.get("gdsckpt", [])})
    return {"idle_s_per_checkpoint": save.get("idle_s_mean"), "peak_rss_above_base_gb":
            save.get("peak_rss_above_base_bytes", 0) / 1e9, "checkpoint_gb": save.get("checkpoint_bytes", 0) / 1e9,
            "restore_s": restore.get("restore_s"), "restore_cache": restore.get("page_cache"),
            "bit_exact": restore.get("bit_exact"), "io_path": io or None,
            "error": save.get("error") or restore.get("error")}


def main(argv=None):
    a = args_of(argv)
    if a.phase == "run":
        summary = run(a)
        print(json.dumps(summary["table"], indent=1))
        return
    result = (phase_save if a.phase == "save" else phase_restore)(a)
    (a.out / f"{a.phase}-{a.engine}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
