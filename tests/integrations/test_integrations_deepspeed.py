"""gdsckpt.integrations.deepspeed with the real DeepSpeed on the CPU (gdsckpt[deepspeed]).

Training: a small MLP, torch's AdamW with a StepLR schedule and gradient clipping, through
`deepspeed.initialize` with DS_ACCELERATOR=cpu and gloo, each rank on its own batches (RUNS:
ZeRO 2 on two ranks; ZeRO 1 in bf16 with the decoupled commit, ZeRO 0 with synchronous saves
and ZeRO 3 on one; on the GPU, marked `gpu`, bf16 at ZeRO 2 and 1 and fp32 at ZeRO 0 and 3). One
child run (its processes) trains STEPS steps uninterrupted (the reference), then builds
everything afresh, trains SAVE_AT steps, `save_checkpoint`s through `use_gdsckpt` (with a
client_state), trains on (changing every tensor the save holds while its files may still be
in flight) and exits. A second run, new processes, builds everything afresh,
`load_checkpoint`s and trains to STEPS: the final weights, the optimizer's state (ZeRO's fp32
partitions and AdamW moments, or AdamW's own at stage 0; at stage 3 the weights are
partitioned, and the fp32 partitions are what the digests compare), the schedule, the step counters and
every loss after the save must equal the reference's bit for bit, on every rank. Before that,
loading a copy with a truncated file raises a CheckpointFormatError naming it, through DeepSpeed.
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
from integration_tools import PREFIX, REPO, child_pythonpath, digests, gdsckpt_files_only, report  # noqa: E402

STEPS, SAVE_AT = 6, 3
CASES = {  # name: (ZeRO stage, use_gdsckpt options, extra ds_config)
    "zero2-async": (2, {}, {}),
    "zero0-sync": (0, {"async_save": False}, {}),
    "zero3-async": (3, {}, {}),
    "zero2-bf16": (2, {}, {"bf16": {"enabled": True}}),
    "zero1-bf16-decoupled": (1, {"decoupled": True}, {"bf16": {"enabled": True}}),
}
RUNS = {  # name: (world size, device, the cases its processes run one after the other: one import of DeepSpeed)
    "2ranks": (2, "cpu", ("zero2-async",)),
    "1rank": (1, "cpu", ("zero1-bf16-decoupled", "zero0-sync", "zero3-async")),
    "gpu": (1, "cuda", ("zero2-bf16", "zero1-bf16-decoupled", "zero0-sync", "zero3-async")),
}

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")


# ---------------------------------------------------------------- the child (one rank)


def build(case: str, device: str):
    import deepspeed
    import deepspeed.ops
    import torch
    from gdsckpt.integrations.deepspeed import use_gdsckpt
    stage, options, extra = CASES[case]
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no C++ build: gloo does the collectives
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**9, **extra}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=config)
    use_gdsckpt(engine, **options)
    return engine


def train(engine, start: int, stop: int) -> list[str]:
    import torch
    losses = []
    for step in range(start, stop):
        g = torch.Generator().manual_seed(1000 * step + engine.global_rank)
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
        out = engine(x.to(engine.device, next(engine.module.parameters()).dtype))
        loss = torch.nn.functional.mse_loss(out.float(), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item().hex())
    return losses


def final(engine, losses: list[str]) -> dict:
    return {"model": digests(engine.module.state_dict()), "optimizer": digests(engine.optimizer.state_dict()),
            "scheduler": repr(engine.lr_scheduler.state_dict()), "global_steps": engine.global_steps,
            "global_samples": engine.global_samples, "losses": losses}


def child(mode: str, root: Path, run: str) -> dict:
    _, device, cases = RUNS[run]
    return {case: one_case(mode, root / case, case, device) for case in cases}


def one_case(mode: str, root: Path, case: str, device: str) -> dict:
    if mode == "first":
        engine = build(case, device)
        reference = final(engine, train(engine, 0, STEPS)[SAVE_AT:])
        engine = build(case, device)
        train(engine, 0, SAVE_AT)
        engine.save_checkpoint(str(root), client_state={"epoch": 1, "note": "mid-run"})
        train(engine, SAVE_AT, STEPS)  # the weights and moments change while the files may still be written
        engine.checkpoint_engine.wait()
        return {"reference": reference}
    engine = build(case, device)
    damaged = damaged_error(engine, root)
    path, client = engine.load_checkpoint(str(root))
    restored = {"path": path, "client": {k: client[k] for k in ("epoch", "note")}, "steps": engine.global_steps}
    return final(engine, train(engine, SAVE_AT, STEPS)) | {"restored": restored, "damaged": damaged}


def damaged_error(engine, root: Path) -> list[str]:
    """load_checkpoint of a copy of the checkpoint whose optimizer (or, at stage 0, model) file
    lost its last 100 bytes: the error's type and message."""
    import shutil
    import torch
    copy = root.parent / f"{root.name}-damaged-{engine.global_rank}"
    shutil.copytree(root, copy)
    torch.distributed.barrier()
    files = sorted((copy / f"global_step{SAVE_AT}").glob("*rank_0_mp_rank_00_optim_states.pt"))
    file = files[0] if files else copy / f"global_step{SAVE_AT}" / "mp_rank_00_model_states.pt"
    os.truncate(file, file.stat().st_size - 100)
    try:
        engine.load_checkpoint(str(copy))
    except Exception as e:  # noqa: BLE001 - reported to the test, which checks its type
        return [type(e).__name__, str(e), str(file)]
    return ["nothing raised", "", str(file)]


