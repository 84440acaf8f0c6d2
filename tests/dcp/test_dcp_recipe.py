"""gdsckpt.dcp.save / async_save (dcp/recipe.py): DCP through gdsckpt's fast path in one call, and the
one-time warning of a plain dcp.async_save through GdsckptWriter without plan caching."""

from __future__ import annotations

import copy
import logging
from concurrent.futures import wait as wait_futures

import pytest
import torch
import torch.distributed.checkpoint as dcp

import gdsckpt
import gdsckpt.dcp
from gdsckpt.writing.snapshot import overlap
from gdsckpt.engine import pinned_pool as pp
from gdsckpt.dcp import CachedSavePlanner, GdsckptReader, GdsckptWriter
from gdsckpt.dcp import writer as dcp_writer
from gdsckpt.format.stateful import dcp_view, dcp_write_back
from conftest import assert_same

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(autouse=True)
def fresh():
    yield
    overlap.wait_for_snapshot(30)
    pp.release_pools()


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(16, 32)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _load(path, seed: int) -> dict:
    model, opt = _trained(seed)
    state = {"model": model, "optim": opt, "step": 0}
    view = dcp_view(state)
    dcp.load(view, storage_reader=GdsckptReader(path))
    dcp_write_back(state, view)
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": state["step"]}


def test_async_save_in_one_call_overlaps_with_the_states_optimizer_and_round_trips(tmp_path, caplog):
    model, opt = _trained()
    state = {"model": model, "optim": opt, "step": 7}
    want = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict(), "step": 7})
    with caplog.at_level(logging.WARNING, logger="gdsckpt"):
        resp = gdsckpt.dcp.async_save(state, tmp_path / "ck", backend="cpu")
        assert len(opt._optimizer_step_pre_hooks) == 1  # overlapped: the next step waits for the snapshot
        resp.staging_completion.result(30)
        opt.step()
        resp.upload_completion.result(30)
    assert not [r for r in caplog.records if "CachedSavePlanner" in r.getMessage()]
    assert_same(_load(tmp_path / "ck", seed=5), want)
    gdsckpt.dcp.save(state, tmp_path / "sync", backend="cpu")  # the same, durable on return
    assert_same(_load(tmp_path / "sync", seed=6), {"model": model.state_dict(), "optim": opt.state_dict(), "step": 7})


def test_async_save_in_one_call_stays_host_where_no_optimizer_fences_the_state(tmp_path):
    model, opt = _trained(1)
    state = {"model": model, "optim": opt.state_dict(), "step": 1, "ema": torch.randn(8)}  # the EMA: no step of opt's
    fut = gdsckpt.dcp.async_save(state, tmp_path / "ck", backend="cpu")
    assert len(opt._optimizer_step_pre_hooks) == 0
    wait_futures([getattr(fut, "upload_completion", fut)], timeout=30)


def test_a_plain_async_save_without_plan_caching_warns_once_with_the_fix(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(dcp_writer, "_warned_uncached", type(dcp_writer._warned_uncached)())
    model, opt = _trained(2)
    with caplog.at_level(logging.WARNING, logger="gdsckpt"):
        for i in range(2):
            fut = dcp.async_save(dcp_view({"model": model}), storage_writer=GdsckptWriter(tmp_path / f"{i}", backend="cpu"))
            fut.result(30)
        dcp.async_save(dcp_view({"model": model}), storage_writer=GdsckptWriter(tmp_path / "c", backend="cpu"),
                       planner=CachedSavePlanner()).result(30)
    said = [r.getMessage() for r in caplog.records if "caches no plan" in r.getMessage()]
    assert len(said) == 1 and "gdsckpt.dcp.async_save(state, path)" in said[0] and "DefaultSavePlanner" in said[0]


def test_reserve_of_a_dcp_view_sizes_the_pool_for_its_modules_and_optimizers():
    """dcp.reserve(dcp_view(state)) (the README's recipe) reserved only loose tensors: the view's
    modules and optimizers are Statefuls, whose tensors it never saw."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    r = gdsckpt.dcp.reserve(dcp_view({"model": model, "optim": opt}), wait=True, backend="cpu",
                            chunk_bytes=64 << 10).result()
    logical = sum(p.numel() * 4 for p in model.parameters()) * 3  # parameters and two AdamW moments
    assert r.limit_bytes >= logical > 4 * (64 << 10)
