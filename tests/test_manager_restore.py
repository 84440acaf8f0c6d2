"""Checkpointer.restore's fall-back leaves the caller's state holding exactly the step it restored
(every chunk verified before a byte reaches the caller's tensors), past damaged file steps and
damaged DCP `.metadata` alike."""

from __future__ import annotations

import os

import pytest
import torch

import gdsckpt
from gdsckpt.manager import Checkpointer, step_name
from conftest import assert_same
from ckpt_tools import flip_chunk_byte
from test_manager import OPTS, state_for


def _with_extra(step: int) -> dict:
    s = state_for(step)
    s["extra"] = torch.full((40_000,), float(step))  # a tensor only the newer step has
    return s


@pytest.mark.parametrize("damage", ["last-chunk", "first-chunk", "truncated"])
def test_fallback_leaves_exactly_the_restored_step(tmp_path, damage):
    with Checkpointer(tmp_path, keep=3, save_options=OPTS) as ck:
        ck.save(2, state_for(2))
        ck.save(3, _with_extra(3))
        newest = tmp_path / step_name(3, False)
        with gdsckpt.open(newest) as c:
            n = len(c.index.records)
        if damage == "truncated":
            os.truncate(newest, newest.stat().st_size - 5000)  # its index and footer gone
        else:
            flip_chunk_byte(newest, 100, 0x10, chunk=n - 1 if damage == "last-chunk" else 0)
        target = _with_extra(0)
        untouched = target["extra"].clone()
        with pytest.warns(UserWarning, match="restored step 2"):
            r = ck.restore(target, strict=False)
        assert r.step == 2 and r.state is target and [s for s, _, _ in r.skipped] == [3]
        for k in ("model", "optim"):
            assert_same(target[k], state_for(2)[k])
        assert torch.equal(target["extra"], untouched)  # not a byte of step 3 in it
