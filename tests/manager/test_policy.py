"""The Checkpointer's options (gdsckpt/manager/policy.py): ints only, validated once at construction,
with fixed messages; a step number is an int wherever it is taken."""

from __future__ import annotations

import numpy as np
import pytest

from gdsckpt.errors import NoCheckpointError
from gdsckpt.manager.checkpointer import Checkpointer
from gdsckpt.manager.policy import Policy
from test_manager import OPTS, state_for


@pytest.mark.parametrize("name", ["keep", "keep_remote", "every_remote"])
@pytest.mark.parametrize("value", [1.5, 2.0, True, "2", [2]])
def test_options_must_be_ints(tmp_path, name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be an int, got {type(value).__name__} "):
        Checkpointer(tmp_path, **{name: value})
    assert list(tmp_path.iterdir()) == []  # refused before anything was created


@pytest.mark.parametrize("name,value,why", [("keep", 0, "the newest step is never deleted"),
                                            ("keep_remote", 0, "or None: all"), ("every_remote", -1, None)])
def test_options_ranges(name, value, why):
    msg = f"{name} must be at least 1" + (f" ({why})" if why else "") + f", got {value}"
    with pytest.raises(ValueError) as e:
        Policy(**{name: value})
    assert str(e.value) == msg


def test_numpy_ints_are_ints():
    p = Policy(keep=np.int64(2), keep_remote=None, every_remote=np.int32(3))
    assert p == Policy(keep=2, every_remote=3) and type(p.keep) is int and type(p.every_remote) is int


def test_step_must_be_an_int(tmp_path):
    with Checkpointer(tmp_path, save_options=OPTS) as ck:
        ck.save(2, state_for(2, n=100))
        for bad in ("2", 2.0, True, None):
            with pytest.raises(ValueError, match="^step must be an int"):
                ck.save(bad, state_for(3, n=100))
        with pytest.raises(ValueError, match="^step must be at least 0, got -1"):
            ck.save(-1, state_for(3, n=100))
        with pytest.raises(ValueError, match=r"^step must be an int, got str '2'"):
            ck.restore(step="2")  # not "step 2 not found"
        assert ck.restore(step=np.int64(2)).step == 2


def test_no_step_message(tmp_path):
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(NoCheckpointError) as e:
            ck.restore()
    assert str(e.value) == f"no committed, intact step in {str(tmp_path)!r}"
