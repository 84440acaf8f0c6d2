"""gdsckpt.integrations.deepspeed with the real DeepSpeed on the CPU (gdsckpt[deepspeed]).

Training: a small MLP, torch's AdamW with a StepLR schedule and gradient clipping, through
`deepspeed.initialize` with DS_ACCELERATOR=cpu and gloo, each rank on its own batches. One
child run (WORLD processes) trains STEPS steps uninterrupted (the reference), then builds
everything afresh, trains SAVE_AT steps, `save_checkpoint`s through `use_gdsckpt` (with a
client_state) and exits. A second run, new processes, builds everything afresh,
`load_checkpoint`s and trains to STEPS: the final weights, the optimizer's state (ZeRO's fp32
partitions and AdamW moments, or AdamW's own at stage 0), the schedule, the step counters and
every loss after the save must equal the reference's bit for bit, on every rank.
Run as a script, this file is the child (one rank).

DeepSpeed's CPU accelerator builds its shared-memory collectives (a C++ extension) on first
use, about 140 s on two cores; the child marks that op incompatible (gloo does the collectives)
so that the test needs no compiler and runs in seconds.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from integration_tools import REPO, PREFIX, digests, gdsckpt_files_only, report  # noqa: E402

STEPS, SAVE_AT = 6, 3
CASES = {  # name: (ZeRO stage, use_gdsckpt options)
    "zero2-async": (2, {}),
    "zero1-decoupled": (1, {"decoupled": True}),
    "zero0-sync": (0, {"async_save": False}),
}
RUNS = {  # world size: the cases its processes run one after the other (one import of DeepSpeed)
    2: ("zero2-async",),
    1: ("zero1-decoupled", "zero0-sync"),
}

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")


# ---------------------------------------------------------------- the child (one rank)


def build(stage: int, options: dict):
    import deepspeed
    import deepspeed.ops
    import torch
    from gdsckpt.integrations.deepspeed import use_gdsckpt
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no C++ build: gloo does the collectives
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=config)
    use_gdsckpt(engine, **options)
    return engine


def train(engine, start: int, stop: int) -> list[str]:
    import torch
    losses = []
    for step in range(start, stop):
        g = torch.Generator().manual_seed(1000 * step + engine.global_rank)
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item().hex())
    return losses


def final(engine, losses: list[str]) -> dict:
    return {"model": digests(engine.module.state_dict()), "optimizer": digests(engine.optimizer.state_dict()),
            "scheduler": repr(engine.lr_scheduler.state_dict()), "global_steps": engine.global_steps,
            "global_samples": engine.global_samples, "losses": losses}


def child(mode: str, root: Path, world: int) -> dict:
    return {case: one_case(mode, root / case, case) for case in RUNS[world]}


def one_case(mode: str, root: Path, case: str) -> dict:
    stage, options = CASES[case]
    if mode == "first":
        engine = build(stage, options)
        reference = final(engine, train(engine, 0, STEPS)[SAVE_AT:])
        engine = build(stage, options)
        train(engine, 0, SAVE_AT)
        engine.save_checkpoint(str(root), client_state={"epoch": 1, "note": "mid-run"})
        engine.checkpoint_engine.wait()  # a decoupled save's commit (and `latest`) is otherwise at the next step
        return {"reference": reference}
    engine = build(stage, options)
    path, client = engine.load_checkpoint(str(root))
    restored = {"path": path, "client": {k: client[k] for k in ("epoch", "note")}, "steps": engine.global_steps}
    return final(engine, train(engine, SAVE_AT, STEPS)) | {"restored": restored}


# ---------------------------------------------------------------- the tests


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(mode: str, root: Path, world: int, timeout: float = 180) -> list[dict]:
    """Run the child as `world` processes of one gloo group; each rank's RESULT, by rank."""
    import json
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
        procs.append(subprocess.Popen([sys.executable, __file__, mode, str(root), str(world)], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        lines = [l for l in out.splitlines() if l.startswith(PREFIX)]
        assert proc.returncode == 0 and lines, (f"rank {rank} of {mode} (world {world}) exited {proc.returncode}\n"
                                                f"--- stdout\n{out[-4000:]}\n--- stderr\n{err[-8000:]}")
        results.append(json.loads(lines[-1][len(PREFIX):]))
    return results


@pytest.mark.parametrize("world", list(RUNS))
def test_train_save_resume_in_new_processes_is_bit_identical(tmp_path, world):
    first = run_ranks("first", tmp_path, world)
    resumed = run_ranks("resume", tmp_path, world)
    for case in RUNS[world]:
        root = tmp_path / case
        for rank in range(world):
            ref, got = first[rank][case]["reference"], resumed[rank][case]
            assert got["restored"] == {"path": str(root / f"global_step{SAVE_AT}" / "mp_rank_00_model_states.pt"),
                                       "client": {"epoch": 1, "note": "mid-run"}, "steps": SAVE_AT}, (case, rank)
            for what in ("model", "optimizer", "scheduler", "global_steps", "global_samples", "losses"):
                assert got[what] == ref[what], f"{case}, rank {rank}: {what} differs from the uninterrupted run's"
            assert got["model"] and got["optimizer"]
        assert (root / "latest").read_text() == f"global_step{SAVE_AT}"
        files = sorted(p.name for p in (root / f"global_step{SAVE_AT}").iterdir())
        assert files == ["mp_rank_00_model_states.pt"] + [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
                                                          for r in range(world) if CASES[case][0]], case
        assert gdsckpt_files_only(root, allowed_other=("latest", "zero_to_torch.py", "zero_to_fp32.py")) == []  # no pickle


if __name__ == "__main__":
    report(child(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])))
