"""Hugging Face transformers: a Trainer whose checkpoints are gdsckpt files.

    from gdsckpt.integrations.transformers import GdsckptTrainer
    trainer = GdsckptTrainer(model=model, args=args, train_dataset=ds)   # as transformers.Trainer
    trainer.train()                                                      # checkpoint-N/ every save_steps
    trainer.train(resume_from_checkpoint=True)                           # the newest checkpoint-N/

A checkpoint folder `checkpoint-N/` holds `model.gdsckpt` (the model's state_dict, tied weights
stored once), `optimizer.gdsckpt` (optimizer and LR scheduler), `scaler.gdsckpt` (where
there is a GradScaler), `rng_state.gdsckpt` (`rng_state_{i}.gdsckpt` per process: Python,
NumPy, torch and CUDA generators), and as JSON: `trainer_state.json` (the Trainer's own, which
`train()` reads on resume), `config.json` (and `generation_config.json`) and `training_args.json` (the arguments, in place of
the pickled `training_args.bin`), plus the tokenizer's files where there is a processing class.
Nothing is pickled. `save_model()` called by you (the final export) still writes the Hugging
Face format that `from_pretrained` reads. `train(resume_from_checkpoint=...)` and
`load_best_model_at_end` read gdsckpt checkpoints, and still read Hugging Face ones.

transformers has no public hook for what a checkpoint holds, so these private methods are
overridden, each with the same signature and role as the one it replaces (checked against
transformers 5.x): `_save_checkpoint` (only to mark the save_model call it makes as a
checkpoint's; the folder naming, trainer state, rotation and best-model bookkeeping stay
transformers'), `_save_optimizer_and_scheduler`, `_save_scaler`, `_save_rng_state`,
`_load_from_checkpoint`, `_load_optimizer_and_scheduler`, `_load_scaler`, `_load_rng_state` and
`_load_best_model`; and the public `save_model`. DeepSpeed, FSDP, XLA and SageMaker model
parallelism write their own checkpoint formats: refused (NotImplementedError) when the trainer
is built.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available

import gdsckpt
from gdsckpt.options import check_save_options

__all__ = ["GdsckptTrainer", "MODEL_FILE", "OPTIMIZER_FILE", "SCALER_FILE", "TRAINING_ARGS_FILE", "rng_file"]

MODEL_FILE = "model.gdsckpt"
OPTIMIZER_FILE = "optimizer.gdsckpt"
SCALER_FILE = "scaler.gdsckpt"
TRAINING_ARGS_FILE = "training_args.json"
_CHECKPOINT = re.compile(re.escape(PREFIX_CHECKPOINT_DIR) + r"-(\d+)")

log = logging.getLogger("gdsckpt.integrations.transformers")


def rng_file(world_size: int, process_index: int) -> str:
    """The RNG file of a process, named as transformers names its rng_state*.pth."""
    return "rng_state.gdsckpt" if world_size <= 1 else f"rng_state_{process_index}.gdsckpt"


class GdsckptTrainer(Trainer):
    """transformers.Trainer with gdsckpt checkpoints (module docstring). save_options (codec=,
    chunk_bytes=, ...) reach gdsckpt.save; everything else is Trainer's."""

    def __init__(self, *args, save_options: dict | None = None, **kwargs):
        check_save_options(save_options or {})  # now, not at the first checkpoint save_steps into the run
        super().__init__(*args, **kwargs)
        self.gdsckpt_save_options = dict(save_options or {})
        self._saving_checkpoint = False
        for engaged, name in ((self.is_deepspeed_enabled, "DeepSpeed"), (self.is_fsdp_enabled, "FSDP"),
                              (is_torch_xla_available(), "XLA"), (is_sagemaker_mp_enabled(), "SageMaker MP")):
            if engaged:
                raise NotImplementedError(f"GdsckptTrainer: {name} writes its own checkpoint format; use "
                                          "transformers.Trainer for it")

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """transformers.Trainer.train; resume_from_checkpoint=True takes the newest checkpoint-N/
        that a save finished (its trainer_state.json, which transformers writes last, and the model
        and optimizer files), passing over, with a warning, newer ones a killed save left torn
        (transformers took the newest folder and failed on its missing trainer_state.json)."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self._newest_complete_checkpoint()
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _newest_complete_checkpoint(self) -> str:
        root = Path(self.args.output_dir)
        found = sorted(((int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else ())
                        for m in [_CHECKPOINT.fullmatch(p.name)] if m and p.is_dir()), reverse=True)
        needs = [MODEL_FILE, "trainer_state.json"] + ([] if self.args.save_only_model else [OPTIMIZER_FILE])
        torn = []
        for _, folder in found:
            if all((folder / name).is_file() for name in needs):
                if torn:
                    log.warning("gdsckpt: %s torn (a save that did not finish: %s missing); resuming from %s",
                                ", ".join(map(str, torn)), " or ".join(needs), folder)
                return str(folder)
            torn.append(folder)
        raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})"
                         + (f": {', '.join(map(str, torn))} torn" if torn else ""))

    # ---------------------------------------------------------------- saving

    def _save_checkpoint(self, model, trial) -> None:
        self._saving_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._saving_checkpoint = False

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Inside a checkpoint: the model as a gdsckpt file, with its config and the arguments as
        JSON. Otherwise (your export): transformers' save_model."""
        if not self._saving_checkpoint:
            return super().save_model(output_dir, _internal_call)
        if not self.args.should_save:
            return
        folder = Path(output_dir if output_dir is not None else self.args.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        gdsckpt.save({"model": self.model}, folder / MODEL_FILE, **self.gdsckpt_save_options)
        for config in (getattr(self.model, "config", None), getattr(self.model, "generation_config", None)):
            if config is not None and hasattr(config, "save_pretrained"):
                config.save_pretrained(folder)  # JSON, as from_pretrained finds them
        if self.processing_class is not None:
            self.processing_class.save_pretrained(folder)
        (folder / TRAINING_ARGS_FILE).write_text(self.args.to_json_string())

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.args.should_save:
            gdsckpt.save({"optimizer": self.optimizer, "scheduler": self.lr_scheduler},
                         Path(output_dir) / OPTIMIZER_FILE, **self.gdsckpt_save_options)

    def _save_scaler(self, output_dir: str) -> None:
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and self.args.should_save:
            gdsckpt.save({"scaler": scaler}, Path(output_dir) / SCALER_FILE, **self.gdsckpt_save_options)

    def _save_rng_state(self, output_dir: str) -> None:
        os.makedirs(output_dir, exist_ok=True)  # another process may not have created it yet
        gdsckpt.save({"rng": gdsckpt.RNG()}, Path(output_dir) / self._rng_file(), **self.gdsckpt_save_options)

    # ---------------------------------------------------------------- resuming

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        path = Path(resume_from_checkpoint) / MODEL_FILE
        if not path.exists():
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        gdsckpt.load_into(path, {"model": model if model is not None else self.model})

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not (Path(checkpoint) / OPTIMIZER_FILE).exists():
            return super()._load_optimizer_and_scheduler(checkpoint)
        gdsckpt.load_into(Path(checkpoint) / OPTIMIZER_FILE, {"optimizer": self.optimizer, "scheduler": self.lr_scheduler})

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not (Path(checkpoint) / SCALER_FILE).exists():
            return super()._load_scaler(checkpoint)
        gdsckpt.load_into(Path(checkpoint) / SCALER_FILE, {"scaler": self.accelerator.scaler})

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None or not (Path(checkpoint) / self._rng_file()).exists():
            return super()._load_rng_state(checkpoint)
        gdsckpt.load_into(Path(checkpoint) / self._rng_file(), {"rng": gdsckpt.RNG()})

    def _load_best_model(self) -> None:
        path = Path(self.state.best_model_checkpoint) / MODEL_FILE
        if not path.exists():
            return super()._load_best_model()
        gdsckpt.load_into(path, {"model": self.model})

    def _rng_file(self) -> str:
        return rng_file(self.args.world_size, self.args.process_index)
