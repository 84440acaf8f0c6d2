"""save_async's compressed host snapshot (issue 13), on the CPU backend and, marked gpu, on a GPU.

Every file must load bit-exact to the state at the moment of the call although the test
changes the tensors right after save_async returns (and, with overlap=True, during the next
forward/backward, before the optimizer step). The background writer is held back where a test
needs writes still pending (`held_writer`), so that what is checked cannot pass by luck of
timing: mutation while the file is being written, back-pressure of a full pool, one save in
flight, commit order, and failures surfacing on result() and at the next save_async.
"""

from __future__ import annotations

import copy
import errno
import os
import stat
import threading
import time
from concurrent.futures import wait as wait_futures
from pathlib import Path

import pytest
import torch

import gdsckpt
from gdsckpt.writing import async_save as am
from gdsckpt.core import defaults
from gdsckpt.writing import background_writer as bw
from gdsckpt.writing.snapshot import host as hs
from gdsckpt.writing.snapshot import overlap
from gdsckpt.engine import pinned_pool as pp
from gdsckpt.core import storage
from conftest import SlowSnapshot, all_dtype_tensors, assert_same, same, tensors_of


def _state(seed: int, n: int = 200_000) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(n, generator=g), "b": torch.randn(700, generator=g).to(torch.bfloat16),
                      "ids": torch.randint(-50, 50, (3000,), generator=g)},
            "dtypes": all_dtype_tensors(n=300, seed=seed), "step": seed, "lr": [0.1 * seed, None, "cos"]}


def _clone(state):
    return copy.deepcopy(state)


def _mutate(state) -> None:
    for t in tensors_of(state):
        if t.numel():
            t.reshape(-1).view(torch.uint8).bitwise_not_()  # every byte changes, whatever the dtype



def _leftovers(directory) -> list:
    return [n for n in os.listdir(directory) if ".gdsckpt-tmp." in n]


pytestmark = pytest.mark.usefixtures("no_save_in_flight")


class HeldWriter:
    """Holds every chunk write of the background writer until `release()`, and records each
    file's write span and commit, in order."""

    def __init__(self, monkeypatch, hold: bool = True, delay: float = 0.0):
        self.gate = threading.Event()
        if not hold:
            self.gate.set()
        self.delay = delay
        self.commits: list[str] = []
        self.spans: list[tuple[str, float, float]] = []
        real_write, real_job = bw._write_extent, bw.write_job

        def write_extent(*a, **kw):
            assert self.gate.wait(30), "the test never released the writer"
            time.sleep(self.delay)
            return real_write(*a, **kw)

        def write_job(job):
            t = time.perf_counter()
            real_job(job)
            self.spans.append((str(job.path), t, time.perf_counter()))
            if job.done.exception() is None:  # committed: write_job commits before it returns
                self.commits.append(str(job.path))

        monkeypatch.setattr(bw, "_write_extent", write_extent)
        monkeypatch.setattr(bw, "write_job", write_job)

    def release(self):
        self.gate.set()


SMALL = dict(backend="cpu", chunk_bytes=64 << 10)  # many chunks from a small state


# ---------------------------------------------------------------- mutation after return


def test_state_may_change_as_soon_as_save_async_returns(tmp_path, monkeypatch):
    held = HeldWriter(monkeypatch)
    state = _state(1)
    want = _clone(state)
    fut = gdsckpt.save_async(state, tmp_path / "a.gdsckpt", **SMALL)
    assert not fut.done()  # not a byte of a chunk written yet: everything is in the pool
    _mutate(state)
    state["step"] = -1
    state["lr"].append(9.9)
    held.release()
    stats = fut.result(30)
    assert_same(gdsckpt.load(tmp_path / "a.gdsckpt"), want)
    assert isinstance(stats, gdsckpt.Stats) and isinstance(stats, am.AsyncStats)
    assert stats.op == "save" and stats.mode == "host" and stats.chunks > 10
    assert stats.io_path in ("pool-direct", "pool-buffered")
    assert stats.file_bytes == (tmp_path / "a.gdsckpt").stat().st_size
    assert 0 < stats.blocked_s <= stats.seconds and stats.snapshot_s <= stats.blocked_s
    assert stats.background_s > 0 and stats.write_s > 0
    # the pool held stored bytes (each record rounded up to 4 KiB), not the logical ones
    assert stats.stored_bytes <= stats.pool_peak_bytes <= stats.stored_bytes + stats.chunks * 4096
    assert stats.pool_bytes <= stats.pool_limit_bytes
    assert gdsckpt.open(tmp_path / "a.gdsckpt").metadata["writer"]["io_path"] == "pool"
    assert _leftovers(tmp_path) == []
    assert pp.pools()["cpu"]["in_use_bytes"] == 0


