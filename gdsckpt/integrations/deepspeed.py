"""DeepSpeed checkpoints as gdsckpt files: one line after `deepspeed.initialize`.

    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    gdsckpt.integrations.deepspeed.use_gdsckpt(engine)   # the one line
    engine.save_checkpoint("ckpt")                         # unchanged: writes gdsckpt files
    engine.load_checkpoint("ckpt")                         # unchanged: reads them

DeepSpeed picks its checkpoint engine itself (`create_checkpoint_engine`: torch.save, or
FastPersist/DeepNVMe with the ds_config "checkpoint": {"writer": ...} section, or DataStates);
its config has no entry for a third-party engine, so `use_gdsckpt` sets the engine's
`checkpoint_engine` attribute, which every save and load of the engine goes through (model
states, ZeRO optimizer partitions, MoE experts). The file names stay DeepSpeed's
(`global_step10/mp_rank_00_model_states.pt`, `zero_pp_rank_0_mp_rank_00_optim_states.pt`): the
files are gdsckpt files under those names, and `latest` is written as before.

Each rank's dicts are saved as gdsckpt saves any state: tensors in chunks, the plain values in
the file's JSON skeleton; nothing is pickled and loading never unpickles. The objects DeepSpeed
itself puts in them (torch.Size parameter shapes, the ZeRO stage enum, the loss scaler, the
fragment addresses of ZeRO's parameter slices, torch dtypes) are stored as tagged plain values
and rebuilt as those types from a fixed table (nothing named by the file is imported). Any other
value (an object in `client_state`, say) is an UnsupportedStateError naming its key, raised
before that file is written.

async_save=True (the default): each file's save goes through `gdsckpt.save_async`, which
returns once the tensors are compressed into host memory; DeepSpeed's `commit` (which it calls
before writing `latest`) waits until every file of the checkpoint is durable. decoupled=True
makes the engine a decoupled one, as DeepSpeed's DecoupledCheckpointEngine: `save_checkpoint`
returns after the snapshot, the files are written while training goes on, and the commit (the
wait, then `latest`) happens at the next optimizer step's boundary; call `wait()` on the engine
after the last save of a run so that its `latest` is written too.

Not readable by torch.load, so not by DeepSpeed's offline tools (zero_to_fp32.py, the universal
checkpoint converter): `load_checkpoint` with this engine, or `gdsckpt.load`, reads them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

import gdsckpt
from gdsckpt.errors import CheckpointFormatError, UnsupportedStateError
from gdsckpt.options import Snapshot, check_save_options

__all__ = ["GdsckptCheckpointEngine", "use_gdsckpt", "OBJECT_TAG"]

log = logging.getLogger("gdsckpt.integrations.deepspeed")

ENGINE_NAME = "GdsckptCheckpointEngine"
# The key of a dict that stands for one of DeepSpeed's objects: {OBJECT_TAG: "<type>", "value": ...}.
OBJECT_TAG = "__gdsckpt_deepspeed_object__"


def use_gdsckpt(engine, **options: Any) -> "GdsckptCheckpointEngine":
    """Make `engine` (what deepspeed.initialize returned) save and load gdsckpt files; returns the
    checkpoint engine. options: async_save=, decoupled=, and gdsckpt.save options (codec=, ...).
    Call it on every rank, before the first save_checkpoint / load_checkpoint."""
    old = getattr(engine, "checkpoint_engine", None)
    if old is not None and old.is_decoupled() and old.get_commit_info() is not None:
        old.commit(old.get_commit_info())  # a save of the engine it replaces, not yet committed
    checkpoint_engine = GdsckptCheckpointEngine(getattr(engine, "_config", None), **options)
    engine.checkpoint_engine = checkpoint_engine
    return checkpoint_engine


class GdsckptCheckpointEngine(CheckpointEngine):
    """A DeepSpeed CheckpointEngine that writes and reads gdsckpt files (see the module docstring).

    async_save: save through gdsckpt.save_async (True) or gdsckpt.save (False: each file atomic
    and durable when `save` returns). decoupled: commit at the next step, not in save_checkpoint
    (needs async_save). save_options: codec=, chunk_bytes=, ..., with async_save also snapshot=
    ("host", the default here, or "device") and pool_bytes=; checked here."""

    def __init__(self, config_params=None, *, async_save: bool = True, decoupled: bool = False, **save_options: Any):
        super().__init__(config_params)
        self.name = ENGINE_NAME
        if decoupled and not async_save:
            raise ValueError(f"{ENGINE_NAME}: decoupled=True needs async_save=True (a synchronous save has "
                             "nothing left to commit later)")
        check_save_options(save_options, ("snapshot", "pool_bytes") if async_save else (),
                           (Snapshot.HOST, Snapshot.DEVICE))
        if async_save:
            # not the inferred "overlap": DeepSpeed's dicts hold its flat partitions and copies, which
            # no single torch optimizer's step fences
            save_options.setdefault("snapshot", Snapshot.HOST)
        self.async_save, self.decoupled, self.save_options = async_save, decoupled, save_options
        self._commit_info: CheckpointCommitInfo | None = None
        self.last_stats: list = []  # the Stats (AsyncStats) of each file of the last checkpoint committed
        self._in_flight: list[Any] = []  # SaveFutures of this engine not yet committed, oldest first
        self._lock = threading.Lock()

    def create(self, info: CheckpointCommitInfo) -> None:
        """A checkpoint `info.tag` begins: an earlier one still uncommitted (decoupled) is committed first."""
        if self._commit_info is not None:
            self.commit(self._commit_info)
        self._commit_info = info
        if not self.async_save:
            self.last_stats = []

    def save(self, state_dict, path: str) -> None:
        """Write `state_dict` to `path` as a gdsckpt file (the folder exists: DeepSpeed made it)."""
        state = to_storable(state_dict)
        try:
            if self.async_save:
                fut = gdsckpt.save_async(state, path, **self.save_options)
                with self._lock:
                    self._in_flight.append(fut)
            else:
                self.last_stats.append(gdsckpt.save(state, path, **self.save_options))
        except UnsupportedStateError as e:
            e.add_note(f"gdsckpt.integrations.deepspeed: saving {path}: DeepSpeed's checkpoint dict and the "
                       "client_state passed to save_checkpoint must hold tensors and plain values (int, float, "
                       "str, bool, None, bytes, NumPy) in dicts, lists and tuples; convert the value named above")
            raise

    def load(self, path: str, map_location=None):
        """The dict saved to `path`. map_location: None (each tensor where it was saved from; on the
        CPU where there is no GPU), a device, or DeepSpeed's `lambda storage, loc: storage` (the CPU)."""
        device = _device(map_location)
        gdsckpt.wait_for_saves_to(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{ENGINE_NAME}: checkpoint file not found: {path}")
        try:
            state = gdsckpt.load(path, device=device)
        except CheckpointFormatError as e:
            if _written_by_torch_save(path):
                e.add_note(f"{path} was written by torch.save (DeepSpeed's own checkpoint engine), not by "
                           "gdsckpt: load it without use_gdsckpt (which unpickles it), or save it again with it")
            raise
        return from_storable(state, path)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Wait until every file this engine saved is durable; raise the first save that failed.
        DeepSpeed writes `latest` after this returns."""
        with self._lock:
            waiting, self._in_flight = self._in_flight, []
        errors = [e for e in (fut.exception() for fut in waiting) if e is not None]
        if self._commit_info == info:
            self._commit_info = None
        if errors:
            raise errors[0]
        if waiting:
            self.last_stats = [fut.result() for fut in waiting]
        return True

    def wait(self) -> None:
        """Commit what is saved and uncommitted: wait for every file to be durable (raise the first
        failure), and for a decoupled checkpoint not committed yet, write its `latest` (rank 0), as
        DeepSpeed does at the next step. Call it after a run's last save_checkpoint."""
        info = self._commit_info
        self.commit(info)
        if self.decoupled and info is not None and info.save_latest and _rank() == 0:
            Path(info.save_dir, "latest").write_text(info.tag)

    def is_decoupled(self) -> bool:
        return self.decoupled

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        return self._commit_info if self.decoupled else None

    def cleanup(self) -> None:
        """engine.destroy(): wait for the saves in flight."""
        self.commit(self._commit_info)

    def preserves_storage_sharing(self) -> bool:
        # gdsckpt stores a view's own elements, not its storage: DeepSpeed need not clone views first
        return False


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


# --- DeepSpeed's own objects as tagged plain values -------------------------------------------

def _loss_scaler_state(obj) -> dict:
    return {k: to_storable(v) for k, v in vars(obj).items()}


def _rebuilt_loss_scaler(cls, state: dict):
    obj = cls.__new__(cls)  # its attributes are all its state (DeepSpeedConfigObject)
    obj.__dict__.update(state)
    return obj


# type name -> (exact type, to plain value, from plain value). Only these are rebuilt on load.
_OBJECTS = {
    "torch.Size": (torch.Size, list, torch.Size),
    "torch.dtype": (torch.dtype, lambda d: str(d).removeprefix("torch."), lambda s: _dtype(s)),
    "ZeroStageEnum": (ZeroStageEnum, int, ZeroStageEnum),
    "fragment_address": (fragment_address, dataclasses.asdict, lambda d: fragment_address(**d)),
    "LossScaler": (LossScaler, _loss_scaler_state, lambda d: _rebuilt_loss_scaler(LossScaler, d)),
    "DynamicLossScaler": (DynamicLossScaler, _loss_scaler_state, lambda d: _rebuilt_loss_scaler(DynamicLossScaler, d)),
}
_NAME_OF = {cls: name for name, (cls, _, _) in _OBJECTS.items()}


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def to_storable(obj, key: str = ""):
    """`obj` with DeepSpeed's objects (the table above) replaced by tagged dicts; containers are
    copied only where something inside them changed (tensors are never copied)."""
    cls = type(obj)
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return obj
    name = _NAME_OF.get(cls)
    if name is not None:
        return {OBJECT_TAG: name, "value": _OBJECTS[name][1](obj)}
    if cls in (dict, OrderedDict):
        if OBJECT_TAG in obj:
            raise UnsupportedStateError(f"the key {OBJECT_TAG!r} at {key or '<root>'!r} is reserved by "
                                        "gdsckpt.integrations.deepspeed")
        new = {k: to_storable(v, f"{key}/{k}" if key else str(k)) for k, v in obj.items()}
        if all(new[k] is obj[k] for k in obj):
            return obj
        out = cls(new)
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
        return out
    if cls in (list, tuple):
        new = [to_storable(v, f"{key}/{i}" if key else str(i)) for i, v in enumerate(obj)]
        return obj if all(a is b for a, b in zip(new, obj)) else cls(new)
    return obj  # gdsckpt's save checks it (UnsupportedStateError naming the key)


def from_storable(obj, path, key: str = ""):
    """What `to_storable` replaced, rebuilt (in place in the loaded containers)."""
    cls = type(obj)
    if cls in (dict, OrderedDict):
        if OBJECT_TAG in obj:
            return _rebuilt(obj, path, key)
        for k, v in obj.items():
            if type(v) in (dict, OrderedDict, list, tuple):
                obj[k] = from_storable(v, path, f"{key}/{k}" if key else str(k))
        return obj
    if cls is list:
        for i, v in enumerate(obj):
            obj[i] = from_storable(v, path, f"{key}/{i}" if key else str(i))
        return obj
    if cls is tuple:
        return tuple(from_storable(v, path, f"{key}/{i}" if key else str(i)) for i, v in enumerate(obj))
    return obj


def _rebuilt(node: dict, path, key: str):
    name = node.get(OBJECT_TAG)
    entry = _OBJECTS.get(name) if isinstance(name, str) else None
    if entry is None or set(node) != {OBJECT_TAG, "value"}:
        raise CheckpointFormatError(f"{ENGINE_NAME}: {key or '<root>'!r} is tagged as a DeepSpeed object of "
                                    f"unknown type {name!r}", path=path)
    value = node["value"]
    if type(value) in (dict, list):
        value = from_storable(value, path, key)
    try:
        return entry[2](value)
    except (TypeError, ValueError) as e:
        raise CheckpointFormatError(f"{ENGINE_NAME}: {key or '<root>'!r}: not a valid {name}: {e}", path=path) from e


def _device(map_location):
    if map_location is None:
        return None
    if isinstance(map_location, (str, torch.device)):
        return str(map_location)
    if callable(map_location):
        probe = object()
        try:
            kept = map_location(probe, "cpu") is probe
        except Exception:  # noqa: BLE001 - any other function is refused below
            kept = False
        if kept:  # DeepSpeed's `lambda storage, loc: storage`: storages stay where torch.load puts them, the CPU
            return "cpu"
    raise TypeError(f"{ENGINE_NAME}.load: map_location must be None, a device (str or torch.device) or "
                    f"`lambda storage, loc: storage`, not {map_location!r}: gdsckpt loads every tensor onto one "
                    "device and does not call map_location functions")


def _written_by_torch_save(path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(2)
    except OSError:
        return False
    return head == b"PK" or head[:1] == b"\x80"  # torch.save's zip, or its legacy pickle
