"""The Checkpointer's options (gdsckpt/manager/policy.py): ints only, validated once at construction,
with fixed messages; a step number is an int wherever it is taken. The retention policies
(LatestN, KeepEvery, AnyOf, and one written in this file alone): keep=n decides as it always
has, and a policy is applied alike to the local and memory tiers (the remote tier's, against a
real S3 server: test_manager_remote.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gdsckpt.errors import NoCheckpointError
from gdsckpt.manager.checkpointer import Checkpointer
from gdsckpt.options import AnyOf, KeepEvery, LatestN, RetentionPolicy
from gdsckpt.manager.policy import Policy
from conftest import assert_same
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


# ---------------------------------------------------------------- retention policies


def legacy_doomed_local(keep, local, damaged, protected, uploaded, remote):
    """Policy.doomed_local as it was before retention policies (keep an int): the reference."""
    intact = [s for s in local if s not in damaged]
    if not intact:
        return []
    oldest_kept = intact[-keep:][0]
    doomed = []
    for s in local:
        if s >= oldest_kept:
            break
        if s in protected:
            continue
        if remote and not (uploaded and (s in uploaded or max(uploaded) > s)):
            continue
        doomed.append(s)
    return doomed


@settings(max_examples=300, deadline=None)
@given(keep=st.integers(1, 6), local=st.lists(st.integers(0, 40), max_size=14, unique=True),
       data=st.data(), remote=st.booleans())
def test_keep_n_decides_as_it_always_has(keep, local, data, remote):
    local = sorted(local)
    damaged = set(data.draw(st.lists(st.sampled_from(local), unique=True))) if local else set()
    protected = set(data.draw(st.lists(st.sampled_from(local), unique=True))) if local else set()
    uploaded = set(data.draw(st.lists(st.sampled_from(local), unique=True))) if local and remote else None
    want = legacy_doomed_local(keep, local, damaged, protected, uploaded, remote)
    for p in (Policy(keep=keep), Policy(keep=LatestN(keep)), Policy(keep=AnyOf(LatestN(keep)))):
        assert p.doomed_local(local, damaged, protected, uploaded, remote) == want
    assert Policy(keep_remote=keep).doomed_remote(local) == local[:-keep]
    assert Policy(keep_remote=LatestN(keep)).doomed_remote(local) == local[:-keep]


def test_policies_keep_what_they_say():
    steps = list(range(0, 5001, 250))
    assert LatestN(3).keep(steps) == {4500, 4750, 5000}
    assert KeepEvery(1000).keep(steps) == {0, 1000, 2000, 3000, 4000, 5000}
    both = LatestN(3) | KeepEvery(1000)
    assert both == AnyOf(LatestN(3), KeepEvery(1000)) and repr(both) == "AnyOf(LatestN(n=3), KeepEvery(n=1000))"
    assert both.keep(steps) == {0, 1000, 2000, 3000, 4000, 4500, 4750, 5000}
    assert (both | LatestN(5)).keep(steps) == both.keep(steps) | {4250}
    assert Policy(keep=both).doomed_local(steps, set(), set(), None, False) == \
        [s for s in steps if s not in both.keep(steps)]
    assert Policy(keep_remote=KeepEvery(2000)).doomed_remote(steps) == [s for s in steps[:-1] if s % 2000]
    assert isinstance(both, RetentionPolicy) and not isinstance(3, RetentionPolicy)


def test_the_newest_intact_step_stays_whatever_the_policy():
    local = [5, 7, 9, 11]
    assert Policy(keep=KeepEvery(1000)).doomed_local(local, set(), set(), None, False) == [5, 7, 9]
    # a damaged newest does not count: the newest intact one stays; the damaged one, newer, too
    assert Policy(keep=KeepEvery(1000)).doomed_local(local, {11}, set(), None, False) == [5, 7]


@pytest.mark.parametrize("make,msg", [
    (lambda: LatestN(0), "LatestN.n must be at least 1 (the newest step is never deleted), got 0"),
    (lambda: LatestN(2.0), "LatestN.n must be an int, got float 2.0"),
    (lambda: KeepEvery(0), "KeepEvery.n must be at least 1, got 0"),
    (lambda: KeepEvery("10"), "KeepEvery.n must be an int, got str '10'"),
    (lambda: Policy(keep="LatestN(3)"), "keep must be an int, got str 'LatestN(3)'"),
])
def test_policy_arguments_refused(make, msg):
    with pytest.raises(ValueError) as e:
        make()
    assert str(e.value) == msg


def test_any_of_refuses_what_is_not_a_policy():
    with pytest.raises(TypeError, match=r"^AnyOf: argument 1 must be a retention policy "
                                        r"\(an object with keep\(steps\)\), got int 3$"):
        AnyOf(LatestN(2), 3)
    with pytest.raises(ValueError, match="at least one"):
        AnyOf()


class KeepMilestones:
    """A retention policy written by a user, in this file alone: the steps named, for good, besides
    the newest one (which every tier keeps whatever a policy says)."""

    def __init__(self, *milestones: int):
        self.milestones = set(milestones)

    def keep(self, steps):
        return {s for s in steps if s in self.milestones}


def test_a_policy_of_ones_own_on_every_tier(tmp_path, shm):
    policy = KeepMilestones(2, 5)
    with Checkpointer(tmp_path, keep=policy, memory=True, keep_memory=AnyOf(policy, LatestN(2)),
                      save_options=OPTS) as ck:
        for s in range(1, 9):
            ck.save(s, state_for(s, n=2000))
            ck.memory.wait_local()
        ck.prune()  # retention now: the last local write's own may not have been asked for yet
        assert ck.layout.local_steps() == [2, 5, 8]
        assert ck.memory.steps() == [2, 5, 7, 8]
        assert ck.status()["memory"]["dropped"][0]["why"].startswith("not kept by keep_memory=AnyOf(")
        for s in (2, 5, 8):
            r = ck.restore(step=s)
            assert r.step == s and r.source == "memory"
            assert_same(r.state, state_for(s, n=2000))
        assert ck.prune(dry_run=True)["local"] == []


def test_keep_every_on_disk_the_versions_to_go_back_to(tmp_path):
    with Checkpointer(tmp_path, keep=LatestN(2) | KeepEvery(100), save_options=OPTS) as ck:
        for s in range(50, 401, 50):
            ck.save(s, state_for(s, n=2000))
        ck.wait()
        assert ck.steps() == [100, 200, 300, 350, 400]
        r = ck.restore(step=100)
        assert_same(r.state, state_for(100, n=2000))
    # a new manager of the directory applies the same policy to what it finds
    with Checkpointer(tmp_path, keep=LatestN(1) | KeepEvery(200), save_options=OPTS) as ck:
        ck.save(450, state_for(450, n=2000))
        ck.wait()
        assert ck.steps() == [200, 400, 450]