def test_the_pool_is_reused(tmp_path):
    first = gdsckpt.save_async(_state(2), tmp_path / "a.gdsckpt", **SMALL).result(30)
    second = gdsckpt.save_async(_state(3), tmp_path / "b.gdsckpt", **SMALL).result(30)
    assert first.pool_bytes > 0 and first.pool_alloc_s > 0
    assert second.pool_bytes == first.pool_bytes and second.pool_alloc_s == 0
    assert_same(gdsckpt.load(tmp_path / "b.gdsckpt"), _state(3))


def test_direct_io_and_its_fallbacks_write_the_same_file(tmp_path, monkeypatch):
    state = _state(4)
    a = gdsckpt.save_async(state, tmp_path / "a.gdsckpt", **SMALL).result(30)
    monkeypatch.setattr(bw, "open_direct", lambda tmp: -1)  # a file system that refuses O_DIRECT at open
    b = gdsckpt.save_async(state, tmp_path / "b.gdsckpt", **SMALL).result(30)
    assert b.io_path == "pool-buffered" and not b.direct_io
    monkeypatch.undo()
    real = storage.pwritev_all
    refused = []

    def refuse_direct(fd, views, offset):  # accepted at open, refused at the first write
        if not refused:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, views, offset)

    monkeypatch.setattr(storage, "pwritev_all", refuse_direct)  # what pwrite_direct writes through
    c = gdsckpt.save_async(state, tmp_path / "c.gdsckpt", **SMALL).result(30)
    for name in ("a", "b", "c"):
        assert_same(gdsckpt.load(tmp_path / f"{name}.gdsckpt"), state)
    if a.direct_io:  # the file system here takes O_DIRECT: the EINVAL fell back to buffered writes
        assert not c.direct_io
    data = [(tmp_path / f"{n}.gdsckpt").read_bytes() for n in "abc"]
    assert len({len(d) for d in data}) == 1  # same layout; only the index's creation time may differ


# ---------------------------------------------------------------- the pool's bound and back-pressure


def test_a_full_pool_makes_the_next_snapshot_wait_and_says_so(tmp_path, monkeypatch):
    one = gdsckpt.save_async(_state(5), tmp_path / "x.gdsckpt", **SMALL).result(30)
    bound = one.stored_bytes + one.chunks * 4096  # room for one state's records (each rounded up to 4 KiB), not two
    held = HeldWriter(monkeypatch)
    first_state, second_state = _state(5), _state(6)
    want_first, want_second = _clone(first_state), _clone(second_state)
    first = gdsckpt.save_async(first_state, tmp_path / "a.gdsckpt", pool_bytes=bound, **SMALL)
    assert not first.done()
    got: list = []
    t = threading.Thread(target=lambda: got.append(
        gdsckpt.save_async(second_state, tmp_path / "b.gdsckpt", pool_bytes=bound, **SMALL)))
    t.start()
    time.sleep(0.5)
    assert t.is_alive()  # the pool is full of the first save's bytes: the second snapshot waits
    _mutate(first_state)
    held.release()
    t.join(30)
    assert not t.is_alive()
    _mutate(second_state)
    s1, s2 = first.result(30), got[0].result(30)
    assert_same(gdsckpt.load(tmp_path / "a.gdsckpt"), want_first)
    assert_same(gdsckpt.load(tmp_path / "b.gdsckpt"), want_second)
    assert s2.pool_waits >= 1 and s2.pool_wait_s >= 0.3
    assert s2.blocked_s >= s2.pool_wait_s  # the wait is blocked time
    for s in (s1, s2):
        assert s.pool_peak_bytes <= s.pool_limit_bytes == bound
        assert s.pool_bytes <= bound


def test_a_bound_below_one_state_streams_through_the_pool(tmp_path, monkeypatch):
    HeldWriter(monkeypatch, hold=False, delay=0.01)  # a slow disk
    state = _state(7, n=400_000)
    want = _clone(state)
    stats = gdsckpt.save_async(state, tmp_path / "a.gdsckpt", pool_bytes=256 << 10, **SMALL).result(60)
    assert_same(gdsckpt.load(tmp_path / "a.gdsckpt"), want)
    assert stats.stored_bytes > 4 * (256 << 10)
    assert stats.pool_waits > 0 and stats.pool_peak_bytes <= 256 << 10
    assert stats.blocked_s >= stats.pool_wait_s > 0


def test_a_bound_below_one_chunk_is_raised_to_one_chunk(tmp_path):
    stats = gdsckpt.save_async(_state(8), tmp_path / "a.gdsckpt", pool_bytes=1, **SMALL).result(30)
    assert stats.pool_limit_bytes == 64 << 10
    assert_same(gdsckpt.load(tmp_path / "a.gdsckpt"), _state(8))


# ---------------------------------------------------------------- overlap=True and the optimizer hook


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt)
    return model, opt


