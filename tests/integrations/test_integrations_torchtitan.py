"""gdsckpt.integrations.torchtitan with the real torchtitan on the CPU (gdsckpt[torchtitan]), in a
1-process gloo group.

torchtitan's own components: an OptimizersContainer (AdamW) and an LRSchedulersContainer (warmup,
linear decay) built from their configs, a ParallelAwareDataloader (torchtitan's
StatefulDataLoader), ModelWrapper and a train state, checkpointed by GdsckptCheckpointManager
built from its config exactly as torchtitan's trainer builds its checkpointer. A small MLP
trains for 12 steps. One child process trains it with checkpointing disabled (the reference),
then once per async_mode ("disabled", "async", "async_with_pinned_mem") with a save every 4
steps until step 10. A second child process builds everything afresh, `load()`s (torchtitan
picks step-8, the newest folder with a `.metadata`) and trains to step 12, saving the last step:
final weights and AdamW moments equal the reference's bit for bit. Also: a run begun with
torchtitan's own CheckpointManager (DCP's FileSystemWriter) resumes from its folder and goes on
with gdsckpt's. The async modes reserve their staging's pool at the first step's save call, and
their saves grow it no further. Run as a script, this file is the child."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from integration_tools import digests, report, run_child  # noqa: E402

STEPS, INTERVAL, STOP_AT = 12, 4, 10
MODES = ("disabled", "async", "async_with_pinned_mem")

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan not installed")


# ---------------------------------------------------------------- the child


class TrainState:
    """What torchtitan's trainer checkpoints as "train_state" (itself): the step."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def build(root: Path, mode: str | None, manager=None, folder: str | None = None):
    import torch
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from gdsckpt.integrations.torchtitan import GdsckptCheckpointManager
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1})],
        implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=STEPS)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    loader = ParallelAwareDataloader(data, dp_rank=0, dp_world_size=1, batch_size=4)
    state = TrainState()
    config = (manager or GdsckptCheckpointManager).Config(enable=mode is not None, folder="checkpoint", interval=INTERVAL,
                                             async_mode=mode or "disabled", keep_latest_k=0,
                                             last_save_model_only=False)
    checkpointer = config.build(dataloader=loader, model_parts=[model], optimizers=optimizers,
                                lr_schedulers=schedulers, states={"train_state": state}, sd_adapter=None,
                                base_folder=str(root / (folder or mode or "reference")))
    return model, optimizers, schedulers, loader, state, checkpointer


def train(model, optimizers, schedulers, loader, state, checkpointer, stop=STEPS):
    """torchtitan's train loop, reduced: a step, then checkpointer.save(step)."""
    import torch
    batches = iter(loader)
    while state.step < stop:
        x, y = next(batches)
        state.step += 1
        optimizers.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizers.step()
        schedulers.step()
        checkpointer.save(state.step, last_step=state.step == STEPS)
        checkpointer.maybe_wait_for_staging()
    checkpointer.maybe_wait_for_saving()
    checkpointer.close()


def final(model, optimizers) -> dict:
    return {"model": digests(model.state_dict()), "optimizer": digests(optimizers.state_dict())}


def _group(root: Path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{root}/pg-{root.name}-{id(root)}", rank=0, world_size=1)


def child_first(root: Path) -> dict:
    from gdsckpt.engine import pinned_pool
    _group(root)
    parts = build(root, None)
    train(*parts)
    out = {"reference": final(parts[0], parts[1]), "folders": {}, "reserved": {}}
    for mode in MODES:
        pinned_pool.release_pools()
        parts = build(root, mode)
        train(*parts, stop=STOP_AT)
        out["folders"][mode] = sorted(p.name for p in (root / mode / "checkpoint").iterdir())
        reservation = parts[5].reservation
        out["reserved"][mode] = reservation and {
            "held": reservation.result().held_bytes,
            "pool": pinned_pool.pools().get("cpu", {}).get("capacity_bytes")}
    return out


def child_resume(root: Path) -> dict:
    _group(root)
    out = {}
    for mode in MODES:
        parts = build(root, mode)
        loaded = parts[5].load()
        restored = parts[4].step
        train(*parts)
        step8 = root / mode / "checkpoint" / "step-8"
        out[mode] = final(parts[0], parts[1]) | {
            "loaded": loaded, "restored_step": restored,
            "step8_files": sorted(p.name for p in step8.iterdir()),
            "folders": sorted(p.name for p in (root / mode / "checkpoint").iterdir())}

    # a run begun with torchtitan's own checkpointer (DCP's FileSystemWriter) goes on with gdsckpt's
    from torchtitan.components.checkpoint import CheckpointManager
    parts = build(root, "disabled", manager=CheckpointManager, folder="migrate")
    train(*parts, stop=INTERVAL)
    parts = build(root, "disabled", folder="migrate")
    parts[5].load()
    restored = parts[4].step
    train(*parts)
    out["migrate"] = final(parts[0], parts[1]) | {"restored_step": restored, "step4_files": sorted(
        p.name for p in (root / "migrate" / "checkpoint" / "step-4").iterdir())}
    return out


# ---------------------------------------------------------------- the tests


def test_train_save_resume_in_a_new_process_is_bit_identical(tmp_path):
    first = run_child(Path(__file__), "first", str(tmp_path))
    for mode in MODES:
        assert first["folders"][mode] == ["step-4", "step-8"], mode
    # the async modes reserved the staging's pool at step 1, and their saves grew it no further
    assert first["reserved"]["disabled"] is None
    for mode in MODES[1:]:
        assert 0 < first["reserved"][mode]["held"] == first["reserved"][mode]["pool"], mode
    resumed = run_child(Path(__file__), "resume", str(tmp_path))
    ref = first["reference"]
    for mode in MODES:
        got = resumed[mode]
        assert got["loaded"] and got["restored_step"] == 8, mode
        assert got["model"] == ref["model"], f"{mode}: final weights differ from the uninterrupted run's"
        assert got["optimizer"] == ref["optimizer"], f"{mode}: final AdamW state differs from the uninterrupted run's"
        # DCP's .metadata and rank 0's gdsckpt files (async: the byte items in a second one)
        files = got["step8_files"]
        assert files[:2] == [".metadata", "__0_0.gdsckpt"] and all(
            re.fullmatch(r"__0_\d+\.gdsckpt", f) for f in files[1:]), (mode, files)
        assert got["folders"] == ["step-12", "step-4", "step-8"], mode

    migrated = resumed["migrate"]  # step-4 by torchtitan's FileSystemWriter, read by DCP's own reader
    assert migrated["restored_step"] == INTERVAL and "__0_0.distcp" in migrated["step4_files"]
    assert migrated["model"] == ref["model"] and migrated["optimizer"] == ref["optimizer"]


if __name__ == "__main__":
    report((child_first if sys.argv[1] == "first" else child_resume)(Path(sys.argv[2])))


def test_a_bad_codec_is_refused_when_the_manager_is_made():
    """Not at the first checkpoint, `interval` steps into the run."""
    from gdsckpt.integrations.torchtitan import GdsckptCheckpointManager
    with pytest.raises(ValueError, match="unknown codec 'lz4'"):
        GdsckptCheckpointManager(GdsckptCheckpointManager.Config(enable=True, codec="lz4"))
