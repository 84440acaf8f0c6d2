"""gdsckpt.integrations.accelerate with the real Accelerate on the CPU (gdsckpt[accelerate]).

Training: a small MLP with dropout, AdamW and a LinearLR schedule, gradient accumulation over 3
batches, a shuffled loader of 10 batches per epoch, a registered object (a counter with a
tensor), NumPy and Python random numbers in the loss, for 3 epochs. One child process runs it
uninterrupted (the reference), then again until a save point, saves with `save_state` and stops.
A second child process builds everything afresh, `load_state`s and trains to the end: the final
weights, AdamW moments, scheduler, counter and `accelerator.step` must equal the reference's
bit for bit. Two ways of resuming:
- "stateful": `use_stateful_dataloader=True` with `use_seedable_sampler=True`, saved mid-epoch
  (epoch 1, after 3 batches): the loader resumes where it was by itself, in the order of the
  epoch it was in (the loader's epoch counter is restored too; Accelerate's own load_state
  leaves it at 0, and its resumed run then trains on epoch 0's order, checked by hand).
- "seedable": `use_seedable_sampler=True`, saved mid-epoch (epoch 1, after 6 batches): the loop
  calls set_epoch and skips the batches already seen (`accelerator.skip_first_batches`), as
  Accelerate's examples do.
Both saves fall where the gradient accumulation has just stepped (gradients are not state).
Run as a script, this file is the child."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from integration_tools import digests, gdsckpt_files_only, report, run_child  # noqa: E402

EPOCHS = 3
ACCUMULATE = 3
SAVE_AT = {"stateful": (1, 3), "seedable": (1, 6)}  # (epoch, batches of it done) when the save is taken

pytestmark = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate not installed")


# ---------------------------------------------------------------- the child


class Counter:
    """A registered object: how many batches it has seen and a running mean of the targets."""

    def __init__(self):
        import torch
        self.seen, self.mean = 0, torch.zeros(1)

    def update(self, y):
        self.seen += 1
        self.mean += (y.mean() - self.mean) / self.seen

    def state_dict(self):
        return {"seen": self.seen, "mean": self.mean}

    def load_state_dict(self, state):
        self.seen, self.mean = state["seen"], state["mean"]


def build(variant: str, project_dir: Path | None = None, **project):
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
    set_seed(0)
    config = DataLoaderConfiguration(use_stateful_dataloader=variant == "stateful",
                                     use_seedable_sampler=variant in ("seedable", "stateful"))
    acc = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE, dataloader_config=config,
                      project_config=ProjectConfiguration(project_dir=str(project_dir), **project)
                      if project_dir else None)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=12)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(40, 8, generator=g), torch.randn(40, 1, generator=g))
    # The loader's own generator: else each new iterator draws its base seed from torch's global
    # generator, and the resumed run, which starts one more iterator, would see other dropout masks.
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return acc, model, opt, loader, sched, counter


def train(variant: str, acc, model, opt, loader, sched, counter, start=(0, 0), stop=None):
    """Epochs from start = (epoch, batches of it already done); returns at stop = (epoch, batch)."""
    import random

    import numpy as np
    import torch
    for epoch in range(start[0], EPOCHS):
        skip = start[1] if epoch == start[0] else 0
        if variant == "stateful":
            batches = loader  # resumes mid-epoch by itself
        else:
            loader.set_epoch(epoch)
            batches = acc.skip_first_batches(loader, skip) if skip else loader
        for i, (x, y) in enumerate(batches, start=skip):
            with acc.accumulate(model):
                noise = float(np.random.normal()) * 1e-3 + random.random() * 1e-3
                loss = torch.nn.functional.mse_loss(model(x), y) + noise
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            counter.update(y)
            if stop == (epoch, i + 1) or stop == (epoch + 1, 0) and i == len(loader) - 1:
                return


def final(acc, model, opt, sched, counter) -> dict:
    return {"model": digests(model.state_dict()), "optimizer": digests(opt.state_dict()["state"]),
            "scheduler": repr(sched.state_dict()), "counter": [counter.seen, digests(counter.mean)],
            "step": acc.step}


def child_first(root: Path) -> dict:
    from gdsckpt.integrations.accelerate import save_state
    out = {}
    for variant in SAVE_AT:
        objs = build(variant)
        train(variant, *objs)
        out[variant] = {"reference": final(objs[0], objs[1], objs[2], objs[4], objs[5])}
        objs = build(variant)
        train(variant, *objs, stop=SAVE_AT[variant])
        out[variant]["saved_step"] = objs[0].step
        out[variant]["saved_to"] = str(save_state(objs[0], root / variant))
    return out


def child_resume(root: Path) -> dict:
    from gdsckpt.integrations.accelerate import load_state
    out = {}
    for variant in SAVE_AT:
        objs = build(variant)
        load_state(objs[0], root / variant)
        restored_step = objs[0].step
        train(variant, *objs, start=SAVE_AT[variant])
        out[variant] = final(objs[0], objs[1], objs[2], objs[4], objs[5]) | {"restored_step": restored_step}
    return out


# ---------------------------------------------------------------- the tests


def test_train_save_resume_in_a_new_process_is_bit_identical(tmp_path):
    first = run_child(Path(__file__), "first", str(tmp_path))
    resumed = run_child(Path(__file__), "resume", str(tmp_path))
    for variant in SAVE_AT:
        ref, got = first[variant]["reference"], resumed[variant]
        assert got["restored_step"] == first[variant]["saved_step"] > 0, variant
        for what in ("model", "optimizer", "scheduler", "counter", "step"):
            assert got[what] == ref[what], f"{variant}: {what} differs from the uninterrupted run's"
        folder = Path(first[variant]["saved_to"])
        assert sorted(p.name for p in folder.iterdir()) == ["accelerator_state.gdsckpt", "process_0.gdsckpt"]
        assert gdsckpt_files_only(folder) == []  # no pickle, no torch.save, no safetensors file


def test_loader_position_without_a_stateful_loader(tmp_path):
    """The epoch counter, the seedable sampler's epoch and the RandomSampler's generator come back."""
    import torch
    from accelerate.data_loader import get_sampler
    from gdsckpt.integrations.accelerate import load_state, save_state
    acc, model, opt, loader, sched, counter = build("default")
    for _ in range(2):
        for _ in loader:
            pass
    sampler = get_sampler(loader)
    assert loader.iteration == 2 and sampler.generator is not None
    saved_generator = sampler.generator.get_state()
    save_state(acc, tmp_path / "a")
    acc, model, opt, loader, sched, counter = build("default")
    assert loader.iteration == 0 and not torch.equal(get_sampler(loader).generator.get_state(), saved_generator)
    load_state(acc, tmp_path / "a")
    assert loader.iteration == 2
    assert torch.equal(get_sampler(loader).generator.get_state(), saved_generator)

    acc, model, opt, loader, sched, counter = build("seedable")
    for _ in loader:
        pass
    save_state(acc, tmp_path / "b")
    acc, model, opt, loader, sched, counter = build("seedable")
    load_state(acc, tmp_path / "b")
    sampler = get_sampler(loader)
    assert loader.iteration == 1 and sampler.epoch == 1 and sampler.initial_seed == 0


def test_hooks_run_as_accelerate_runs_them(tmp_path):
    """A save hook that removes a model from the list saves it itself; the load hook likewise."""
    import gdsckpt
    import torch
    from gdsckpt.integrations.accelerate import load_state, save_state
    acc, model, opt, loader, sched, counter = build("default")
    calls = []

    def save_hook(models, weights, output_dir):
        calls.append(("save", len(models), output_dir))
        gdsckpt.save({"mine": weights.pop(0)}, Path(output_dir) / "model_by_hook.gdsckpt")

    def load_hook(models, input_dir):
        calls.append(("load", len(models), input_dir))
        gdsckpt.load_into(Path(input_dir) / "model_by_hook.gdsckpt", {"mine": models.pop(0)})

    acc.register_save_state_pre_hook(save_hook)
    acc.register_load_state_pre_hook(load_hook)
    with torch.no_grad():
        model[0].weight.fill_(0.5)
    save_state(acc, tmp_path / "c")
    assert len(gdsckpt.load(tmp_path / "c" / "accelerator_state.gdsckpt")["models"]) == 0
    with torch.no_grad():
        model[0].weight.zero_()
    load_state(acc, tmp_path / "c")
    assert bool((model[0].weight == 0.5).all())
    assert calls == [("save", 1, str(tmp_path / "c")), ("load", 1, str(tmp_path / "c"))]


def test_automatic_checkpoint_naming_and_total_limit(tmp_path):
    """checkpoint_0, checkpoint_1, ... under project_dir/checkpoints; with total_limit=2 the oldest
    go, but only once the new folder is saved; load_state() with no folder takes the newest."""
    from gdsckpt.integrations.accelerate import load_state, save_state
    acc, model, opt, loader, sched, counter = build("default", tmp_path, automatic_checkpoint_naming=True,
                                                    total_limit=2)
    for i in range(3):
        counter.seen = i
        assert save_state(acc) == tmp_path / "checkpoints" / f"checkpoint_{i}"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2"]
    counter.seen = 99
    assert load_state(acc) == tmp_path / "checkpoints" / "checkpoint_2" and counter.seen == 2
    acc.project_configuration.iteration = 1
    with pytest.raises(ValueError, match="already exists"):
        save_state(acc)


@contextlib.contextmanager
def killed_at_the_process_file(monkeypatch):
    """gdsckpt.save interrupted as it starts a process file, the state file written: a save_state
    killed part-way."""
    import gdsckpt
    save = gdsckpt.save

    def killed(state, path, **kw):
        if Path(path).name.startswith("process_"):
            raise KeyboardInterrupt("killed")
        return save(state, path, **kw)
    monkeypatch.setattr(gdsckpt, "save", killed)
    try:
        yield
    finally:
        monkeypatch.setattr(gdsckpt, "save", save)


def test_load_state_passes_over_a_folder_a_killed_save_left_torn(tmp_path, monkeypatch, caplog):
    """A save_state killed before its process file leaves checkpoint_2 torn; load_state() with no
    folder takes checkpoint_1, the newest complete one, and says why."""
    from gdsckpt.integrations.accelerate import load_state, save_state
    acc, model, opt, loader, sched, counter = build("default", tmp_path, automatic_checkpoint_naming=True,
                                                    total_limit=2)
    for i in range(2):
        counter.seen = i
        save_state(acc)
    with killed_at_the_process_file(monkeypatch), pytest.raises(KeyboardInterrupt):
        save_state(acc)
    counter.seen = 99
    with caplog.at_level("WARNING", logger="gdsckpt.integrations.accelerate"):
        assert load_state(acc) == tmp_path / "checkpoints" / "checkpoint_1" and counter.seen == 1
    assert "checkpoint_2 torn" in caplog.text


def test_refusals(tmp_path):
    import gdsckpt
    from gdsckpt.integrations.accelerate import load_state, save_state
    acc, model, opt, loader, sched, counter = build("default")
    with pytest.raises(ValueError, match="output_dir is needed"):
        save_state(acc)
    with pytest.raises(ValueError, match="folder does not exist"):
        load_state(acc, tmp_path / "nowhere")
    save_state(acc, tmp_path / "d")
    acc.register_for_checkpointing(Counter())  # one more registered object than the folder has
    with pytest.raises(gdsckpt.StateMismatchError, match="custom/1"):
        load_state(acc, tmp_path / "d")


if __name__ == "__main__":
    report((child_first if sys.argv[1] == "first" else child_resume)(Path(sys.argv[2])))


def test_a_folder_of_two_saves_is_refused_not_loaded_as_a_mix(tmp_path, monkeypatch):
    """save_state into the same folder again, killed after the state file and before the process
    file: the folder holds files of two saves. load_state(folder) refuses it, naming it (it loaded
    the new weights with the old step, RNG and loader position, without a word)."""
    import gdsckpt
    from gdsckpt.integrations.accelerate import load_state, save_state
    acc, model, opt, loader, sched, counter = build("default", tmp_path)
    folder = tmp_path / "ck"
    counter.seen = 1
    save_state(acc, folder)
    counter.seen = 2
    with killed_at_the_process_file(monkeypatch), pytest.raises(KeyboardInterrupt):
        save_state(acc, folder)  # into the same folder again
    counter.seen = 3
    with pytest.raises(gdsckpt.CheckpointFormatError, match="two save_state calls"):
        load_state(acc, folder)
    assert counter.seen == 3  # nothing loaded
    save_state(acc, folder)  # a whole save mends it
    counter.seen = 0
    assert load_state(acc, folder) == folder and counter.seen == 3
