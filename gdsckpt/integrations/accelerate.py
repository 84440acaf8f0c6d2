"""Hugging Face Accelerate: `Accelerator.save_state` / `load_state` with gdsckpt files.

    from gdsckpt.integrations.accelerate import save_state, load_state
    save_state(accelerator, "ckpt/step_1000")   # instead of accelerator.save_state(...)
    load_state(accelerator, "ckpt/step_1000")   # instead of accelerator.load_state(...)

The same contract as Accelerate's own: the prepared models, optimizers, LR schedulers and
GradScaler, the objects registered with `register_for_checkpointing`, `accelerator.step`, every
process's random generators (Python, NumPy, torch, CUDA) and each prepared data loader's
position: a StatefulDataLoader's state (`use_stateful_dataloader=True`: it resumes mid-epoch by
itself), else its epoch (`iteration`), a seedable sampler's epoch and seed, and the sampler's
generator; hooks registered with `register_save_state_pre_hook` / `register_load_state_pre_hook`
run as Accelerate runs them (a hook that removes a model from the list saves and loads it
itself); `ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=N)` names and
prunes the folders as Accelerate does, except that old folders are removed only after the new
one is saved. Nothing is pickled: a folder holds `accelerator_state.gdsckpt` (written by the
main process, or by each node's with `save_on_each_node`) and one `process_{i}.gdsckpt` per
process. Each file is atomic and durable on return; `save_state` returns once every process's
files are.

As with Accelerate, a mid-epoch resume of an ordinary data loader is the caller's: skip the
batches already seen (`accelerator.skip_first_batches`) and call `set_epoch(epoch)` each epoch;
a RandomSampler without `use_seedable_sampler` draws each epoch's order from its generator,
restored as it was at the save, so only a resume at an epoch boundary sees the same order.

Accelerate keeps the prepared objects and the hooks in attributes with no public accessor
(`_models`, `_optimizers`, `_schedulers`, `_dataloaders`, `_custom_objects`,
`_save_model_state_pre_hook`, `_load_model_state_pre_hook`): they are read here, and nothing of
Accelerate is changed. FSDP, DeepSpeed, Megatron-LM and XLA checkpoints are their own formats:
refused (NotImplementedError); save FSDP2 models through torch.distributed.checkpoint with
`gdsckpt.dcp.GdsckptWriter`.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from accelerate.data_loader import get_sampler

import gdsckpt

__all__ = ["save_state", "load_state", "STATE_FILE", "process_file"]

STATE_FILE = "accelerator_state.gdsckpt"
# One save_state's token in the state file and every process file, the same in all: a folder whose
# files are of two saves (a save_state into the same folder killed between its files) is torn.
SAVE_ID = "save_id"
_UNSUPPORTED = ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA")

log = logging.getLogger("gdsckpt.integrations.accelerate")


def process_file(index: int) -> str:
    """The file of process `index`: its generators, `accelerator.step`, its data loaders' positions."""
    return f"process_{index}.gdsckpt"