# ---------------------------------------------------------------- the tests


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(mode: str, root: Path, run: str, timeout: float = 180) -> list[dict]:
    """Run the child as the run's processes of one process group; each rank's RESULT, by rank."""
    import json
    world, device, _ = RUNS[run]
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "DS_ACCELERATOR": device, "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
        procs.append(subprocess.Popen([sys.executable, __file__, mode, str(root), run], env=env, cwd=REPO,
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
        assert proc.returncode == 0 and lines, (f"rank {rank} of {mode} ({run}) exited {proc.returncode}\n"
                                                f"--- stdout\n{out[-4000:]}\n--- stderr\n{err[-8000:]}")
        results.append(json.loads(lines[-1][len(PREFIX):]))
    return results


@pytest.mark.parametrize("run", ["2ranks", "1rank"])
def test_train_save_resume_in_new_processes_is_bit_identical(tmp_path, run):
    check_resume(tmp_path, run)


@pytest.mark.gpu
def test_on_the_gpu_bf16_train_save_resume_is_bit_identical(tmp_path):
    """DeepSpeed on CUDA (bf16 at ZeRO 2 and 1, fp32 at ZeRO 0 and 3): the tensors are saved from the GPU."""
    check_resume(tmp_path, "gpu")


def check_resume(tmp_path: Path, run: str) -> None:
    world, _, cases = RUNS[run]
    first = run_ranks("first", tmp_path, run)
    resumed = run_ranks("resume", tmp_path, run)
    for case in cases:
        root, stage, _, extra = tmp_path / case, *CASES[case]
        prefix = "bf16_" if "bf16" in extra else ""
        model_files = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)] if stage == 3 else \
            ["mp_rank_00_model_states.pt"]
        optim_files = [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)] if stage else []
        for rank in range(world):
            ref, got = first[rank][case]["reference"], resumed[rank][case]
            assert got["restored"] == {"path": str(root / f"global_step{SAVE_AT}" / model_files[0]),
                                       "client": {"epoch": 1, "note": "mid-run"}, "steps": SAVE_AT}, (case, rank)
            for what in ("model", "optimizer", "scheduler", "global_steps", "global_samples", "losses"):
                assert got[what] == ref[what], f"{case}, rank {rank}: {what} differs from the uninterrupted run's"
            assert got["model"] and got["optimizer"]
        error, message, file = resumed[0][case]["damaged"]
        assert error in ("CheckpointFormatError", "ChecksumError") and file in message, (case, error, message)
        assert (root / "latest").read_text() == f"global_step{SAVE_AT}"
        files = sorted(p.name for p in (root / f"global_step{SAVE_AT}").iterdir())
        assert files == sorted(model_files + optim_files), case
        assert gdsckpt_files_only(root, allowed_other=("latest", "zero_to_torch.py", "zero_to_fp32.py")) == []  # no pickle


