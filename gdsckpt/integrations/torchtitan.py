"""torchtitan: its DCP checkpointer, saving and loading through GdsckptWriter / GdsckptReader.

In a torchtitan trainer config, put gdsckpt's checkpoint manager where torchtitan's goes:

    from gdsckpt.integrations.torchtitan import GdsckptCheckpointManager
    config.checkpoint = GdsckptCheckpointManager.Config(enable=True, folder="checkpoint", interval=500,
                                                        async_mode="async")

It is torchtitan's CheckpointManager (folders `step-N`, interval, keep_latest_k, load_step,
exclude_from_loading, the model-only last save, async modes), with the two methods that call
torch.distributed.checkpoint replaced: `dcp_save` passes `GdsckptWriter(checkpoint_id)` (with
DCP's plan caching, `CachedSavePlanner`) and `dcp_load` passes `GdsckptReader(checkpoint_id)`.
Each rank compresses and writes its own shards; DCP's `.metadata` stays the commit point, which
is what torchtitan looks for when it picks the step to resume from.

async_mode: "async" and "async_with_pinned_mem" both compress each rank's shards into gdsckpt's
host pool (pinned memory on the GPU) before `dcp.async_save` returns, so the state may change at
once; the write and fsync run on DCP's background thread. torchtitan's pinned-memory stager
(DCP's DefaultStager) and its process executor are not used: the manager's `stager` is gdsckpt's
own, so torchtitan does not build one (DefaultStager also refuses to be built without an
accelerator, which would stop "async_with_pinned_mem" on the CPU). "disabled": `dcp.save`,
durable on return.

In the async modes the manager reserves that pool (`gdsckpt.dcp.reserve`) at the first step's
`save()` call, on a background thread, once the optimizer holds its moments: the first checkpoint
then compresses into a pool already made and page-locked instead of growing it inside its save
(H100, the bench's 4.9 GB state: the first in-loop checkpoint held the training 0.17-0.21 s
without, 0.04 s with). `reservation` is that call's future (None until then, and in the other
modes).

Left to torchtitan, unchanged: Hugging Face safetensors export and import (`last_save_in_hf`,
`initial_load_in_hf`), and loading a folder that holds no gdsckpt files (a checkpoint torchtitan
wrote with its FileSystemWriter, e.g. an `initial_load_path`), which goes through DCP's own reader.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager
from torchtitan.tools.utils import GarbageCollection

from gdsckpt.dcp import SUFFIX, CachedSavePlanner, GdsckptReader, GdsckptWriter, reserve
from gdsckpt.options import check_save_options

__all__ = ["GdsckptCheckpointManager"]


class GdsckptCheckpointManager(CheckpointManager):
    """torchtitan's CheckpointManager writing gdsckpt DCP checkpoints (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        codec: str = "auto"
        """gdsckpt codec: "auto" (typed or byte-plane ANS per stream on the GPU, zstd on the CPU),
        "ans", "ans-planes", "bitcomp", "zstd", "raw"."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        check_save_options({"codec": config.codec})  # now, not at the first checkpoint `interval` steps in
        super().__init__(config, **kwargs)
        self.codec = config.codec
        self.reservation: Future | None = None
        if self.enable:
            self.stager = _WriterStages()  # torchtitan builds a DefaultStager only where this is None

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        # The trainer calls save() after every step: the first call comes after the optimizer's
        # first step, when its state holds the moments the reservation must be sized for.
        if self.reservation is None and not self.load_only and self.async_mode != AsyncMode.DISABLED:
            self.reservation = reserve(self._flattened_model_states_sd(), codec=self.codec)
        return super()._save(curr_step, last_step)

    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Future | AsyncSaveResponse | None:
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        writer = GdsckptWriter(checkpoint_id, codec=self.codec)
        if async_mode == AsyncMode.DISABLED:
            dcp.save(state_dict, storage_writer=writer, planner=CachedSavePlanner())
            ret = None
        else:
            upload = dcp.async_save(state_dict, storage_writer=writer, planner=CachedSavePlanner(),
                                    process_group=self.pg)
            # the writer staged (compressed into the host pool) before async_save returned
            ret = upload if async_mode == AsyncMode.ASYNC else AsyncSaveResponse(
                staging_completion=_done(), upload_completion=upload)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    @torch.no_grad()
    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf or not any(Path(checkpoint_id).glob(f"*{SUFFIX}")):
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        dcp.load(state_dict, storage_reader=GdsckptReader(checkpoint_id))
        # as torchtitan's dcp_load: the model's states are flattened into state_dict, so the
        # model wrapper is given them explicitly
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)


class _WriterStages:
    """Stands in the manager's `stager`: GdsckptWriter stages each save itself (gdsckpt's compressed
    host snapshot), so there is nothing to hold between saves or to close."""

    def close(self) -> None:
        pass


def _done() -> Future:
    fut: Future = Future()
    fut.set_result(None)
    return fut
