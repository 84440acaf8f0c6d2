"""A node lost under torchrun itself: two torchrun agents on this host, each a node (GROUP_RANK)
with a memory root and a checkpoint directory of its own, the job as a user writes it
(tests/manager/torchrun_node_job.py: no node= argument). Every agent and worker is killed with
kill -9 (torchrun ends the job when a node fails), one node's memory and directory wiped; a new
job of two agents restores step 5, the lost node's rank from its peer, and trains on as if never
stopped."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

JOB = Path(__file__).with_name("torchrun_node_job.py")
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(root: Path, phase: str) -> list[subprocess.Popen]:
    """Two torchrun agents, node 0 and node 1, each in a session of its own."""
    port = _free_port()
    agents = []
    for node in (0, 1):
        (root / f"mem-node{node}").mkdir(exist_ok=True)
        env = dict(os.environ, GDSCKPT_MEMORY_ROOT=str(root / f"mem-node{node}"),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
               "--max-restarts", "0", str(JOB), phase, str(root)]
        log = open(root / f"{phase}-node{node}.log", "w")
        agents.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return agents


def _logs(root: Path, phase: str) -> str:
    return "\n".join((root / f"{phase}-node{n}.log").read_text()[-3000:] for n in (0, 1))


def _kill(root: Path, agents: list[subprocess.Popen]) -> None:
    """kill -9: node 1's agent and worker, then node 0's (torchrun ends the job's workers)."""
    for node in (1, 0):
        pid = root / f"pid-train-r{node}"
        if pid.exists():
            try:
                os.kill(int(pid.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(agents[node].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        agents[node].wait(30)


@pytest.mark.parametrize("lost", [1, 0])
def test_node_lost_under_torchrun_restores_from_its_peer(shm_tmp, lost):
    """(Node 0 lost: the directory that held every step's .metadata with it.)"""
    root = shm_tmp
    agents = _job(root, "train")
    try:
        deadline = time.monotonic() + 240
        while not all((root / f"ready-r{r}").exists() for r in (0, 1)):
            if any(a.poll() is not None for a in agents) or time.monotonic() > deadline:
                pytest.fail("the training job ended or hung before step 5:\n" + _logs(root, "train"))
            time.sleep(0.2)
    finally:
        _kill(root, agents)
    shutil.rmtree(root / f"mem-node{lost}")  # the node is gone, its memory and its disk with it
    shutil.rmtree(root / f"dir-node{lost}")
    agents = _job(root, "resume")
    try:
        for a in agents:
            assert a.wait(240) == 0, _logs(root, "resume")
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
    for rank in (0, 1):
        source = "peer" if rank == lost else "memory"
        got = json.loads((root / f"resume-r{rank}.json").read_text())
        assert (got["step"], got["source"], got["same_model"], got["node"]) == (5, source, True, str(rank)), got
        reference = json.loads((root / f"losses-r{rank}.json").read_text())
        assert got["losses"] == {k: v for k, v in reference.items() if int(k) > 5}, (got, reference)