def _train_step(model, opt, backward_only: bool = False):
    x = torch.randn(16, 32)
    model(x).square().mean().backward()  # forward updates BatchNorm's running statistics
    if not backward_only:
        opt.step()
        opt.zero_grad()


def _ckpt(model, opt, step: int) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


def test_what_only_the_step_changes_is_read_in_place_and_the_rest_copied():
    """freeze_for_overlap keeps the optimizer's parameters (through state_dict()'s views) and its
    state (the objects themselves, or any view of their memory) and copies everything else."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    moments = opt.state[model[0].weight]
    leaves = [*model.state_dict().values(), moments["exp_avg"], moments["exp_avg_sq"][1:],
              moments["exp_avg"].view(-1), torch.zeros(2), torch.empty(0)]
    owned = overlap.StepOwned(opt)
    kept = [t in owned for t in leaves]
    # weight, bias, the BatchNorm's weight and bias: parameters; its running stats and count: not
    assert kept == [True, True, True, True, False, False, False, True, True, True, False, False]
    assert owned.gpu() is None
    frozen = overlap.freeze_for_overlap(leaves, opt)
    assert [f is t for f, t in zip(frozen, leaves)] == kept
    assert all(torch.equal(f, t) for f, t in zip(frozen, leaves))


def test_overlap_snapshot_runs_during_forward_backward_and_the_step_waits(tmp_path, monkeypatch):
    model, opt = _model_and_optimizer()
    state = _ckpt(model, opt, 1)
    want = _clone(state)
    slow = SlowSnapshot(monkeypatch)
    fut = gdsckpt.save_async(state, tmp_path / "a.gdsckpt", overlap=True, optimizer=opt, **SMALL)
    assert slow.started.wait(10) and not fut.done()  # returned while the snapshot is still running
    assert len(opt._optimizer_step_pre_hooks) == 1
    _train_step(model, opt, backward_only=True)  # forward changes BatchNorm's buffers: copied at the call
    model[1].running_mean.add_(100.0)
    state["step"] = 2
    threading.Timer(0.4, slow.gate.set).start()
    t = time.perf_counter()
    opt.step()  # the pre-hook waits for the snapshot before AdamW changes a parameter
    waited = time.perf_counter() - t
    assert slow.gate.is_set() and waited >= 0.3
    assert len(opt._optimizer_step_pre_hooks) == 0  # removed by itself (it was the last pre-hook)
    stats = fut.result(30)
    assert_same(gdsckpt.load(tmp_path / "a.gdsckpt"), want)
    assert stats.mode == "overlap" and stats.hook_wait_s >= 0.3
    assert stats.blocked_s < waited  # save_async itself returned before the snapshot was done
    opt.step()  # later steps do not wait
    assert stats.hook_wait_s < waited + 0.1


def test_wait_false_refuses_at_once_while_an_overlapped_snapshot_runs(tmp_path, monkeypatch):
    model, opt = _model_and_optimizer()
    slow = SlowSnapshot(monkeypatch)
    fut = gdsckpt.save_async(_ckpt(model, opt, 1), tmp_path / "a.gdsckpt", overlap=True, optimizer=opt, **SMALL)
    assert slow.started.wait(10)
    t = time.perf_counter()
    with pytest.raises(gdsckpt.SaveInFlightError, match="still in flight"):
        gdsckpt.save_async(_ckpt(model, opt, 2), tmp_path / "b.gdsckpt", wait=False, **SMALL)
    assert time.perf_counter() - t < 5 and not slow.gate.is_set()  # refused, not after the snapshot ended
    slow.gate.set()
    fut.result(30)
    assert not (tmp_path / "b.gdsckpt").exists()


def test_overlap_hook_behind_another_hook_is_removed_after_the_step(tmp_path, monkeypatch):
    model, opt = _model_and_optimizer(1)
    state = _ckpt(model, opt, 1)
    want = _clone(state)
    slow = SlowSnapshot(monkeypatch)
    fut = gdsckpt.save_async(state, tmp_path / "a.gdsckpt", overlap=True, optimizer=opt, **SMALL)
    calls = []
    theirs = opt.register_step_pre_hook(lambda *a: calls.append(1))  # after ours: ours cannot remove itself
    _train_step(model, opt, backward_only=True)
    threading.Timer(0.2, slow.gate.set).start()
    opt.step()
    assert calls == [1]
    assert list(opt._optimizer_step_pre_hooks) == [theirs.id]  # ours went, by a post-hook, after the step
    fut.result(30)
    assert_same(gdsckpt.load(tmp_path / "a.gdsckpt"), want)
    monkeypatch.undo()
    gdsckpt.save_async(_ckpt(model, opt, 2), tmp_path / "b.gdsckpt", **SMALL).result(30)
    assert len(opt._optimizer_step_post_hooks) == 0  # that post-hook: removed by the next save_async
    theirs.remove()


def test_overlap_without_a_step_then_save_again(tmp_path):
    model, opt = _model_and_optimizer(2)
    a = _clone(_ckpt(model, opt, 1))
    fut = gdsckpt.save_async(_ckpt(model, opt, 1), tmp_path / "a.gdsckpt", overlap=True, optimizer=opt, **SMALL)
    fut2 = gdsckpt.save_async(_ckpt(model, opt, 1), tmp_path / "b.gdsckpt", overlap=True, optimizer=opt, **SMALL)
    assert len(opt._optimizer_step_pre_hooks) == 1  # the first's hook went when the second call took over
    fut.result(30)
    fut2.result(30)
    _train_step(model, opt)
    assert len(opt._optimizer_step_pre_hooks) == 0
    for name in "ab":
        assert_same(gdsckpt.load(tmp_path / f"{name}.gdsckpt"), a)


def test_bad_options_are_value_errors(tmp_path):
    model, opt = _model_and_optimizer()
    st = _ckpt(model, opt, 1)
    with pytest.raises(ValueError, match="optimizer="):
        gdsckpt.save_async(st, tmp_path / "a.gdsckpt", overlap=True)
    with pytest.raises(ValueError, match="host snapshot"):
        gdsckpt.save_async(st, tmp_path / "a.gdsckpt", overlap=True, optimizer=opt, snapshot="device")
    with pytest.raises(ValueError, match="snapshot must be"):
        gdsckpt.save_async(st, tmp_path / "a.gdsckpt", snapshot="gpu")
    with pytest.raises(ValueError, match="pool_bytes"):
        gdsckpt.save_async(st, tmp_path / "a.gdsckpt", pool_bytes=0)
    with pytest.raises(ValueError, match="optimizer= must be"):
        gdsckpt.save_async(st, tmp_path / "a.gdsckpt", overlap=True, optimizer=object())
    for host in ({}, {"snapshot": "host"}):  # an optimizer the host snapshot would not use, as GdsckptWriter refuses it
        with pytest.raises(ValueError, match="optimizer= is for snapshot='overlap'.*pass snapshot='overlap', or no"):
            gdsckpt.save_async(st, tmp_path / "a.gdsckpt", optimizer=opt, **host)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- failures


def _enospc(monkeypatch):
    def full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "pwritev", full)


def test_a_background_failure_surfaces_on_result_and_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    p = tmp_path / "ck.gdsckpt"
    gdsckpt.save(_state(10), p)
    _enospc(monkeypatch)
    fut = gdsckpt.save_async(_state(11), p, **SMALL)
    with pytest.raises(OSError) as info:
        fut.result(30)
    assert info.value.errno == errno.ENOSPC and str(p) in str(info.value)
    assert_same(gdsckpt.load(p), _state(10))  # the previous checkpoint is intact
    assert _leftovers(tmp_path) == []
    monkeypatch.undo()
    # result() saw it: the next save_async goes ahead
    gdsckpt.save_async(_state(12), p, **SMALL).result(30)
    assert_same(gdsckpt.load(p), _state(12))
    assert pp.pools()["cpu"]["in_use_bytes"] == 0


def test_an_unseen_background_failure_is_raised_by_the_next_save_async(tmp_path, monkeypatch):
    p, q = tmp_path / "ck.gdsckpt", tmp_path / "other.gdsckpt"
    gdsckpt.save(_state(13), p)
    _enospc(monkeypatch)
    fut = gdsckpt.save_async(_state(14), p, **SMALL)
    wait_futures([fut], timeout=30)  # done, but nobody called result() or exception()
    monkeypatch.undo()
    with pytest.raises(gdsckpt.BackgroundSaveError, match="ck.gdsckpt") as info:
        gdsckpt.save_async(_state(15), q, **SMALL)
    assert info.value.path == str(p)
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert not q.exists()  # that call did not save
    assert_same(gdsckpt.load(p), _state(13))
    with pytest.raises(OSError):  # the future still says what happened
        fut.result()
    gdsckpt.save_async(_state(15), q, **SMALL).result(30)  # raised once: the next call saves
    assert_same(gdsckpt.load(q), _state(15))


def test_a_failure_in_the_snapshot_is_raised_by_the_call_and_leaves_nothing(tmp_path, monkeypatch):
    p = tmp_path / "ck.gdsckpt"
    gdsckpt.save(_state(16), p)
    real, calls = hs.PoolFile.pwrite, []

    def failing(file, *a):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("injected in the snapshot")
        return real(file, *a)

    monkeypatch.setattr(hs.PoolFile, "pwrite", failing)
    with pytest.raises(RuntimeError, match="injected"):
        gdsckpt.save_async(_state(17), p, **SMALL)
    monkeypatch.undo()
    deadline = time.time() + 10
    while (_leftovers(tmp_path) or pp.pools()["cpu"]["in_use_bytes"]) and time.time() < deadline:
        time.sleep(0.01)  # the writer drops the aborted file
    assert _leftovers(tmp_path) == [] and pp.pools()["cpu"]["in_use_bytes"] == 0
    assert_same(gdsckpt.load(p), _state(16))
    gdsckpt.save_async(_state(18), p, **SMALL).result(30)  # not reported again: the caller saw it
    assert_same(gdsckpt.load(p), _state(18))


def _to(state, device):
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return {k: _to(v, device) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to(v, device) for v in state)
    return state


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError], ids=["ctrl-c", "exception"])
def test_an_interrupted_host_copy_gives_its_room_back(tmp_path, monkeypatch, device, error):
    """Issue 20, finding 6: an exception or Ctrl-C in save_async's host copy, after the pool had
    reserved room for the chunk, left that room reserved for nobody: every later save that
    needed it waited forever. Now the room goes back with the error, KeyboardInterrupt included,
    and a save bounded to a single chunk's room runs at once."""
    opts = SMALL if device == "cpu" else dict(chunk_bytes=64 << 10)
    monkeypatch.setattr(defaults, "FIRST_SAVE_COPY_FREE_FRACTION", 0)  # the copy into the pool in the call
    pool = "cpu" if device == "cpu" else f"cuda:{torch.cuda.current_device()}"
    p = tmp_path / "ck.gdsckpt"
    gdsckpt.save(_state(50), p)
    real, calls = pp.Extent.tensors, []

    def tensors(extent, nbytes):  # the copy into the reserved extent: the third chunk's fails
        calls.append(1)
        if len(calls) == 3:
            raise error("injected in the host copy")
        return real(extent, nbytes)

    monkeypatch.setattr(pp.Extent, "tensors", tensors)
    with pytest.raises(error, match="injected"):
        gdsckpt.save_async(_to(_state(51), device), p, **opts)
    monkeypatch.undo()
    assert len(calls) == 3
    deadline = time.time() + 10
    while (pp.pools()[pool]["in_use_bytes"] or _leftovers(tmp_path)) and time.time() < deadline:
        time.sleep(0.01)  # the writer drops the aborted file and frees the records it was handed
    assert pp.pools()[pool]["in_use_bytes"] == 0, "room reserved before the failure was never given back"
    assert _leftovers(tmp_path) == []
    assert_same(gdsckpt.load(p), _state(50))

    done: list = []
    later = threading.Thread(daemon=True, target=lambda: done.append(
        gdsckpt.save_async(_to(_state(52), device), p, pool_bytes=1, **opts).result(30)))
    later.start()
    later.join(60)
    assert not later.is_alive(), "a later save_async waited for room the failed one never gave back"
    assert done and done[0].pool_limit_bytes == 64 << 10
    assert_same(gdsckpt.load(p), _state(52))