def save_state(accelerator, output_dir: str | os.PathLike | None = None, **save_options: Any) -> Path:
    """Save what `accelerator.save_state(output_dir)` saves, as gdsckpt files; returns the folder.
    save_options (codec=, ...) reach gdsckpt.save. Call it on every process."""
    _check_supported(accelerator)
    folder = _folder_to_save(accelerator, output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    models = list(accelerator._models)
    weights = [accelerator.get_state_dict(m, unwrap=False) for m in models]
    for hook in accelerator._save_model_state_pre_hook.values():
        hook(models, weights, str(folder))  # may remove entries of `weights`: those it saved itself
    config = accelerator.project_configuration
    token = _save_token(accelerator)
    if accelerator.is_main_process or (config.save_on_each_node and accelerator.is_local_main_process):
        gdsckpt.save({**_shared(accelerator, weights), SAVE_ID: token}, folder / STATE_FILE, **save_options)
    gdsckpt.save({**_own(accelerator), SAVE_ID: token}, folder / process_file(accelerator.process_index),
                 **save_options)
    config.iteration += 1
    accelerator.wait_for_everyone()
    if config.automatic_checkpoint_naming and accelerator.is_main_process:
        _prune(folder.parent, config.total_limit, keep=folder)
    return folder


def load_state(accelerator, input_dir: str | os.PathLike | None = None, *, strict: bool = True,
               **load_options: Any) -> Path:
    """Restore what `save_state` saved into `accelerator`'s prepared objects; returns the folder.
    input_dir=None with automatic_checkpoint_naming: the newest folder complete for every process
    (each finds the state file and its own process file there, on its node's disk with
    save_on_each_node; a folder a killed save_state left torn is passed over, with a warning).
    strict=False: keys missing on either side are left alone (nn.Module.load_state_dict(strict=False)).
    load_options (atomic=True, trusted=False, ...) reach gdsckpt.load_into. Call it on every process."""
    _check_supported(accelerator)
    folder = _folder_to_load(accelerator, input_dir)
    models = list(accelerator._models)
    for hook in accelerator._load_model_state_pre_hook.values():
        hook(models, str(folder))  # may remove models: those it loaded itself
    files = (folder / STATE_FILE, folder / process_file(accelerator.process_index))
    ids = [_save_id(f) if f.is_file() else None for f in files]  # (a missing file: load_into names it)
    if all(f.is_file() for f in files) and len(set(ids)) > 1:
        raise gdsckpt.CheckpointFormatError(f"{_two_saves(folder, files[1].name)}: load an older folder", path=folder)
    shared, own = _shared(accelerator, models), _own(accelerator)
    for state, file, saved_id in zip((shared, own), files, ids):
        if saved_id is not None:  # saved with one (not by gdsckpt before 2026-11-28)
            state[SAVE_ID] = torch.empty(16, dtype=torch.uint8)
        gdsckpt.load_into(file, state, strict=strict, **load_options)
    accelerator.step = own["step"]
    return folder


def _shared(accelerator, models: list) -> dict:
    """The state every process holds alike: saved once (state dicts), restored by every process
    (into the objects)."""
    state = {"models": models, "optimizers": list(accelerator._optimizers),
             "schedulers": list(accelerator._schedulers), "custom": list(accelerator._custom_objects)}
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    return state


def _own(accelerator) -> dict:
    """The state of this process alone."""
    return {"step": accelerator.step, "rng": gdsckpt.RNG(),
            "dataloaders": [_LoaderPosition(dl) for dl in accelerator._dataloaders]}


class _LoaderPosition:
    """A prepared data loader's position, as a Stateful: a StatefulDataLoader's own state; else the
    epoch counter Accelerate passes to set_epoch, a seedable sampler's epoch and seed, and the
    sampler's generator (a RandomSampler's order comes from it)."""

    def __init__(self, loader):
        self.loader = loader

    def state_dict(self) -> dict:
        dl, state = self.loader, {}
        if hasattr(dl, "iteration"):
            state["iteration"] = dl.iteration
        if getattr(dl, "use_stateful_dataloader", False):
            state["loader"] = dl.state_dict()  # the sampler's generator, as the loader restores it
            return state
        sampler = get_sampler(dl)
        if hasattr(sampler, "initial_seed") and hasattr(sampler, "epoch"):  # accelerate's SeedableRandomSampler
            state["sampler"] = {"epoch": sampler.epoch, "initial_seed": sampler.initial_seed}
        generator = getattr(sampler, "generator", None)
        if generator is not None:
            state["generator"] = generator.get_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        dl = self.loader
        if "iteration" in state:
            dl.set_epoch(state["iteration"])  # the loader's epoch counter and its sampler's epoch
        if "loader" in state:
            dl.load_state_dict(state["loader"])
            return
        sampler = get_sampler(dl)
        if "sampler" in state:
            sampler.epoch, sampler.initial_seed = state["sampler"]["epoch"], state["sampler"]["initial_seed"]
        if "generator" in state and getattr(sampler, "generator", None) is not None:
            sampler.generator.set_state(state["generator"])


def _check_supported(accelerator) -> None:
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    if kind in _UNSUPPORTED:
        raise NotImplementedError(
            f"gdsckpt.integrations.accelerate: {kind} checkpoints are written by {kind} itself (its sharded model "
            "and optimizer formats); use accelerator.save_state for them, or save FSDP2 models through "
            "torch.distributed.checkpoint with gdsckpt.dcp.GdsckptWriter")


_ITERATION = re.compile(r"[\/]?([0-9]+)(?=[^\/]*$)")  # Accelerate's: the last number in the folder name


def _folder_to_save(accelerator, output_dir) -> Path:
    config = accelerator.project_configuration
    if not config.automatic_checkpoint_naming:
        if output_dir is None:
            raise ValueError("save_state: output_dir is needed unless ProjectConfiguration(automatic_checkpoint_naming=True)")
        return Path(os.path.expanduser(os.fspath(output_dir)))
    folder = Path(accelerator.project_dir) / "checkpoints" / f"checkpoint_{accelerator.save_iteration}"
    if folder.exists():
        raise ValueError(f"Checkpoint directory {folder} ({accelerator.save_iteration}) already exists. Please manually "
                         "override `self.save_iteration` with what iteration to start with.")
    accelerator.wait_for_everyone()
    return folder


def _folder_to_load(accelerator, input_dir) -> Path:
    if input_dir is not None:
        folder = Path(os.path.expanduser(os.fspath(input_dir)))
        if not folder.is_dir():
            raise ValueError(f"Tried to find {folder} but folder does not exist")
        return folder
    if not accelerator.project_configuration.automatic_checkpoint_naming:
        raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
    root = Path(accelerator.project_dir) / "checkpoints"
    folders = _numbered(root)
    if not folders:
        raise FileNotFoundError(f"no checkpoint folder in {root}")
    # What this process loads: with save_on_each_node on node-local disks, the other nodes' process
    # files are on their disks, not here. Every process then keeps the folders complete for all.
    complete = [f for f in folders if _torn(f, accelerator.process_index) is None]
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object
        everyone = gather_object([[f.name for f in complete]])
        complete = [f for f in complete if all(f.name in names for names in everyone)]
    if not complete:
        raise FileNotFoundError(f"no checkpoint folder in {root} is complete for every process (each needs "
                                f"{STATE_FILE} and each process's own process_N file, of one save_state): "
                                f"{', '.join(f.name for f in folders)} are torn")
    torn = folders[folders.index(complete[-1]) + 1:]
    if torn:  # a save_state killed part-way: the older folders it had not pruned yet are intact
        log.warning("gdsckpt: %s torn (a save_state that did not finish): loading %s", ", ".join(map(str, torn)),
                    complete[-1])
    return complete[-1]


def _save_token(accelerator) -> torch.Tensor:
    """A new save's token (16 random bytes), the main process's on every process."""
    token = [uuid.uuid4().bytes]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list
        broadcast_object_list(token)
    return torch.frombuffer(bytearray(token[0]), dtype=torch.uint8)


def _save_id(path: Path) -> bytes | None:
    with gdsckpt.open(path) as ck:
        return bytes(ck.get_tensor(SAVE_ID).numpy()) if SAVE_ID in ck else None


def _torn(folder: Path, index: int) -> str | None:
    """Why `folder` cannot be loaded by process `index` (a file missing, or the state file and its
    process file of two different saves), or None."""
    files = [folder / STATE_FILE, folder / process_file(index)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        return f"{folder} lacks {', '.join(missing)}"
    try:
        ids = {_save_id(f) for f in files}
    except (gdsckpt.CheckpointFormatError, OSError) as e:
        return f"{folder}: {type(e).__name__}: {e}"
    return _two_saves(folder, files[1].name) if len(ids) > 1 else None


def _two_saves(folder: Path, own_file: str) -> str:
    return (f"{folder} holds files of two save_state calls ({STATE_FILE} and {own_file} differ: one was killed "
            "part-way while saving into the same folder)")


def _numbered(root: Path) -> list[Path]:
    """The folders in `root` whose names end in a number, by that number."""
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() for m in [_ITERATION.search(p.name)] if m]
    return [p for _, p in sorted(found)]


def _prune(root: Path, total_limit: int | None, *, keep: Path) -> None:
    if total_limit is None:
        return
    folders = _numbered(root)
    for old in folders[:max(0, len(folders) - total_limit)]:
        if old != keep:
            shutil.rmtree(old)
