"""A training job as a user writes it, for test_peer_replicas_torchrun.py: DDP over gloo, run by
torchrun with one agent per node, and `Checkpointer(directory, memory=True, replicas=1)` with no
node= (the node is torchrun's GROUP_RANK, the memory root GDSCKPT_MEMORY_ROOT, as the test gives
each node), each node a directory of its own.

    python -m torch.distributed.run --nnodes 2 --node-rank N ... torchrun_node_job.py PHASE ROOT

train: steps 1-8, a checkpoint at steps 1-5 (5 committed and replicated), the losses of all 8
and the model at step 5 written to ROOT; then ROOT/ready-r<rank>, and it waits to be killed.
resume: restore, then steps 6-8; ROOT/resume-r<rank>.json says the step, its source, whether
the model is the one saved and the losses.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main(phase: str, root: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    (root / f"pid-{phase}-r{rank}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    from gdsckpt import Checkpointer
    ck = Checkpointer(root / f"dir-node{os.environ['GROUP_RANK']}" / "ck", memory=True, replicas=1, every_local=100)

    def step(i: int) -> float:
        g = torch.Generator().manual_seed(1000 * i + rank)
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    if phase == "train":
        losses = {}
        for i in range(1, 9):
            losses[i] = step(i)
            if i <= 5:
                ck.save_async(i, {"model": model, "optim": opt})
                ck.wait()
                assert ck.memory.wait_replicas(60)
            if i == 5:
                torch.save({k: v.clone() for k, v in model.state_dict().items()}, root / f"model-5-r{rank}.pt")
        dist.barrier()
        (root / f"losses-r{rank}.json").write_text(json.dumps(losses))
        (root / f"ready-r{rank}").touch()
        time.sleep(600)  # killed
    r = ck.restore({"model": model, "optim": opt})
    saved = torch.load(root / f"model-5-r{rank}.pt")
    same = all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    losses = {i: step(i) for i in range(r.step + 1, 9)}
    ck.close()
    (root / f"resume-r{rank}.json").write_text(json.dumps(
        {"step": r.step, "source": r.source, "same_model": same, "losses": losses, "node": os.environ["GROUP_RANK"]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