def test_a_failure_in_an_overlap_snapshot_surfaces_on_result_and_next_call(tmp_path, monkeypatch):
    model, opt = _model_and_optimizer(3)
    monkeypatch.setattr(hs.PoolFile, "pwrite", lambda *a: (_ for _ in ()).throw(RuntimeError("injected")))
    fut = gdsckpt.save_async(_ckpt(model, opt, 1), tmp_path / "a.gdsckpt", overlap=True, optimizer=opt, **SMALL)
    _train_step(model, opt)  # the hook does not raise into the training loop
    wait_futures([fut], timeout=30)
    monkeypatch.undo()
    with pytest.raises(gdsckpt.BackgroundSaveError, match="a.gdsckpt"):
        gdsckpt.save_async(_ckpt(model, opt, 2), tmp_path / "b.gdsckpt", **SMALL)
    with pytest.raises(RuntimeError, match="injected"):
        fut.result()
    assert not (tmp_path / "a.gdsckpt").exists()


# ---------------------------------------------------------------- one in flight, commit order


def test_snapshots_queue_behind_writes_and_commit_in_call_order(tmp_path, monkeypatch):
    held = HeldWriter(monkeypatch)
    p, q = tmp_path / "p.gdsckpt", tmp_path / "q.gdsckpt"
    states = [_state(20), _state(21), _state(22)]
    wants = [_clone(s) for s in states]
    futs = []
    for s, path in zip(states, (p, q, p)):
        # a pool with room for all three: none of the snapshots waits for the disk
        futs.append(gdsckpt.save_async(s, path, pool_bytes=16 << 20, **SMALL))
        _mutate(s)
    assert not held.gate.is_set() and not any(f.done() for f in futs)
    with pytest.raises(gdsckpt.SaveInFlightError, match="still in flight"):
        gdsckpt.save_async(_state(23), q, wait=False, **SMALL)
    held.release()
    for f in futs:
        f.result(30)
    assert held.commits == [str(p), str(q), str(p)]
    spans = sorted((t0, t1) for _, t0, t1 in held.spans)
    assert all(a1 <= b0 for (_, a1), (b0, _) in zip(spans, spans[1:]))  # one file at a time
    assert_same(gdsckpt.load(p), wants[2])
    assert_same(gdsckpt.load(q), wants[1])
    gdsckpt.save_async(_state(23), q, wait=False, **SMALL).result(30)  # nothing in flight now


