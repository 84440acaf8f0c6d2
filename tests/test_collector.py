"""gdsckpt.collector: a save pauses Python's cyclic collector and gives it back as it found it."""

import gc
import threading

import torch

import gdsckpt
from gdsckpt import collector


def test_a_save_pauses_the_collector_and_enables_it_again(tmp_path):
    seen = []

    class Probe:
        def state_dict(self):
            seen.append(gc.isenabled())
            return {"t": torch.arange(4)}

        def load_state_dict(self, state):
            pass

    assert gc.isenabled()
    gdsckpt.save({"probe": Probe()}, tmp_path / "a.gdsckpt")
    assert seen == [False]
    assert gc.isenabled()


def test_a_collector_the_process_disabled_stays_disabled(tmp_path):
    gc.disable()
    try:
        gdsckpt.save({"t": torch.arange(4)}, tmp_path / "a.gdsckpt")
        gdsckpt.save_async({"t": torch.arange(4)}, tmp_path / "b.gdsckpt").result()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_pauses_on_two_threads_end_when_the_last_one_does():
    inside, release = threading.Event(), threading.Event()

    def other():
        with collector.paused():
            inside.set()
            release.wait()

    thread = threading.Thread(target=other)
    with collector.paused():
        thread.start()
        inside.wait()
    assert not gc.isenabled()  # the other thread is still inside
    release.set()
    thread.join()
    assert gc.isenabled()


def test_an_error_inside_gives_the_collector_back():
    try:
        with collector.paused():
            raise KeyError("x")
    except KeyError:
        pass
    assert gc.isenabled()


def test_a_load_pauses_the_collector_and_enables_it_again(tmp_path):
    seen = []

    class Probe:
        def state_dict(self):
            return {"t": torch.zeros(4, dtype=torch.int64)}

        def load_state_dict(self, state):
            seen.append(gc.isenabled())

    path = tmp_path / "a.gdsckpt"
    gdsckpt.save({"probe": {"t": torch.arange(4)}}, path)
    probe = Probe()
    gdsckpt.load_into(path, {"probe": probe})
    assert seen == [False]  # phase 3 of restore_into, inside the pause
    assert gc.isenabled()
    assert torch.equal(gdsckpt.load(path)["probe"]["t"], torch.arange(4))
    assert gc.isenabled()
