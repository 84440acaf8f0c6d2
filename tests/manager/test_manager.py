"""gdsckpt.Checkpointer on the local tier (issue 14): steps, retention, save_async, restore with
fall-back past damaged or incomplete steps, the directory lock, a full disk, SIGKILL mid-save.
The remote tier's tests, against a real S3 server, are in test_manager_remote.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import gdsckpt
from gdsckpt.errors import CheckpointLockedError, NoCheckpointError
from gdsckpt.manager.checkpointer import Checkpointer, step_name
from conftest import assert_same
from ckpt_tools import flip_chunk_byte

TESTS = Path(__file__).parents[1]
ROOT = TESTS.parent
OPTS = {"chunk_bytes": 64 << 10}


def state_for(step: int, n: int = 50_000) -> dict:
    """A small training-like state whose every tensor depends on the step."""
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(n, generator=g), "b": torch.randn(300, generator=g).to(torch.bfloat16)},
            "optim": {"step": torch.tensor(float(step)), "m": torch.randn(n // 2, generator=g)},
            "meta": {"step": step, "name": "run"}}


def corrupt_chunk(path: Path) -> None:
    flip_chunk_byte(path, 10, 0x40)


def test_steps_retention_and_restore(tmp_path):
    with Checkpointer(tmp_path, keep=2, save_options=OPTS) as ck:
        assert ck.steps() == [] and ck.latest_step() is None
        for s in (10, 20, 30, 40):
            st = ck.save(s, state_for(s))
            assert st.file_bytes > 0
        assert ck.steps() == [30, 40] and ck.latest_step() == 40
        assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == \
            [step_name(30, False), step_name(40, False)]
        r = ck.restore()
        assert r.step == 40 and r.source == "local" and r.skipped == []
        assert_same(r.state, state_for(40))
        r = ck.restore(step=30)
        assert_same(r.state, state_for(30))
        target = state_for(0)
        r = ck.restore(target)
        assert r.state is target
        for k in ("model", "optim"):
            assert_same(target[k], state_for(40)[k])
        with pytest.raises(ValueError, match="not newer"):
            ck.save(40, state_for(40))
        with pytest.raises(NoCheckpointError, match="step 10"):
            ck.restore(step=10)


def test_save_async_counts_once_committed(tmp_path):
    with Checkpointer(tmp_path, keep=3, save_options=OPTS) as ck:
        state = state_for(1)
        want = {k: {kk: (vv.clone() if isinstance(vv, torch.Tensor) else vv) for kk, vv in v.items()}
                for k, v in state.items()}
        fut = ck.save_async(1, state)
        state["model"]["w"].fill_(7)  # training goes on: not in the checkpoint
        fut.result()
        ck.wait()
        assert ck.steps() == [1]
        assert_same(ck.restore().state, want)
        ck.save_async(2, state_for(2))
        ck.save_async(3, state_for(3))  # waits for step 2 first: one at a time, in order
        ck.wait()
        assert ck.steps() == [1, 2, 3]


def test_save_async_with_optimizer_overlaps_the_snapshot(tmp_path):
    """optimizer=: save_async's overlap mode; the parameters are read until opt.step(), which
    waits for the snapshot, and the step counts once committed."""
    state = state_for(4)
    w = torch.nn.Parameter(state["model"]["w"])  # shares the state's memory, as model.state_dict() does
    opt = torch.optim.SGD([w], lr=1.0)
    want = {k: {kk: (vv.clone() if isinstance(vv, torch.Tensor) else vv) for kk, vv in v.items()}
            for k, v in state.items()}
    with Checkpointer(tmp_path, keep=3, save_options=OPTS) as ck:
        fut = ck.save_async(4, state, optimizer=opt)
        assert len(opt._optimizer_step_pre_hooks) == 1
        state["optim"]["m"].fill_(7)  # not a tensor of `opt`: copied at the call
        w.grad = torch.ones_like(w)
        opt.step()  # waits for the snapshot, then changes w in place
        assert len(opt._optimizer_step_pre_hooks) == 0 and fut.result().mode == "overlap"
        ck.wait()
        assert ck.steps() == [4]
        assert_same(ck.restore().state, want)


def test_save_options_snapshot_is_save_asyncs_alone(tmp_path):
    """save_options={"snapshot": "device"}: save_async takes the copy (optimizer= or not; no step waits
    for it), save() and reserve() take the rest of the options; a mode save_async lacks is refused at
    construction."""
    state = state_for(5)
    w = torch.nn.Parameter(state["model"]["w"])
    opt = torch.optim.SGD([w], lr=1.0)
    want = {k: {kk: (vv.clone() if isinstance(vv, torch.Tensor) else vv) for kk, vv in v.items()}
            for k, v in state.items()}
    with Checkpointer(tmp_path, keep=3, save_options={**OPTS, "snapshot": "device"}) as ck:
        assert ck.reserve(state, wait=True).result().held_bytes > 0
        assert ck.save(1, state).file_bytes > 0
        fut = ck.save_async(2, state, optimizer=opt)
        assert len(opt._optimizer_step_pre_hooks) == 0  # the copy is taken: nothing for a step to wait for
        state["model"]["w"].fill_(7)
        assert fut.result().mode == "device"
        assert ck.save_async(3, state_for(3)).result().mode == "device"
        ck.wait()
        assert ck.steps() == [1, 2, 3]
        assert_same(ck.restore(step=2).state, want)
    with pytest.raises(ValueError, match="snapshot must be one of 'host', 'overlap', 'device', not 'cpu'"):
        Checkpointer(tmp_path / "b", save_options={"snapshot": "cpu"})
    with Checkpointer(tmp_path / "b", save_options=OPTS) as ck:  # the refusal held no lock on the directory
        assert ck.steps() == []


@pytest.mark.parametrize("options, message", [
    ({"codecs": "ans"}, "'codecs' is not a save option here; these are backend, chunk_bytes, "
                        "codec, io, io_threads, ring_depth, snapshot"),
    ({"pool_bytes": 2**30}, "'pool_bytes' is not a save option here"),
    ({"codec": "lz4"}, "unknown codec 'lz4'"),
    ({"chunk_bytes": 3}, "chunk_bytes must be a positive multiple of 4096"),
    ({"io": "fast"}, "io must be one of 'auto', 'gds', 'compat', not 'fast'"),
    ({"ring_depth": 1}, "ring_depth must be at least 2"),
])
def test_bad_save_options_are_refused_when_made_holding_nothing(tmp_path, options, message):
    """Refused by the constructor, not by the first save hours into a run, and before the
    directory's lock is taken: the same directory opens at once with good options."""
    with pytest.raises(ValueError, match=re.escape(message)):
        Checkpointer(tmp_path, save_options=options)
    with Checkpointer(tmp_path, save_options=OPTS) as ck:
        ck.save(1, state_for(1))
        assert ck.steps() == [1]


