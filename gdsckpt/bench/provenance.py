"""What every gdsckpt-bench result records about where and when it ran: the date, the host,
the device and the versions of what it measured (the fields both the jobs' and --train's
JSON open with)."""

from __future__ import annotations

import datetime
import os
import platform

import torch

import gdsckpt


def stamp(device: str) -> dict:
    """{date, host, device, versions} of a result measured now on `device`."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "device": describe_device(device), "versions": versions()}


def describe_device(device: str) -> dict:
    """{kind: gpu|cpu, name}: the GPU's name, or the CPU's and its core count."""
    gpu = device.startswith("cuda")
    return {"kind": "gpu" if gpu else "cpu",
            "name": torch.cuda.get_device_name() if gpu
            else (platform.processor() or platform.machine()) + f" ({os.cpu_count()} cores)"}


def versions() -> dict:
    """gdsckpt, torch and Python; nvCOMP and KvikIO where installed (None where not)."""
    v = {"gdsckpt": gdsckpt.__version__, "torch": torch.__version__, "python": platform.python_version()}
    for mod in ("nvidia.nvcomp", "kvikio"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            v[mod.split(".")[-1]] = m.__version__
        except Exception:
            v[mod.split(".")[-1]] = None
    return v