def test_a_save_to_a_path_waits_for_a_save_async_to_it_in_flight(tmp_path, monkeypatch):
    """save_async(p) then save(p) of a newer state (a preemption handler's last save): the save
    waits for the older snapshot's commit, so p holds the newer state; the older commit used to be
    renamed over the file the save had called durable. A save to another path does not wait."""
    held = HeldWriter(monkeypatch)
    p = tmp_path / "last.gdsckpt"
    state = _state(30)
    fut = gdsckpt.save_async(state, p, **SMALL)
    _mutate(state)
    newer = _clone(state)
    gdsckpt.save(state, tmp_path / "other.gdsckpt", backend="cpu")  # another path: no wait
    done = threading.Event()
    saver = threading.Thread(target=lambda: (gdsckpt.save(state, p, backend="cpu"), done.set()))
    saver.start()
    assert not done.wait(0.5)  # held behind the save_async's commit
    held.release()
    saver.join(30)
    assert done.is_set() and fut.done()
    fut.result()
    assert_same(gdsckpt.load(p), newer)


_EXITS_AFTER_SAVE_ASYNC = r"""
import sys, torch, gdsckpt
mode, path, reference, device = sys.argv[1:]
torch.manual_seed(0)
m = torch.nn.Linear(512, 512, device=device)
opt = torch.optim.AdamW(m.parameters())
m(torch.randn(4, 512, device=device)).sum().backward(); opt.step()
gdsckpt.save({"m": m, "o": opt}, reference)
gdsckpt.save_async({"m": m, "o": opt}, path, snapshot=mode, **({"optimizer": opt} if mode == "overlap" else {}))
"""  # ... and the script ends, its future never looked at