def test_temporaries_and_foreign_files_do_not_count(tmp_path):
    with Checkpointer(tmp_path, save_options=OPTS) as ck:
        ck.save(5, state_for(5))
    (tmp_path / f".{step_name(9, False)}.gdsckpt-tmp.12345.abcd").write_bytes(b"x" * 5000)  # a killed save
    (tmp_path / "step_7.gdsckpt").write_bytes(b"not ours")  # not an 8-digit step name
    (tmp_path / "notes.txt").write_text("hi")
    with Checkpointer(tmp_path, save_options=OPTS) as ck:
        assert ck.steps() == [5]
        assert ck.restore().step == 5


@pytest.mark.parametrize("damage", ["corrupt-chunk", "truncated", "empty"])
def test_restore_falls_back_past_a_damaged_step(tmp_path, damage):
    with Checkpointer(tmp_path, keep=3, save_options=OPTS) as ck:
        for s in (1, 2, 3):
            ck.save(s, state_for(s))
        newest = tmp_path / step_name(3, False)
        if damage == "corrupt-chunk":
            corrupt_chunk(newest)
        elif damage == "truncated":
            os.truncate(newest, newest.stat().st_size // 2)
        else:
            os.truncate(newest, 0)
        with pytest.warns(UserWarning, match="restored step 2"):
            r = ck.restore()
        assert r.step == 2 and [s for s, _, _ in r.skipped] == [3]
        assert_same(r.state, state_for(2))
        target = state_for(0)
        with pytest.warns(UserWarning):
            r = ck.restore(target)
        assert r.step == 2
        for k in ("model", "optim"):
            assert_same(target[k], state_for(2)[k])
        with pytest.raises(NoCheckpointError, match="step 3"):
            ck.restore(step=3)  # asked for explicitly: no fall-back


def test_no_intact_step(tmp_path):
    with Checkpointer(tmp_path, save_options=OPTS) as ck:
        with pytest.raises(NoCheckpointError):
            ck.restore()
        ck.save(1, state_for(1))
        corrupt_chunk(tmp_path / step_name(1, False))
        with pytest.raises(NoCheckpointError, match="checksum"):
            ck.restore()


def test_state_mismatch_is_raised_not_skipped(tmp_path):
    with Checkpointer(tmp_path, save_options=OPTS) as ck:
        ck.save(1, state_for(1))
        ck.save(2, state_for(2))
        with pytest.raises(gdsckpt.StateMismatchError):
            ck.restore({"model": {"w": torch.zeros(3)}})


def test_two_managers_on_one_directory(tmp_path):
    ck = Checkpointer(tmp_path)
    with pytest.raises(CheckpointLockedError, match="in use by another Checkpointer"):
        Checkpointer(tmp_path)
    code = ("import sys; sys.path.insert(0, sys.argv[2]); from gdsckpt.manager.checkpointer import Checkpointer\n"
            "try:\n    Checkpointer(sys.argv[1])\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path), str(ROOT)], capture_output=True, text=True,
                       timeout=120)
    assert r.stdout.startswith("CheckpointLockedError") and f"pid {os.getpid()}" in r.stdout, r.stdout + r.stderr
    ck.close()
    Checkpointer(tmp_path).close()  # released


_FULL_DISK_CHILD = r"""
import json, os, resource, signal, sys
sys.path.insert(0, sys.argv[2]); sys.path.insert(0, sys.argv[3])
from gdsckpt.manager.checkpointer import Checkpointer
from test_manager import state_for
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
ck = Checkpointer(sys.argv[1], keep=2, save_options={"chunk_bytes": 64 << 10})
out = {}
ck.save(1, state_for(1))
ck.save(2, state_for(2))
size = os.path.getsize(os.path.join(sys.argv[1], "step_00000002.gdsckpt"))
_, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, hard))
try:
    ck.save(3, state_for(3, n=200_000))
except OSError as e:
    out["error"] = [e.errno, str(e)]
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
out["steps"] = ck.steps()
out["restored"] = ck.restore().step
ck.save(4, state_for(4))
out["after"] = ck.steps()
ck.close()
print(json.dumps(out))
"""


def test_full_disk_keeps_previous_steps(tmp_path):
    r = subprocess.run([sys.executable, "-c", _FULL_DISK_CHILD, str(tmp_path), str(ROOT), str(TESTS)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["error"][0] == 27 and "step_00000003" in out["error"][1], out  # EFBIG, naming the step's file
    assert out["steps"] == [1, 2] and out["restored"] == 2
    assert out["after"] == [2, 4]
    with Checkpointer(tmp_path) as ck:
        assert_same(ck.restore(step=2).state, state_for(2))


_KILL_CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[2]); sys.path.insert(0, sys.argv[3])
from gdsckpt.manager.checkpointer import Checkpointer
from test_manager import state_for
ck = Checkpointer(sys.argv[1], keep=2, save_options={"chunk_bytes": 64 << 10})
step = (ck.latest_step() or 0) + 1
while True:
    print("saving", step, flush=True)
    ck.save(step, state_for(step, n=400_000))
    step += 1
"""


def test_sigkill_during_save_leaves_an_intact_step(tmp_path):
    """Kill the saving process at several moments: restore() always finds an intact step, and its
    state is the one saved as that step."""
    for delay in (0.05, 0.3, 0.7, 1.1):
        p = subprocess.Popen([sys.executable, "-c", _KILL_CHILD, str(tmp_path), str(ROOT), str(TESTS)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            seen = 0
            while seen < 2:  # at least one step committed before the kill
                line = p.stdout.readline()
                assert line, p.stderr.read()
                seen += line.startswith("saving")
            time.sleep(delay)
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
        with Checkpointer(tmp_path) as ck:
            r = ck.restore()
            assert r.skipped == []
            assert_same(r.state, state_for(r.step, n=400_000))
