"""gdsckpt.core.collector: a save pauses Python's cyclic collector and gives it back as it found it."""

import gc
import threading

import torch

import gdsckpt
from gdsckpt.core import collector


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


def _tensors_left_in_cycles(run) -> list:
    """The tensors that `run()` leaves reachable only through reference cycles (what would wait
    for the collector, which saves and loads pause)."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        run()
        gc.collect()
        return [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_saves_and_loads_leave_no_tensor_in_a_reference_cycle(tmp_path):
    """A copy held by a cycle waits for the collector: on the GPU, the state's size each time
    (GdsckptWriter's device staging peaked at ~6 copies of its state on the H100)."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    opt.step()

    def state(i):
        return {"model": model.state_dict(), "optim": opt.state_dict(), "step": i}

    def overlapped():
        fut = gdsckpt.save_async(state(4), tmp_path / "o.gdsckpt", snapshot="overlap", optimizer=opt)
        opt.step()
        fut.result()

    runs = {
        "save": lambda: gdsckpt.save(state(1), tmp_path / "a.gdsckpt"),
        "load": lambda: gdsckpt.load(tmp_path / "a.gdsckpt"),
        "load_into": lambda: gdsckpt.load_into(tmp_path / "a.gdsckpt", {"model": model, "optim": opt, "step": 0}),
        "load_into atomic": lambda: gdsckpt.load_into(tmp_path / "a.gdsckpt", state(0), atomic=True),
        "save_async": lambda: gdsckpt.save_async(state(2), tmp_path / "b.gdsckpt").result(),
        "save_async device": lambda: gdsckpt.save_async(state(3), tmp_path / "c.gdsckpt", snapshot="device").result(),
        "save_async overlap": overlapped,
    }
    left = {name: len(_tensors_left_in_cycles(run)) for name, run in runs.items()}
    assert left == dict.fromkeys(runs, 0)