@pytest.mark.parametrize("mode", ["overlap", "device", "host"])
def test_a_save_async_the_process_exits_after_is_committed(tmp_path, mode):
    _exits_after_save_async(tmp_path, mode, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["overlap", "device", "host"])
def test_gpu_a_save_async_the_process_exits_after_is_committed(tmp_path, mode):
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    _exits_after_save_async(tmp_path, mode, "cuda")


def _exits_after_save_async(tmp_path, mode: str, device: str) -> None:
    """A script whose last line is save_async (no result()): the interpreter finishes the save
    before it exits, in every snapshot mode. The overlap and device modes' snapshot runs on a
    thread of its own, which failed in its codec pool once the interpreter's exit had stopped the
    thread pools: the file was never written, and the exit code was 0."""
    import subprocess
    import sys
    p, ref = tmp_path / "p.gdsckpt", tmp_path / "ref.gdsckpt"
    path = [str(Path(gdsckpt.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)))
    done = subprocess.run([sys.executable, "-c", _EXITS_AFTER_SAVE_ASYNC, mode, str(p), str(ref), device], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert_same(gdsckpt.load(p), gdsckpt.load(ref))


def test_calls_from_two_threads_are_serialized(tmp_path, monkeypatch):
    held = HeldWriter(monkeypatch, hold=False)
    p = tmp_path / "p.gdsckpt"
    futs = []
    threads = [threading.Thread(target=lambda s=s: futs.append(gdsckpt.save_async(_state(s), p, **SMALL)))
               for s in (30, 31)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for f in futs:
        f.result(30)
    assert held.commits == [str(p), str(p)]
    spans = sorted((t0, t1) for _, t0, t1 in held.spans)
    assert spans[0][1] <= spans[1][0]
    got = gdsckpt.load(p)
    assert any(same(got, _state(s)) for s in (30, 31))


def test_device_mode_copies_returns_and_writes_in_call_order(tmp_path, monkeypatch):
    """snapshot="device": the call copies the state and returns without waiting for earlier
    files to be written (it waits only for the earlier snapshot); the compressed snapshot is taken
    from the copy in the background, through the pool, and files commit in call order."""
    held = HeldWriter(monkeypatch)
    p, q = tmp_path / "p.gdsckpt", tmp_path / "q.gdsckpt"
    first = gdsckpt.save_async(_state(40), p, pool_bytes=16 << 20, **SMALL)
    state = _state(41)
    want = _clone(state)
    second = gdsckpt.save_async(state, q, snapshot="device", pool_bytes=16 << 20, **SMALL)
    _mutate(state)  # the call's copy is what gets saved
    third = gdsckpt.save_async(_state(42), p, pool_bytes=16 << 20, **SMALL)
    assert not any(f.done() for f in (first, second, third))  # nothing written yet, nobody waited for it
    held.release()
    s1, s2, s3 = (f.result(30) for f in (first, second, third))
    assert held.commits == [str(p), str(q), str(p)]
    assert (s1.mode, s2.mode, s3.mode) == ("host", "device", "host")
    assert s2.pool_bytes >= s2.stored_bytes  # through the pool, as the host snapshot
    assert_same(gdsckpt.load(q), want)
    assert_same(gdsckpt.load(p), _state(42))


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_snapshot_bit_exact_after_mutation_and_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(defaults, "FIRST_SAVE_COPY_FREE_FRACTION", 0)  # the snapshot in the call, into the pool
    held = HeldWriter(monkeypatch)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    state = {"w": torch.randn(160 << 20, device=dev, generator=g),  # 640 MiB fp32
             "h": torch.randn(8 << 20, device=dev, generator=g).to(torch.bfloat16),
             "small": {k: v.to(dev) for k, v in all_dtype_tensors(n=1000).items()},
             "step": torch.tensor(7.0)}  # a CPU tensor, as AdamW keeps its step
    want = {k: _clone(v) for k, v in state.items()}
    torch.cuda.synchronize()
    fut = gdsckpt.save_async(state, tmp_path / "a.gdsckpt", chunk_bytes=32 << 20)
    for t in tensors_of(state):  # queued on the current stream right after the call
        if t.numel():
            t.reshape(-1).view(torch.uint8).bitwise_not_()
    held.release()
    stats = fut.result(60)
    assert_same(gdsckpt.load(tmp_path / "a.gdsckpt"), want)
    assert stats.backend == "gpu" and stats.mode == "host" and stats.memory["pinned_host_bytes"] > 0
    # extra GPU memory: the ring (and nvCOMP's scratch), never a copy of the 656 MiB state
    assert stats.memory["peak_extra_gpu_bytes"] <= stats.memory["ring_gpu_bytes"] + (256 << 20) < stats.logical_bytes
    assert stats.pool_bytes <= 1.05 * stats.stored_bytes + (64 << 20)


@pytest.mark.gpu
@pytest.mark.parametrize("first_copy", [False, True], ids=["pool-there", "pool-empty"])
def test_gpu_overlap_with_adamw(tmp_path, monkeypatch, first_copy):
    """The overlapped snapshot runs beside the next forward/backward and the step waits for it;
    a save that finds the pool empty copies the state instead, and no step waits."""
    if not first_copy:
        monkeypatch.setattr(defaults, "FIRST_SAVE_COPY_FREE_FRACTION", 0)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.BatchNorm1d(1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 256)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256, device=dev)
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    want = _clone(state)
    fut = gdsckpt.save_async(state, tmp_path / "a.gdsckpt", overlap=True, optimizer=opt, chunk_bytes=1 << 20)
    assert len(opt._optimizer_step_pre_hooks) == (0 if first_copy else 1)
    model(x).square().mean().backward()  # runs with the snapshot; BatchNorm's buffers were copied
    opt.step()  # waits for the snapshot
    opt.zero_grad()
    stats = fut.result(60)
    assert len(opt._optimizer_step_pre_hooks) == 0
    assert (stats.device_copy_bytes > 0) == first_copy and stats.mode == "overlap"
    assert_same(gdsckpt.load(tmp_path / "a.gdsckpt"), want)


@pytest.mark.gpu
def test_gpu_first_save_copies_the_state_on_the_gpu_and_grows_the_pool_off_the_call(tmp_path):
    """A save_async that finds its GPU's pool empty copies the state on the GPU (a block outside
    torch's cache), returns, and takes the compressed snapshot from the copy on a background
    thread, growing the pool there: the file is the state at the call although the state changes
    right after it, the copy's memory goes back to the device, and the next save finds the pool."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    state = {"w": torch.randn(64 << 20, device=dev, generator=g),  # 256 MiB fp32
             "h": torch.randn(4 << 20, device=dev, generator=g).to(torch.bfloat16),
             "small": {k: v.to(dev) for k, v in all_dtype_tensors(n=1000).items()},
             "empty": torch.empty(0, 3, device=dev), "step": torch.tensor(7.0)}
    want = {k: _clone(v) for k, v in state.items()}
    gpu_bytes = sum(t.nbytes for t in tensors_of(state) if t.is_cuda)
    pp.release_pools()
    torch.cuda.synchronize()
    free0, reserved0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
    fut = gdsckpt.save_async(state, tmp_path / "a.gdsckpt", chunk_bytes=32 << 20)
    for t in tensors_of(state):  # queued on the current stream right after the call
        if t.numel():
            t.reshape(-1).view(torch.uint8).bitwise_not_()
    first = fut.result(60)
    assert first.mode == "host" and gpu_bytes <= first.device_copy_bytes < gpu_bytes + 64 * 256
    assert first.pool_alloc_s > 0 and first.pool_bytes >= first.stored_bytes
    assert_same(gdsckpt.load(tmp_path / "a.gdsckpt"), want)
    torch.cuda.synchronize()
    kept = free0 - torch.cuda.mem_get_info()[0] - (torch.cuda.memory_reserved() - reserved0)
    assert kept < gpu_bytes // 2, f"{kept} bytes of device memory not given back after the first save"
    second = gdsckpt.save_async(state, tmp_path / "b.gdsckpt", chunk_bytes=32 << 20).result(60)
    assert second.device_copy_bytes == 0 and second.pool_alloc_s == 0.0
    assert_same(gdsckpt.load(tmp_path / "b.gdsckpt"), state)


@pytest.mark.gpu
@pytest.mark.parametrize("fraction", [0, 1e-9], ids=["off", "no-room"])
def test_gpu_first_save_takes_no_copy_when_turned_off_or_without_room(tmp_path, monkeypatch, fraction):
    monkeypatch.setattr(defaults, "FIRST_SAVE_COPY_FREE_FRACTION", fraction)
    state = {"w": torch.randn(1 << 20, device="cuda")}
    pp.release_pools()
    stats = gdsckpt.save_async(state, tmp_path / "a.gdsckpt").result(60)
    assert stats.device_copy_bytes == 0 and stats.pool_alloc_s > 0
    assert_same(gdsckpt.load(tmp_path / "a.gdsckpt"), state)


@pytest.mark.gpu
def test_gpu_device_mode_copies_every_save_and_lets_the_copy_go(tmp_path, monkeypatch):
    """snapshot="device" copies the state on the GPU in every save, whatever the pool holds, and
    returns; the copy (from torch's cache) is let go once the background snapshot has it in the
    pool, not when the file is written; where torch has no room, the host snapshot runs in the call."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(2)
    state = {"w": torch.randn(32 << 20, device=dev, generator=g),  # 128 MiB fp32
             "h": torch.randn(1 << 20, device=dev, generator=g).to(torch.bfloat16), "step": 3}
    gpu_bytes = sum(t.nbytes for t in tensors_of(state))
    gdsckpt.save_async(state, tmp_path / "warm.gdsckpt").result(60)  # the pool is there now
    for i in range(2):
        held = HeldWriter(monkeypatch)  # the file is not written until released
        want = {k: _clone(v) for k, v in state.items()}
        torch.cuda.synchronize()
        allocated0 = torch.cuda.memory_allocated()
        fut = gdsckpt.save_async(state, tmp_path / f"d{i}.gdsckpt", snapshot="device")
        state["w"].mul_(-1)  # queued on the current stream right after the call
        state["h"].zero_()
        assert overlap.wait_for_snapshot(60) and not fut.done()
        assert torch.cuda.memory_allocated() - allocated0 < gpu_bytes // 2  # the copy let go before the write
        held.release()
        stats = fut.result(60)
        assert stats.mode == "device" and stats.device_copy_bytes >= gpu_bytes
        assert stats.pool_alloc_s == 0.0 and stats.pool_bytes >= stats.stored_bytes
        assert_same(gdsckpt.load(tmp_path / f"d{i}.gdsckpt"), want)
        monkeypatch.undo()

    def refused(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")
    monkeypatch.setattr(am, "snapshot_tensors", refused)
    want = {k: _clone(v) for k, v in state.items()}
    stats = gdsckpt.save_async(state, tmp_path / "host.gdsckpt", snapshot="device").result(60)
    assert stats.mode == "host" and stats.device_copy_bytes == 0
    assert_same(gdsckpt.load(tmp_path / "host.gdsckpt"), want)


def test_save_async_writes_through_a_symlink_and_keeps_the_mode(tmp_path):
    """The paths contract of `save` holds for save_async too: the link stays and its target is
    replaced; a replaced 0600 checkpoint stays 0600; a directory is refused before any copy."""
    real = tmp_path / "real.gdsckpt"
    gdsckpt.save({"w": torch.zeros(8)}, real)
    os.chmod(real, 0o600)
    link = tmp_path / "latest.gdsckpt"
    link.symlink_to(real)
    state = {"w": torch.arange(64, dtype=torch.float32)}
    gdsckpt.save_async(state, link).result()
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert stat.S_IMODE(os.stat(real).st_mode) == 0o600
    assert torch.equal(gdsckpt.load(real)["w"], state["w"])
    with pytest.raises(IsADirectoryError, match=str(tmp_path)):
        gdsckpt.save_async(state, tmp_path)
