import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from gdsckpt.writing.snapshot import host as hs

# Folders whose modules other tests import (this file's helpers, test_manager's states, the
# corruption tools): on sys.path here (pyproject's `pythonpath`) and on the PYTHONPATH of every
# child a test starts, so that a child's `from test_manager import state_for` finds them too.
SHARED_FOLDERS = [Path(__file__).parent / sub for sub in ("", "manager", "reading", "cli")]
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(p) for p in SHARED_FOLDERS] + [p for p in [os.environ.get("PYTHONPATH")] if p])


def _gpu_ready() -> tuple[bool, str]:
    from gdsckpt.engine.backend import gpu_status
    return gpu_status()


def pytest_configure(config):
    """codec="auto" on the CPU compresses in every test process, whatever cores the runner has (on
    a host of few cores it stores raw: defaults.CPU_AUTO_COMPRESS_MIN_CORES), so that tests and
    goldens of the compressed format mean the same on every runner; test_codec_choice sets it
    back to test that choice."""
    from gdsckpt.core import defaults
    defaults.CPU_AUTO_COMPRESS_MIN_CORES = 1


def pytest_collection_modifyitems(config, items):
    ok, why = _gpu_ready()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"needs a GPU with nvCOMP and KvikIO: {why}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def assert_same(a, b, where="<root>"):
    """Bit-exact equality of two state trees: tensors by bytes, floats by repr (NaN, -0.0, inf),
    container types exact except that any dict equals any dict (model.state_dict() is an OrderedDict)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype, a.shape, b.shape)
        ab = a.detach().cpu().resolve_conj().contiguous().reshape(-1).view(torch.uint8)
        bb = b.detach().cpu().resolve_conj().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(ab, bb), f"tensor bytes differ at {where}"
        return
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), (where, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b) and [type(k) for k in a] == [type(k) for k in b], where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, float):
        assert repr(a) == repr(b), (where, a, b)
    else:
        assert a == b, (where, a, b)


def same(a, b) -> bool:
    """assert_same as a predicate: for tests that accept any one of several states."""
    try:
        assert_same(a, b)
        return True
    except AssertionError:
        return False


def all_dtype_tensors(device="cpu", n=1000, seed=0):
    """One tensor of every dtype gdsckpt stores, with real (non-zero) data."""
    from gdsckpt.core.dtypes import BY_NAME
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, dt in BY_NAME.items():
        raw = torch.randint(0, 256, (n * dt.itemsize,), dtype=torch.uint8, generator=g)
        if dt.is_floating_point and dt.itemsize >= 2:
            t = (torch.randn(n, generator=g) * 3).to(dt)  # realistic floats, not random bit patterns
        elif dt == torch.bool:
            t = raw[:n] > 127
        else:
            t = raw.view(dt)[:n].clone()
        out[name] = t.to(device)
    return out


class SlowSnapshot:
    """Holds the snapshot's first chunk copy until released: the overlap snapshot is then still
    running when the test trains."""

    def __init__(self, monkeypatch):
        self.gate = threading.Event()
        self.started = threading.Event()
        real = hs.PoolFile.pwrite

        def pwrite(file, *a):
            self.started.set()
            assert self.gate.wait(30)
            return real(file, *a)

        monkeypatch.setattr(hs.PoolFile, "pwrite", pwrite)


def tensors_of(obj):
    """Every tensor in a nested state of dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_of(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_of(v)


@pytest.fixture
def shm(monkeypatch):
    """The memory tier's root in a fresh /dev/shm folder, removed after the test."""
    root = Path(tempfile.mkdtemp(prefix="gdsckpt-test-", dir="/dev/shm"))
    monkeypatch.setenv("GDSCKPT_MEMORY_ROOT", str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)
