"""gdsckpt.integrations.transformers with the real transformers on the CPU (gdsckpt[transformers]).

A tiny GPT-2 built from a config (no download), with its dropout on, trained on random token
sequences for 12 steps (2 epochs of 6 batches) with AdamW and a linear schedule. One child
process trains it uninterrupted (the reference), then with GdsckptTrainer saving every 4 steps
until a callback stops it at step 10. A second child process resumes with
`train(resume_from_checkpoint=True)` (the newest folder, checkpoint-8: mid-epoch, so the Trainer
skips the batches already seen and restores the generators) and trains to step 12: the final
weights and AdamW moments must equal the reference's bit for bit. Run as a script, this file is
the child."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from integration_tools import digests, gdsckpt_files_only, report, run_child  # noqa: E402

STEPS, SAVE_EVERY, STOP_AT = 12, 4, 10
JSON_FILES = ("trainer_state.json", "config.json", "generation_config.json", "training_args.json")

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")


# ---------------------------------------------------------------- the child


def _model():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))


class Tokens:
    """24 random sequences of 16 tokens, as a map-style dataset of input_ids and labels."""

    def __init__(self):
        import torch
        self.ids = torch.randint(0, 64, (24, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer(output_dir: Path, *, gdsckpt_checkpoints: bool, callbacks=()):
    from transformers import Trainer, TrainingArguments
    from gdsckpt.integrations.transformers import GdsckptTrainer
    args = TrainingArguments(output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=4,
                             learning_rate=1e-3, weight_decay=0.01, warmup_steps=2, lr_scheduler_type="linear",
                             save_strategy="steps" if gdsckpt_checkpoints else "no", save_steps=SAVE_EVERY,
                             save_total_limit=2, seed=7, use_cpu=True, report_to="none", disable_tqdm=True,
                             logging_strategy="no", dataloader_num_workers=0)
    cls = GdsckptTrainer if gdsckpt_checkpoints else Trainer
    return cls(model=_model(), args=args, train_dataset=Tokens(), callbacks=list(callbacks))


def _final(trainer) -> dict:
    return {"model": digests(trainer.model.state_dict()),
            "optimizer": digests(trainer.optimizer.state_dict()["state"]), "global_step": trainer.state.global_step}


def child_first(root: Path) -> dict:
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == STOP_AT:
                control.should_training_stop = True

    reference = _trainer(root / "reference", gdsckpt_checkpoints=False)
    reference.train()
    interrupted = _trainer(root / "run", gdsckpt_checkpoints=True, callbacks=[StopAt()])
    interrupted.train()
    return {"reference": _final(reference), "stopped_at": interrupted.state.global_step,
            "folders": sorted(p.name for p in (root / "run").iterdir())}


def child_resume(root: Path) -> dict:
    trainer = _trainer(root / "run", gdsckpt_checkpoints=True)
    trainer.train(resume_from_checkpoint=True)
    out = _final(trainer)
    # load_best_model_at_end's step: the best model's folder read back into the model
    trainer.state.best_model_checkpoint = str(root / "run" / "checkpoint-8")
    trainer._load_best_model()
    out["best"] = digests(trainer.model.state_dict())
    return out


# ---------------------------------------------------------------- the tests


def test_train_stop_resume_in_a_new_process_is_bit_identical(tmp_path):
    import gdsckpt
    first = run_child(Path(__file__), "first", str(tmp_path))
    assert first["stopped_at"] == STOP_AT and first["folders"] == ["checkpoint-4", "checkpoint-8"]
    newest = tmp_path / "run" / "checkpoint-8"
    files = sorted(p.name for p in newest.iterdir())
    assert files == sorted(["model.gdsckpt", "optimizer.gdsckpt", "rng_state.gdsckpt", *JSON_FILES]), files
    assert gdsckpt_files_only(newest, allowed_other=JSON_FILES) == []  # no pickle, torch.save or safetensors file
    for name in JSON_FILES:
        json.loads((newest / name).read_text())
    saved_model = digests(gdsckpt.load(newest / "model.gdsckpt")["model"])

    resumed = run_child(Path(__file__), "resume", str(tmp_path))
    ref = first["reference"]
    assert resumed["global_step"] == ref["global_step"] == STEPS
    assert resumed["model"] == ref["model"], "final weights differ from the uninterrupted run's"
    assert resumed["optimizer"] == ref["optimizer"], "final AdamW state differs from the uninterrupted run's"
    assert resumed["best"] == saved_model != resumed["model"]
    # the resumed run saved checkpoint-12 and rotated checkpoint-4 away (save_total_limit=2)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-12", "checkpoint-8"]


def test_resume_true_passes_over_a_folder_a_killed_save_left_torn(tmp_path, caplog):
    """train(resume_from_checkpoint=True) takes the newest checkpoint-N/ a save finished (its
    trainer_state.json, written last, and the model and optimizer files): a newer one a killed save
    left with its model file alone is passed over, with a warning (transformers took it and failed
    on its missing trainer_state.json); none complete is transformers' ValueError."""
    trainer = _trainer(tmp_path / "run", gdsckpt_checkpoints=True)
    for n, files in ((4, ["model.gdsckpt", "optimizer.gdsckpt", "trainer_state.json"]), (12, ["model.gdsckpt"]),
                     (8, ["model.gdsckpt", "trainer_state.json"])):
        folder = tmp_path / "run" / f"checkpoint-{n}"
        folder.mkdir(parents=True)
        for name in files:
            (folder / name).write_text("{}")
    with caplog.at_level("WARNING", logger="gdsckpt.integrations.transformers"):
        assert trainer._newest_complete_checkpoint() == str(tmp_path / "run" / "checkpoint-4")
    assert "checkpoint-12" in caplog.text and "checkpoint-8" in caplog.text and "torn" in caplog.text
    import shutil
    shutil.rmtree(tmp_path / "run" / "checkpoint-4")
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory .*checkpoint-12"):
        trainer.train(resume_from_checkpoint=True)


def test_bad_save_options_are_refused_when_the_trainer_is_made():
    """Not at the first checkpoint, save_steps into the run; before the Trainer is set up."""
    from gdsckpt.integrations.transformers import GdsckptTrainer
    with pytest.raises(ValueError, match="unknown codec 'lz4'"):
        GdsckptTrainer(save_options={"codec": "lz4"})
    with pytest.raises(ValueError, match="'snapshot' is not a save option here"):
        GdsckptTrainer(save_options={"snapshot": "device"})  # gdsckpt.save's options: it takes no snapshot


if __name__ == "__main__":
    report((child_first if sys.argv[1] == "first" else child_resume)(Path(sys.argv[2])))
