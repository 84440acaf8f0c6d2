"""What a save asks of the directory does not grow with the steps kept (issue 44, 6): the
Checkpointer keeps its listing of the directory in memory (gdsckpt/manager/step_listing.py) and its
retention checks the steps that decide what it keeps (gdsckpt/manager/kept_checks.py), where every save
stat'ed every step. Counted in file-system calls, not timed; and the listing still sees what
another process changes."""

from __future__ import annotations

import os
import threading
import time

import pytest

from gdsckpt.manager.checkpointer import Checkpointer, step_name
from gdsckpt.manager.steps import FileSteps
from test_manager import OPTS, corrupt_chunk, state_for


def _fill(d, n: int) -> None:
    """n committed steps, 0 .. n-1: one saved, the others hard links to it."""
    with Checkpointer(d, keep=n, save_options=OPTS) as ck:
        ck.save(0, state_for(0, n=2000))
    first = d / step_name(0, False)
    for s in range(1, n):
        os.link(first, d / step_name(s, False))


class _Counter:
    """Counts the calls of os.stat, os.lstat, os.listdir and os.scandir, on every thread."""

    NAMES = ("stat", "lstat", "listdir", "scandir")

    def __init__(self, monkeypatch):
        self.calls = 0
        self._lock = threading.Lock()
        for name in self.NAMES:
            monkeypatch.setattr(os, name, self._counted(getattr(os, name)))

    def _counted(self, real):
        def call(*a, **k):
            with self._lock:
                self.calls += 1
            return real(*a, **k)
        return call


def _calls_per_save(tmp_path, monkeypatch, n: int, how: str) -> float:
    d = tmp_path / f"run{n}-{how}"
    _fill(d, n)
    state = state_for(1, n=2000)
    with Checkpointer(d, keep=10 ** 6, save_options=OPTS) as ck:
        for s in range(n, n + 3):  # the first retention run checks every step once
            ck.save(s, state)
        with monkeypatch.context() as m:
            counter = _Counter(m)
            saves = 8
            for s in range(n + 3, n + 3 + saves):
                if how == "async":
                    ck.save_async(s, state)
                    ck.wait()
                else:
                    ck.save(s, state)
        assert ck.steps()[-1] == n + 2 + saves
    return counter.calls / saves


@pytest.mark.parametrize("how", ["sync", "async"])
def test_a_saves_file_system_calls_do_not_grow_with_the_steps_kept(tmp_path, monkeypatch, how):
    few = _calls_per_save(tmp_path, monkeypatch, 10, how)
    many = _calls_per_save(tmp_path, monkeypatch, 1000, how)
    assert many <= few + 2, (few, many)  # it was ~4 calls per step kept


def test_the_listing_sees_another_process_add_and_remove_steps(tmp_path):
    """A read-only view (the CLI's, an evaluation job's) of a directory a manager writes."""
    writer = Checkpointer(tmp_path, keep=100, save_options=OPTS)
    view = FileSteps(tmp_path, {})
    assert view.local_steps() == []
    for s in range(1, 4):
        writer.save(s, state_for(s, n=100))
        assert view.local_steps() == list(range(1, s + 1))
    time.sleep(0.3)  # the directory settled: the view's listing is trusted
    assert view.local_steps() == [1, 2, 3]
    writer.rollback(1)
    assert view.local_steps() == [1]
    writer.save(2, state_for(2, n=100))
    assert view.local_steps() == [1, 2]
    writer.close()
    (tmp_path / step_name(2, False)).unlink()  # by hand
    assert view.local_steps() == [1]


def test_retention_still_finds_a_kept_step_damaged_in_place(tmp_path):
    """keep=2: a kept step damaged in place (its file's identity changes, the directory's does
    not) does not count, and the older intact step stays."""
    with Checkpointer(tmp_path, keep=2, save_options=OPTS) as ck:
        ck.save(1, state_for(1))
        ck.save(2, state_for(2))
        open(tmp_path / step_name(2, False), "r+b").truncate(100)
        ck.save(3, state_for(3))
        assert ck.steps() == [1, 2, 3]
        assert list(ck.status()["local_damage"]) == [2]
