"""gdsckpt-bench --train under torchrun: what changes with more than one process.

`torchrun --nproc-per-node N -m gdsckpt.bench --train ...` runs one rank per GPU (per process
on the CPU, over gloo). The model is sharded with FSDP2 (`fully_shard` per block, then the
root), as torchtitan does, so each rank holds 1/N of the parameters and of the AdamW state,
and a checkpoint is `get_state_dict(model, opt)`: DTensor shards that each rank saves through
DCP. Checkpoint collectives and the bench's own (the shared directory, the results) use a gloo
group beside the training's NCCL one, as torchtitan does for async checkpoints: a background
save's collectives then never queue behind the training's on the GPU.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import torch


@dataclass
class Ranks:
    rank: int
    world: int
    local: int
    group: object  # gloo ProcessGroup for checkpoint and bench collectives

    def barrier(self) -> None:
        import torch.distributed as dist
        dist.barrier(group=self.group)

    def shared_directory(self, given: str | None) -> tuple[str, bool]:
        """The checkpoint directory every rank writes to: `given`, or one rank 0 made (the
        bool: made here, to be removed at the end)."""
        import torch.distributed as dist
        box = [given or (tempfile.mkdtemp(prefix="gdsckpt-train-") if self.rank == 0 else None)]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0], given is None

    def gather(self, obj) -> list:
        import torch.distributed as dist
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def close(self) -> None:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def from_env(device: str | None) -> tuple[Ranks | None, str | None]:
    """(Ranks, this rank's device) under torchrun (WORLD_SIZE > 1), else (None, device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None, device
    import torch.distributed as dist
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if cuda:
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")
    group = dist.new_group(backend="gloo")
    return Ranks(dist.get_rank(), world, local, group), (f"cuda:{local}" if cuda else "cpu")


def shard(model: torch.nn.Module) -> torch.optim.Optimizer:
    """FSDP2 over the bench's GPT (each block, then the root); the AdamW built after, on the
    sharded parameters, with the settings build() uses."""
    from torch.distributed.fsdp import fully_shard
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)


def checkpoint_state(model, opt) -> dict:
    """This rank's checkpoint: DTensor shards of the model and optimizer state, the optimizer's
    keyed by parameter name (DCP's distributed state_dict API)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}
