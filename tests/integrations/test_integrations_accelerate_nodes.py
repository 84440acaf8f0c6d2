"""gdsckpt.integrations.accelerate across two "nodes" with node-local disks: two CPU processes of
the real Accelerate (MULTI_CPU over gloo), each its node's only process and so its local main,
with `save_on_each_node=True` and a project folder of its own (its node's disk). Each node's
folder then holds the state file and its own process file, never the other node's.

`load_state()` must find the newest folder complete for every process (before: it asked each node
for every process's file, so every folder looked torn and the load failed), and where a save was
killed on one node only, every process must load the same older folder."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytestmark = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate not installed")

WORLD = 2


def _node(rank: int, root: str, port: int) -> None:
    os.environ.update({"WORLD_SIZE": str(WORLD), "RANK": str(rank), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration
    from gdsckpt.integrations.accelerate import load_state, process_file, save_state
    disk = Path(root) / f"node{rank}"  # this node's own disk
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(disk), automatic_checkpoint_naming=True, save_on_each_node=True))
    assert acc.num_processes == WORLD and acc.is_local_main_process
    model = acc.prepare(torch.nn.Linear(4, 2))
    weight = acc.unwrap_model(model).weight  # DDP's module's
    saved = []
    for i in range(2):
        with torch.no_grad():
            weight.fill_(float(i + 1))
        save_state(acc)
        saved.append(weight.detach().clone())
    names = sorted(os.listdir(disk / "checkpoints" / "checkpoint_1"))
    assert names == ["accelerator_state.gdsckpt", process_file(rank)], names  # the other node's file is not here

    with torch.no_grad():
        weight.zero_()
    assert load_state(acc) == disk / "checkpoints" / "checkpoint_1"
    assert torch.equal(weight, saved[1])

    if rank == 1:  # a save killed on node 1 alone: its process file of checkpoint_1 never came
        (disk / "checkpoints" / "checkpoint_1" / process_file(1)).unlink()
    acc.wait_for_everyone()
    with torch.no_grad():
        weight.zero_()
    assert load_state(acc) == disk / "checkpoints" / "checkpoint_0"  # on both nodes: the same step
    assert torch.equal(weight, saved[0])
    acc.wait_for_everyone()
    acc.end_training()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_with_their_own_disks_load_the_newest_folder_complete_for_both(tmp_path):
    import torch.multiprocessing as mp
    mp.start_processes(_node, args=(str(tmp_path), _free_port()), nprocs=WORLD, join=True, start_method="spawn")
