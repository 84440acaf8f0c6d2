"""Snapshot modes behind one interface (gdsckpt/writing/snapshot/modes.py): a mode defined and registered
here alone saves bit-exact through save_async and GdsckptWriter, and the shortest save_async call
overlaps with the optimizer the state holds itself, where that is safe."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

import gdsckpt
from gdsckpt.writing.snapshot import modes as snapshot_modes
from conftest import SlowSnapshot, assert_same

SMALL = dict(backend="cpu", chunk_bytes=64 << 10)


pytestmark = pytest.mark.usefixtures("no_save_in_flight")


class ClonedOnHost:
    """A mode of this test's own: every tensor cloned in host memory in the call, the compressed
    snapshot taken from the clones on a background thread, nothing waiting for it."""

    name = "cloned-on-host"
    used_by = (snapshot_modes.SAVE_ASYNC, snapshot_modes.DCP)
    optimizer = "unused"
    with_optimizer = None
    uses_pool = True

    def __init__(self):
        self.saves = self.stagings = 0

    def save(self, call):
        self.saves += 1
        return call.in_background(keep=lambda t: False, optimizer=None)

    def stage(self, call):
        self.stagings += 1
        return call.in_background(keep=lambda t: False, optimizer=None)


@pytest.fixture
def cloned():
    mode = snapshot_modes.register(ClonedOnHost())
    yield mode
    snapshot_modes.unregister(mode.name)


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300_000, generator=g), "b": torch.randn(999, generator=g).to(torch.bfloat16),
            "ids": torch.randint(-9, 9, (5000,), generator=g), "step": seed, "name": "run"}


def test_a_mode_registered_here_saves_bit_exact(tmp_path, cloned):
    state = _state(1)
    want = copy.deepcopy(state)
    fut = gdsckpt.save_async(state, tmp_path / "a.gdsckpt", snapshot="cloned-on-host", **SMALL)
    for t in (state["w"], state["b"], state["ids"]):  # the call returned: the state is the caller's again
        t.zero_()
    stats = fut.result(60)
    assert cloned.saves == 1 and stats.mode == "cloned-on-host"
    assert_same(gdsckpt.load(tmp_path / "a.gdsckpt"), want)


def test_a_mode_registered_here_stages_for_dcp(tmp_path, cloned):
    import torch.distributed.checkpoint as dcp
    from gdsckpt.dcp import GdsckptReader, GdsckptWriter
    state = _state(2)
    want = copy.deepcopy(state)
    writer = GdsckptWriter(tmp_path / "ck", snapshot="cloned-on-host", backend="cpu")
    assert writer.snapshot == "cloned-on-host"
    resp = dcp.async_save(state, storage_writer=writer, no_dist=True)
    resp.staging_completion.result(60)
    state["w"].zero_()
    resp.upload_completion.result(60)
    assert cloned.stagings == 1
    got = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in want.items()}
    dcp.load(got, storage_reader=GdsckptReader(tmp_path / "ck"), no_dist=True)
    assert_same(got, want)


def test_unknown_and_unregistered_modes_are_refused_naming_the_choices(tmp_path, cloned):
    with pytest.raises(ValueError, match="snapshot must be one of 'host', 'overlap', 'device', 'cloned-on-host', not 'x'"):
        gdsckpt.save_async(_state(3), tmp_path / "a.gdsckpt", snapshot="x")
    snapshot_modes.unregister("cloned-on-host")
    with pytest.raises(ValueError, match="snapshot must be one of 'host', 'overlap', 'device', not 'cloned-on-host'"):
        gdsckpt.save_async(_state(3), tmp_path / "a.gdsckpt", snapshot="cloned-on-host")
    snapshot_modes.register(cloned)
    with pytest.raises(ValueError, match="used_by"):
        snapshot_modes.register(type("Odd", (ClonedOnHost,), {"used_by": ("elsewhere",)})())


# ---------------------------------------------------------------- the state's own optimizer


def _model_and_optimizer(batch_norm: bool = False):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)]
    if batch_norm:
        layers.insert(1, torch.nn.BatchNorm1d(64))
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt)
    return model, opt


def _train_step(model, opt, backward_only: bool = False):
    model(torch.randn(16, 32)).square().mean().backward()
    if not backward_only:
        opt.step()
        opt.zero_grad()


def test_a_state_holding_its_optimizer_overlaps_without_being_told(tmp_path, monkeypatch):
    model, opt = _model_and_optimizer()
    state = {"model": model, "optim": opt, "step": 1}
    want = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict(), "step": 1})
    slow = SlowSnapshot(monkeypatch)
    fut = gdsckpt.save_async(state, tmp_path / "a.gdsckpt", **SMALL)
    assert slow.started.wait(10) and not fut.done()  # returned while the snapshot still runs
    assert len(opt._optimizer_step_pre_hooks) == 1
    _train_step(model, opt, backward_only=True)  # forward and backward run meanwhile
    threading.Timer(0.3, slow.gate.set).start()
    t = time.perf_counter()
    opt.step()  # waits for the snapshot before AdamW changes a parameter or a moment
    assert slow.gate.is_set() and time.perf_counter() - t >= 0.2
    stats = fut.result(30)
    assert stats.mode == "overlap" and stats.hook_wait_s >= 0.2
    assert_same(gdsckpt.load(tmp_path / "a.gdsckpt"), want)


def test_state_dicts_taken_afresh_overlap_with_the_optimizer_that_stepped(tmp_path, monkeypatch):
    """A loop that builds its state dicts at each save holds no optimizer object: the one that
    stepped in this process, whose parameters and moments they are, fences the snapshot."""
    model, opt = _model_and_optimizer()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    want = copy.deepcopy(state)
    slow = SlowSnapshot(monkeypatch)
    fut = gdsckpt.save_async(state, tmp_path / "a.gdsckpt", **SMALL)
    assert slow.started.wait(10) and not fut.done() and len(opt._optimizer_step_pre_hooks) == 1
    _train_step(model, opt, backward_only=True)
    threading.Timer(0.3, slow.gate.set).start()
    opt.step()  # waits for the snapshot
    assert slow.gate.is_set()
    assert fut.result(30).mode == "overlap"
    assert_same(gdsckpt.load(tmp_path / "a.gdsckpt"), want)


@pytest.mark.parametrize("case", ["overlap=False", "snapshot=host", "buffers", "two optimizers",
                                  "state_dicts with buffers", "a tensor of no optimizer"])
def test_the_default_stays_the_host_snapshot_where_the_overlap_is_not_safe_or_not_wanted(tmp_path, case):
    model, opt = _model_and_optimizer(batch_norm="buffers" in case)
    state, kwargs = {"model": model, "optim": opt}, {}
    if case == "overlap=False":
        kwargs = {"overlap": False}
    elif case == "snapshot=host":
        kwargs = {"snapshot": "host"}
    elif case == "two optimizers":  # no one step fences the whole state
        state["other"] = torch.optim.SGD(model.parameters(), lr=0.1)
    elif case == "state_dicts with buffers":  # BatchNorm's statistics: the forward changes them
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
    elif case == "a tensor of no optimizer":  # an EMA copy, say: another step changes it
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "ema": torch.randn(8)}
    stats = gdsckpt.save_async(state, tmp_path / "a.gdsckpt", **kwargs, **SMALL).result(60)
    assert stats.mode == "host" and len(opt._optimizer_step_pre_hooks) == 0


def test_the_checkpointer_overlaps_with_the_states_optimizer_without_being_told(tmp_path):
    model, opt = _model_and_optimizer()
    want = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict(), "step": 1})
    ck = gdsckpt.Checkpointer(tmp_path / "ck", save_options=SMALL)
    fut = ck.save_async(1, {"model": model, "optim": opt, "step": 1})
    assert len(opt._optimizer_step_pre_hooks) == 1  # the next step waits for the snapshot
    assert fut.result(60).mode == "overlap"
    ck.wait()
    assert_same(gdsckpt.load(tmp_path / "ck" / ck.layout.name(1)), want)
    ck.close()