# ---------------------------------------------------------------- the engine alone, in this process


@pytest.fixture
def engine_module():
    import gdsckpt.integrations.deepspeed as module
    return module


def test_deepspeed_objects_round_trip_as_plain_values(tmp_path, engine_module):
    """The objects DeepSpeed puts in its dicts come back as themselves, from a file with no pickle."""
    import torch
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    import gdsckpt
    scaler = DynamicLossScaler(init_scale=2.0**16, scale_window=500, min_scale=1.0,
                               delayed_shift=2, consecutive_hysteresis=False, raise_error_at_min_scale=True,
                               dtype=torch.float16)
    scaler.cur_iter = 7
    weights = torch.arange(6.0)
    state = {"param_shapes": [{"w": torch.Size([2, 3])}], "zero_stage": ZeroStageEnum.gradients,
             "loss_scaler": scaler, "static": LossScaler(4.0), "w": weights,
             "param_slice_mappings": [{"w": fragment_address(numel=6, start=0)}], "dtype": torch.bfloat16}
    engine = engine_module.GdsckptCheckpointEngine(async_save=False)
    engine.save(state, str(tmp_path / "f.pt"))
    assert state["w"] is weights and type(state["param_shapes"][0]["w"]) is torch.Size  # the caller's dict as it was
    with open(tmp_path / "f.pt", "rb") as f:
        assert f.read(8) == b"GDSCKPT\x00"
    got = engine.load(str(tmp_path / "f.pt"), map_location=lambda storage, loc: storage)
    assert type(got["param_shapes"][0]["w"]) is torch.Size and got["param_shapes"][0]["w"] == (2, 3)
    assert got["zero_stage"] is ZeroStageEnum.gradients and got["dtype"] is torch.bfloat16
    assert got["param_slice_mappings"] == [{"w": fragment_address(numel=6, start=0)}]
    assert type(got["loss_scaler"]) is DynamicLossScaler and vars(got["loss_scaler"]) == vars(scaler)
    assert type(got["static"]) is LossScaler and got["static"].loss_scale == 4.0
    assert torch.equal(got["w"], weights)
    assert gdsckpt.load(tmp_path / "f.pt")["zero_stage"] == {engine_module.OBJECT_TAG: "ZeroStageEnum", "value": 2}


def test_an_object_gdsckpt_cannot_store_is_refused_naming_its_key(tmp_path, engine_module):
    import gdsckpt
    import torch
    engine = engine_module.GdsckptCheckpointEngine()
    path = tmp_path / "mp_rank_00_model_states.pt"
    with pytest.raises(gdsckpt.UnsupportedStateError, match="'args'") as e:
        engine.save({"module": {"w": torch.ones(2)}, "args": object()}, str(path))
    assert "client_state" in "\n".join(e.value.__notes__)
    engine.commit(None)
    assert not path.exists()  # nothing written
    with pytest.raises(gdsckpt.UnsupportedStateError, match="reserved"):
        engine.save({"x": {engine_module.OBJECT_TAG: 1}}, str(path))


def test_files_it_did_not_write_are_typed_errors_naming_them(tmp_path, engine_module):
    import gdsckpt
    import torch
    engine = engine_module.GdsckptCheckpointEngine(async_save=False)
    torch.save({"w": torch.ones(2)}, tmp_path / "torch.pt")
    with pytest.raises(gdsckpt.CheckpointFormatError, match="torch.pt") as e:
        engine.load(str(tmp_path / "torch.pt"))
    assert "written by torch.save" in "\n".join(e.value.__notes__)
    gdsckpt.save({"x": {engine_module.OBJECT_TAG: "os.system", "value": "true"}}, tmp_path / "hostile.pt")
    with pytest.raises(gdsckpt.CheckpointFormatError, match="unknown type 'os.system'.*hostile.pt"):
        engine.load(str(tmp_path / "hostile.pt"))
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        engine.load(str(tmp_path / "missing.pt"))
    with pytest.raises(TypeError, match="map_location"):
        engine.load(str(tmp_path / "hostile.pt"), map_location=lambda storage, loc: storage.cuda())


if __name__ == "__main__":
    report(child(sys.argv[1], Path(sys.argv[2]), sys.argv[3]))
