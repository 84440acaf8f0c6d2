"""Stateful objects in the state (issue 20, item 1): modules, optimizers, schedulers, generators,
gdsckpt.RNG() and the user's own classes are saved through state_dict() and restored through
load_state_dict() (a fresh optimizer included), plain values are written back, NumPy values and
bytes round-trip exactly, and a failed restore leaves the state untouched. The same state goes
through torch.distributed.checkpoint (a 1-process gloo group)."""

from __future__ import annotations

import json
import random
import warnings

import numpy as np
import pytest
import torch

import gdsckpt
from gdsckpt.format import file as fmt
from gdsckpt.format import stateful
from gdsckpt.core.dtypes import NUMPY_NAMES
from gdsckpt.format.stateful import dcp_view, dcp_write_back
from ckpt_tools import rebuild, split
from conftest import assert_same


# ---------------------------------------------------------------- a small training run


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


def train_step(model, opt, sched) -> float:
    """One step whose loss depends on every generator RNG() covers, the model, the optimizer's
    moments and the scheduler's learning rate."""
    x = torch.randn(32, 8)
    loss = ((model(x) - 1) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item() + float(np.random.randn()) + random.random()


def objects_state(model, opt, sched, step=0) -> dict:
    return {"model": model, "optim": opt, "sched": sched, "step": step, "rng": gdsckpt.RNG()}


def scramble_generators():
    torch.manual_seed(999)
    np.random.seed(999)
    random.seed(999)


def test_resume_from_objects_is_bit_exact(tmp_path):
    """Save the objects after 5 steps; restore into fresh objects (an optimizer with no state at
    all) in the same process with every generator moved on: the next losses are the same bits."""
    model, opt, sched = make()
    for _ in range(5):
        train_step(model, opt, sched)
    p = tmp_path / "s.gdsckpt"
    gdsckpt.save(objects_state(model, opt, sched, step=5), p)
    want = [train_step(model, opt, sched) for _ in range(6)]

    model2, opt2, sched2 = make(seed=1)
    assert not opt2.state  # fresh: in-place loading into opt2.state_dict() had nothing to fill
    scramble_generators()
    state = objects_state(model2, opt2, sched2)
    gdsckpt.load_into(p, state)
    assert state["step"] == 5  # plain values are written back
    assert [train_step(model2, opt2, sched2) for _ in range(6)] == want


def test_save_async_takes_the_state_at_the_call(tmp_path):
    model, opt, sched = make()
    train_step(model, opt, sched)
    p = tmp_path / "a.gdsckpt"
    state = objects_state(model, opt, sched, step=1)
    fut = gdsckpt.save_async(state, p)
    want = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "lr": sched.get_last_lr()}
    train_step(model, opt, sched)  # changes everything the moment the call returned
    state["step"] = 2
    fut.result(60)
    out = gdsckpt.load(p)
    assert out["step"] == 1 and out["sched"]["_last_lr"] == want["lr"]
    assert_same(dict(out["model"]), want["model"])
    assert sorted(out["optim"]["state"]) == [0, 1, 2, 3, 4, 5]


def test_plain_load_gives_the_objects_states(tmp_path):
    model, opt, sched = make()
    train_step(model, opt, sched)
    p = tmp_path / "p.gdsckpt"
    gdsckpt.save({"model": model, "optim": opt, "g": torch.Generator().manual_seed(3)}, p)
    out = gdsckpt.load(p)
    assert_same(out["model"], model.state_dict())
    assert_same(out["optim"], opt.state_dict())
    assert torch.equal(out["g"], torch.Generator().manual_seed(3).get_state())
    assert "model/0.weight" in gdsckpt.open(p).keys()


def test_fresh_optimizer_state_goes_to_its_parameters_device(tmp_path):
    """New tensors for a stateful object's saved state: on the device of its parameters when
    saved from a GPU; saved from the CPU, they stay on the CPU (AdamW's step counts)."""
    model, opt, sched = make()
    train_step(model, opt, sched)
    p = tmp_path / "d.gdsckpt"
    gdsckpt.save({"optim": opt}, p)
    _, opt2, _ = make()
    gdsckpt.load_into(p, {"optim": opt2})
    st = opt2.state[opt2.param_groups[0]["params"][0]]
    assert st["exp_avg"].device.type == "cpu" and st["step"].device.type == "cpu"
    assert_same(opt2.state_dict(), opt.state_dict())


def test_restore_into_tensors_in_place_no_second_copy(tmp_path):
    model, opt, sched = make()
    p = tmp_path / "m.gdsckpt"
    gdsckpt.save({"model": model}, p)
    model2, _, _ = make(seed=3)
    ptrs = {k: v.data_ptr() for k, v in model2.state_dict().items()}
    gdsckpt.load_into(p, {"model": model2})
    assert {k: v.data_ptr() for k, v in model2.state_dict().items()} == ptrs
    assert_same(model2.state_dict(), model.state_dict())


def test_plain_values_lists_and_tuples_are_written_back(tmp_path):
    p = tmp_path / "v.gdsckpt"
    t = torch.arange(4.0)
    gdsckpt.save({"step": 500, "hist": [1, 2.5, "x"], "pair": (3, t), "cfg": {"lr": 0.1, "name": "a"},
                  "blob": b"\x00\x01", "none": None}, p)
    target_t = torch.zeros(4)
    hist = [0, 0, ""]
    cfg = {"lr": 0.0, "name": ""}
    state = {"step": 0, "hist": hist, "pair": (0, target_t), "cfg": cfg, "blob": b"", "none": 7}
    gdsckpt.load_into(p, state)
    assert state["step"] == 500 and state["hist"] is hist and hist == [1, 2.5, "x"]
    assert state["pair"][0] == 3 and state["pair"][1] is target_t and torch.equal(target_t, t)
    assert state["cfg"] is cfg and cfg == {"lr": 0.1, "name": "a"}
    assert state["blob"] == b"\x00\x01" and state["none"] is None


class Counter:
    """A user's own Stateful, holding a NumPy array, bytes and a tensor."""

    def __init__(self):
        self.n, self.hist, self.tag, self.t = 0, np.zeros(3, dtype=np.int32), b"", torch.zeros(2)

    def state_dict(self):
        return {"n": self.n, "hist": self.hist, "tag": self.tag, "t": self.t}

    def load_state_dict(self, sd):
        self.n, self.hist, self.tag = sd["n"], sd["hist"], sd["tag"]
        self.t.copy_(sd["t"])


def test_users_own_stateful_at_depth(tmp_path):
    c = Counter()
    c.n, c.hist[:], c.tag, c.t[:] = 7, [1, 2, 3], b"abc", torch.tensor([1.5, -2.0])
    p = tmp_path / "c.gdsckpt"
    gdsckpt.save({"loop": {"counters": [c]}}, p)
    d = Counter()
    gdsckpt.load_into(p, {"loop": {"counters": [d]}})
    assert d.n == 7 and d.tag == b"abc" and torch.equal(d.t, c.t)
    assert d.hist.dtype == np.int32 and d.hist.tolist() == [1, 2, 3]


class Trainer:
    """A Stateful whose state holds another object: flatten saves the module's state in its place."""

    def __init__(self, seed):
        self.model, self.n = make(seed)[0], 0

    def state_dict(self):
        return {"model": self.model, "n": self.n}

    def load_state_dict(self, sd):
        self.model.load_state_dict(sd["model"])
        self.n = sd["n"]


def test_object_inside_an_objects_state_is_read_in_place(tmp_path):
    t = Trainer(0)
    t.n = 12
    p = tmp_path / "t.gdsckpt"
    gdsckpt.save({"trainer": t}, p)
    assert "trainer/model/0.weight" in gdsckpt.open(p).keys()
    u = Trainer(1)
    ptrs = [x.data_ptr() for x in u.model.state_dict().values()]
    gdsckpt.load_into(p, {"trainer": u})
    assert u.n == 12 and [x.data_ptr() for x in u.model.state_dict().values()] == ptrs
    assert_same(u.model.state_dict(), t.model.state_dict())


# ---------------------------------------------------------------- generators


def test_rng_restores_python_numpy_and_torch(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.random(), np.random.randn(), np.random.randn(), torch.rand(5)  # a cached gaussian too
    p = tmp_path / "r.gdsckpt"
    gdsckpt.save({"rng": gdsckpt.RNG()}, p)
    want = (random.random(), np.random.randn(2).tolist(), torch.rand(3))
    scramble_generators()
    gdsckpt.load_into(p, {"rng": gdsckpt.RNG()})
    got = (random.random(), np.random.randn(2).tolist(), torch.rand(3))
    assert got[0] == want[0] and got[1] == want[1] and torch.equal(got[2], want[2])


def test_torch_generator_in_the_state(tmp_path):
    g = torch.Generator().manual_seed(11)
    torch.rand(7, generator=g)
    p = tmp_path / "g.gdsckpt"
    gdsckpt.save({"data": {"gen": g}}, p)
    want = torch.rand(4, generator=g)
    g2 = torch.Generator().manual_seed(0)
    gdsckpt.load_into(p, {"data": {"gen": g2}})
    assert torch.equal(torch.rand(4, generator=g2), want)


# ---------------------------------------------------------------- NumPy values and bytes


def test_numpy_values_and_bytes_round_trip_exactly(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {name: (rng.standard_normal(6) * 100).astype(name) for name in NUMPY_NAMES}
    scalars = {name: a[1] for name, a in arrays.items()}
    np.random.seed(5)
    np.random.randn()  # has_gauss = 1, a cached gaussian
    state = {"arrays": arrays, "scalars": scalars, "mt": np.random.get_state(),
             "zero_d": np.array(2.5), "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
             "empty": np.zeros((0, 3), dtype=np.int16), "bytes": b"\x00\xffabc", "no_bytes": b""}
    p = tmp_path / "np.gdsckpt"
    gdsckpt.save(state, p)
    out = gdsckpt.load(p)
    for group in ("arrays", "scalars"):
        for name, v in state[group].items():
            got = out[group][name]
            assert type(got) is type(v) and got.dtype == v.dtype and got.shape == v.shape, (group, name)
            assert got.tobytes() == v.tobytes(), (group, name)
    mt = out["mt"]
    assert type(mt) is tuple and len(mt) == 5 and mt[0] == "MT19937"
    assert mt[1].dtype == np.uint32 and np.array_equal(mt[1], state["mt"][1])
    assert mt[2:] == state["mt"][2:] and [type(x) for x in mt[2:]] == [int, int, float]
    np.random.set_state(mt)
    assert np.random.randn() == (np.random.set_state(state["mt"]), np.random.randn())[1]
    assert out["zero_d"].shape == () and type(out["zero_d"]) is np.ndarray and out["zero_d"] == 2.5
    assert np.array_equal(out["fortran"], state["fortran"])
    assert out["empty"].shape == (0, 3) and out["empty"].dtype == np.int16
    assert out["bytes"] == b"\x00\xffabc" and out["no_bytes"] == b"" and type(out["no_bytes"]) is bytes


def test_numpy_array_is_copied_at_the_call(tmp_path):
    a = np.arange(5.0)
    p = tmp_path / "c.gdsckpt"
    fut = gdsckpt.save_async({"a": a}, p)
    a[:] = -1
    fut.result(60)
    assert gdsckpt.load(p)["a"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("bad, match", [
    ({"a": {"b": np.array(["x", "y"])}}, "NumPy array at 'a/b' has dtype <U1"),
    ({"o": [np.array([object()])]}, "NumPy array at 'o/0' has dtype"),
    ({"t": np.datetime64("2020-01-01")}, "NumPy scalar at 't' has dtype"),
    ({"be": np.arange(3, dtype=">f4")}, "'be' has dtype >f4"),
    ({"m": np.ma.masked_array([1, 2])}, "'m' is a numpy.ma.*MaskedArray"),
    ({"s": np.str_("x")}, "NumPy scalar at 's' has dtype"),
    ({"ba": bytearray(b"x")}, "builtins.bytearray at 'ba'"),
    ({"f": np.float128(1) if hasattr(np, "float128") else np.array([object()])}, "at 'f' has dtype"),
])
def test_unsupported_values_are_refused_naming_their_key(tmp_path, bad, match):
    with pytest.raises(gdsckpt.UnsupportedStateError, match=match):
        gdsckpt.save(bad, tmp_path / "bad.gdsckpt")
    assert list(tmp_path.iterdir()) == []


class Recursive:
    def state_dict(self):
        return self

    def load_state_dict(self, sd):
        pass


class Failing:
    def state_dict(self):
        raise RuntimeError("no state today")

    def load_state_dict(self, sd):
        pass


def test_stateful_errors_name_the_key(tmp_path):
    with pytest.raises(gdsckpt.UnsupportedStateError, match="Recursive at 'x/y'.*returned"):
        gdsckpt.save({"x": {"y": Recursive()}}, tmp_path / "r.gdsckpt")
    with pytest.raises(RuntimeError, match="no state today") as ei:
        gdsckpt.save({"x": [Failing()]}, tmp_path / "f.gdsckpt")
    assert "Failing at 'x/0'" in "".join(ei.value.__notes__)
    with pytest.raises(gdsckpt.UnsupportedStateError, match="builtins.type at 'cls'"):
        gdsckpt.save({"cls": torch.nn.Linear}, tmp_path / "c.gdsckpt")  # a class is not a Stateful
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- what a failed restore leaves


def _flip_last_chunk(p) -> None:
    rec = gdsckpt.open(p).index.records[-1]
    b = bytearray(p.read_bytes())
    b[rec.file_offset + 3] ^= 0x04
    p.write_bytes(bytes(b))


def _snapshot(model, opt, state):
    return ({k: v.clone() for k, v in model.state_dict().items()}, len(opt.state), state["step"],
            random.getstate(), torch.get_rng_state())


def test_atomic_restore_leaves_objects_untouched_on_damage(tmp_path):
    model, opt, sched = make()
    train_step(model, opt, sched)
    p = tmp_path / "a.gdsckpt"
    gdsckpt.save(objects_state(model, opt, sched, step=1), p, codec="raw", chunk_bytes=4096)
    _flip_last_chunk(p)
    model2, opt2, sched2 = make(seed=7)
    state = objects_state(model2, opt2, sched2)
    before = _snapshot(model2, opt2, state)
    with pytest.raises(gdsckpt.ChecksumError) as ei:
        gdsckpt.load_into(p, state, atomic=True)
    assert ei.value.overwritten == []
    after = _snapshot(model2, opt2, state)
    assert_same(after[0], before[0])
    assert after[1:3] == (0, 0) and after[3] == before[3] and torch.equal(after[4], before[4])
    assert sched2.last_epoch == 0


def test_streaming_restore_calls_no_load_state_dict_when_a_chunk_fails(tmp_path):
    model, opt, sched = make()
    train_step(model, opt, sched)
    p = tmp_path / "s.gdsckpt"
    gdsckpt.save(objects_state(model, opt, sched, step=1), p, codec="raw", chunk_bytes=4096)
    _flip_last_chunk(p)
    model2, opt2, sched2 = make(seed=7)
    state = objects_state(model2, opt2, sched2)
    with pytest.raises(gdsckpt.ChecksumError):
        gdsckpt.load_into(p, state)
    assert not opt2.state and state["step"] == 0 and sched2.last_epoch == 0


def test_mismatches_are_found_before_anything_changes(tmp_path):
    model, opt, sched = make()
    train_step(model, opt, sched)
    p = tmp_path / "m.gdsckpt"
    gdsckpt.save(objects_state(model, opt, sched, step=4), p)
    # a module with another shape
    other = torch.nn.Sequential(torch.nn.Linear(8, 5))
    o_opt = torch.optim.AdamW(other.parameters())
    with pytest.raises(gdsckpt.StateMismatchError, match="keys differ"):
        gdsckpt.load_into(p, {**objects_state(*make(1), step=0), "model": other})
    # an optimizer over other parameter groups: load_state_dict's own check, made before reading
    model3, _, _ = make(2)
    state = objects_state(model3, o_opt, torch.optim.lr_scheduler.StepLR(o_opt, 3))
    with pytest.raises(gdsckpt.StateMismatchError, match="optimizer at 'optim' has parameter groups of \\[2\\]"):
        gdsckpt.load_into(p, state)
    assert not o_opt.state and state["step"] == 0
    # a key the checkpoint does not have, and one the target lacks
    with pytest.raises(gdsckpt.StateMismatchError, match="not in the checkpoint \\['epoch'\\]"):
        gdsckpt.load_into(p, {**objects_state(*make(1)), "epoch": 0})
    with pytest.raises(gdsckpt.StateMismatchError, match="missing from the target \\['model/0.weight'"):
        gdsckpt.load_into(p, {"optim": make(1)[1]})
    # a tensor where the checkpoint has a dict
    with pytest.raises(gdsckpt.StateMismatchError, match="'sched' is a tensor in the target but a dict"):
        gdsckpt.load_into(p, {**objects_state(*make(1)), "sched": torch.zeros(1)})


def test_strict_false_leaves_what_is_missing(tmp_path):
    model, opt, sched = make()
    p = tmp_path / "n.gdsckpt"
    gdsckpt.save({"model": model, "step": 3}, p)
    bigger = torch.nn.Sequential(*make(5)[0], torch.nn.Linear(1, 2))  # the same first four, one more
    extra = bigger[4].weight.detach().clone()
    state = {"model": bigger, "epoch": 9}
    gdsckpt.load_into(p, state, strict=False)
    assert state == {"model": bigger, "epoch": 9}  # "step" is not asked for, "epoch" not saved
    assert torch.equal(bigger[0].weight, model[0].weight) and torch.equal(bigger[4].weight, extra)
    with pytest.raises(gdsckpt.StateMismatchError, match="not in the checkpoint \\['model/4.weight'"):
        gdsckpt.load_into(p, {"model": bigger, "step": 0})


def test_strict_counts_plain_values_and_the_root(tmp_path):
    """strict=True: a saved plain value (or a dict or list of them) the target has no place for is
    missing, as a tensor is; a plain value at the root, where the checkpoint holds a dict, is a
    mismatch, before anything is read. strict=False leaves them alone and reads nothing for them."""
    p = tmp_path / "v.gdsckpt"
    gdsckpt.save({"w": torch.ones(2), "step": 5, "cfg": {"lr": 0.1, "empty": {}}, "hist": [1, 2]}, p)
    for target, missing in [({"w": torch.zeros(2), "cfg": {"lr": 0, "empty": {}}, "hist": [0, 0]}, "'step'"),
                            ({"w": torch.zeros(2), "step": 0, "cfg": {}, "hist": [0, 0]}, "'cfg/lr', 'cfg/empty'"),
                            ({"w": torch.zeros(2), "step": 0, "cfg": {"lr": 0, "empty": {}}, "hist": [0]}, "'hist/1'")]:
        with pytest.raises(gdsckpt.StateMismatchError, match=f"missing from the target \\[{missing}\\]"):
            gdsckpt.load_into(p, target)
        assert not target["w"].any()
    w = torch.zeros(2)
    state = {"w": w, "step": 0, "cfg": {"lr": 0, "empty": {}}, "hist": [0, 0]}
    gdsckpt.load_into(p, state)
    assert state == {"w": w, "step": 5, "cfg": {"lr": 0.1, "empty": {}}, "hist": [1, 2]} and w.eq(1).all()
    state = {"w": torch.zeros(2)}
    gdsckpt.load_into(p, state, strict=False)
    assert list(state) == ["w"] and state["w"].eq(1).all()
    for root in (None, 0):
        with pytest.raises(gdsckpt.StateMismatchError, match="'<root>' is a plain value in the target but a dict"):
            gdsckpt.load_into(p, root)
        assert gdsckpt.load_into(p, root, strict=False).logical_bytes == 0  # nothing to write back: nothing read
    gdsckpt.save(7, p)
    gdsckpt.load_into(p, 0)  # a plain value into a plain value at the root: left alone, as before


# ---------------------------------------------------------------- the format


def test_typed_placements_are_validated(tmp_path):
    """A bytes placement on a float tensor, an npscalar with a shape, an ndarray of bfloat16, and
    any typed placement in a format 1.0 file: refused with a CheckpointFormatError."""
    p = tmp_path / "t.gdsckpt"
    gdsckpt.save({"f": torch.ones(3), "s": torch.ones(2, dtype=torch.float64),
                  "h": torch.ones(2, dtype=torch.bfloat16)}, p, codec="raw")
    data = p.read_bytes()
    _, doc, _ = split(data)
    for name, kind, message in [("f", "bytes", "as bytes"), ("s", "npscalar", "as npscalar"),
                                ("h", "ndarray", "as ndarray")]:
        bad = json.loads(json.dumps(doc))
        for item in bad["skeleton"]["dict"]:
            if item[0] == name:
                item[1] = {kind: item[1]["tensor"]}
        q = tmp_path / f"{name}.gdsckpt"
        q.write_bytes(rebuild(data, bad))
        with pytest.raises(gdsckpt.CheckpointFormatError, match=message):
            gdsckpt.open(q)
    ok = json.loads(json.dumps(doc))
    ok["skeleton"]["dict"][0][1] = {"ndarray": 0}
    q = tmp_path / "ok.gdsckpt"
    q.write_bytes(rebuild(data, ok))
    assert type(gdsckpt.load(q)["f"]) is np.ndarray  # float32 is a NumPy dtype: accepted
    tensors = gdsckpt.open(p).index.plan.tensors

    def bad(message, **kw):
        return gdsckpt.CheckpointFormatError(message)

    with pytest.raises(gdsckpt.CheckpointFormatError, match="unknown skeleton node kind 'ndarray' \\(format 1.1"):
        fmt._check_skeleton(ok["skeleton"], tensors, (1, 0), bad)


# ---------------------------------------------------------------- torch.distributed.checkpoint


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_dcp_takes_the_same_state(tmp_path, one_rank):
    """dcp_view: nested objects, a fresh optimizer (initialised by get_optimizer_state_dict, then
    loaded into), a torch.Generator and RNG(); the resumed losses are the same bits. Plain DCP on
    the same objects leaves the fresh optimizer fresh (the losses differ): the reason for it."""
    import torch.distributed.checkpoint as dcp
    from gdsckpt.dcp import GdsckptReader, GdsckptWriter
    warnings.filterwarnings("ignore", category=UserWarning)
    model, opt, sched = make()
    for _ in range(4):
        train_step(model, opt, sched)
    g = torch.Generator().manual_seed(4)
    state = {"train": {"model": model, "optim": opt, "gen": g}, "sched": sched, "step": 4, "rng": gdsckpt.RNG()}
    dcp.save(dcp_view(state), storage_writer=GdsckptWriter(tmp_path / "s"))
    want = [train_step(model, opt, sched) for _ in range(4)] + [torch.rand(3, generator=g).tolist()]

    def resumed(through_view: bool):
        model2, opt2, sched2 = make(seed=1)
        scramble_generators()
        g2 = torch.Generator()
        s2 = {"train": {"model": model2, "optim": opt2, "gen": g2}, "sched": sched2, "step": 0,
              "rng": gdsckpt.RNG()}
        if through_view:
            view = dcp_view(s2)
            dcp.load(view, storage_reader=GdsckptReader(tmp_path / "s"))
            dcp_write_back(s2, view)
            assert s2["step"] == 4
        else:  # DCP alone, its top-level Statefuls: what the Checkpointer passed before
            plain = {"model": model2, "optim": opt2, "sched": sched2, "rng": gdsckpt.RNG()}
            dcp.save({"model": model, "optim": opt, "sched": sched, "rng": gdsckpt.RNG()},
                     storage_writer=GdsckptWriter(tmp_path / "plain"))
            dcp.load(plain, storage_reader=GdsckptReader(tmp_path / "plain"))
            assert not opt2.state  # nothing to load into: the moments were dropped, silently
        return [train_step(model2, opt2, sched2) for _ in range(4)] + [torch.rand(3, generator=g2).tolist()]

    assert resumed(True) == want
    resumed(False)


def test_dcp_optimizer_needs_its_module(tmp_path, one_rank):
    model, opt, _ = make()
    with pytest.raises(gdsckpt.UnsupportedStateError, match="optimizer at 'train.optim'"):
        dcp_view({"train": {"optim": opt}})["train"].state_dict()


def test_dcp_view_writes_back_plain_values_in_tuples(tmp_path, one_rank):
    """A tuple holding a stateful object, at the top level or below: its plain values come back
    in a new tuple (as load_into gives), put where the old one was, and the object is restored."""
    import torch.distributed.checkpoint as dcp
    from gdsckpt.dcp import GdsckptReader, GdsckptWriter
    warnings.filterwarnings("ignore", category=UserWarning)
    m = torch.nn.Linear(2, 2)
    dcp.save(dcp_view({"pair": (m, 7), "nested": {"pair": (m, 8)}, "list": [(m, 9)]}),
             storage_writer=GdsckptWriter(tmp_path / "c"))
    m2 = torch.nn.Linear(2, 2)
    state = {"pair": (m2, 0), "nested": {"pair": (m2, 0)}, "list": [(m2, 0)]}
    view = dcp_view(state)
    dcp.load(view, storage_reader=GdsckptReader(tmp_path / "c"))
    dcp_write_back(state, view)
    assert torch.equal(m2.weight, m.weight)
    assert state == {"pair": (m2, 7), "nested": {"pair": (m2, 8)}, "list": [(m2, 9)]}


def test_checkpointer_under_dcp_restores_objects(tmp_path, one_rank):
    """The Checkpointer's DCP layout (torch.distributed initialised) with objects, a fresh optimizer
    among them: the resumed losses are the same bits."""
    warnings.filterwarnings("ignore", category=UserWarning)
    model, opt, sched = make()
    with gdsckpt.Checkpointer(tmp_path / "ck", keep=2) as ck:
        assert ck.distributed
        for step in range(1, 4):
            train_step(model, opt, sched)
            ck.save(step, objects_state(model, opt, sched, step))
    want = [train_step(model, opt, sched) for _ in range(3)]
    model2, opt2, sched2 = make(seed=1)
    scramble_generators()
    state = objects_state(model2, opt2, sched2)
    with gdsckpt.Checkpointer(tmp_path / "ck", keep=2) as ck:
        assert ck.restore(state).step == 3
    assert state["step"] == 3
    assert [train_step(model2, opt2, sched2) for _ in range(3)] == want


# ---------------------------------------------------------------- on the GPU


def cuda_step(model, opt, sched) -> float:
    x = torch.randn(64, 8, device="cuda")  # the CUDA generator, which RNG() saves once CUDA is initialised
    loss = ((model(x) - 1) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item() + random.random()


@pytest.mark.gpu
def test_objects_on_the_gpu_through_the_checkpointer(tmp_path):
    """Module, AdamW and scheduler on the GPU, saved by Checkpointer.save_async: restored into
    fresh objects, the module in place, the moments read straight onto the GPU (the step counts
    stay on the CPU, as AdamW keeps them), the CUDA generator restored; the losses are the same."""
    model, opt, sched = make()
    model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    with gdsckpt.Checkpointer(tmp_path / "ck", keep=2) as ck:
        for step in range(1, 4):
            cuda_step(model, opt, sched)
            ck.save_async(step, objects_state(model, opt, sched, step))
    want = [cuda_step(model, opt, sched) for _ in range(4)]

    model2 = make(seed=1)[0].cuda()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=3, gamma=0.5)
    scramble_generators()
    torch.cuda.manual_seed_all(999)
    ptrs = [p.data_ptr() for p in model2.parameters()]
    state = objects_state(model2, opt2, sched2)
    with gdsckpt.Checkpointer(tmp_path / "ck", keep=2) as ck:
        assert ck.restore(state).step == 3
    assert state["step"] == 3 and [p.data_ptr() for p in model2.parameters()] == ptrs
    st = opt2.state[next(iter(model2.parameters()))]
    assert st["exp_avg"].is_cuda and st["exp_avg_sq"].is_cuda and st["step"].device.type == "cpu"
    assert [cuda_step(model2, opt2, sched2) for _ in range(4)] == want


# ---------------------------------------------------------------- an optimizer saved before its first step


@pytest.fixture
def warn_again(monkeypatch):
    """The warning of an unstepped optimizer comes once a process: armed again for the test
    (monkeypatch puts the process's flag back after it)."""
    monkeypatch.setattr(stateful, "_warned_unstepped", False)


def _unstepped_warnings(caught) -> list[warnings.WarningMessage]:
    return [w for w in caught if "holds no moments" in str(w.message)]


def test_saving_an_optimizer_before_its_first_step_warns_once_naming_the_key(tmp_path, warn_again):
    """opt.state_dict() taken before the first step() holds no moments: saved every time as it
    was, a restore starts them from zero. Said once a process, naming where it is, at the
    caller's line; the object itself, save_async and the Checkpointer are looked at too."""
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gdsckpt.save({"model": model.state_dict(), "train": {"optim": opt.state_dict()}}, tmp_path / "a.gdsckpt")
        gdsckpt.save({"optim": opt.state_dict()}, tmp_path / "b.gdsckpt")  # once a process
    found = _unstepped_warnings(caught)
    assert len(found) == 1 and found[0].filename == __file__, [(w.filename, str(w.message)) for w in caught]
    assert "'train/optim'" in str(found[0].message) and "2 parameter(s)" in str(found[0].message)
    assert gdsckpt.load(tmp_path / "a.gdsckpt")["train"]["optim"]["state"] == {}  # saved all the same

    def checkpointer_save(state):
        with gdsckpt.Checkpointer(tmp_path / "run") as ck:
            ck.save(1, state)

    for save in (lambda state: gdsckpt.save_async(state, tmp_path / "c.gdsckpt").result(), checkpointer_save):
        stateful._warned_unstepped = False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            save({"model": model, "opt": opt})  # the optimizer object: its state_dict() is what is saved
        found = _unstepped_warnings(caught)
        assert len(found) == 1 and "'opt'" in str(found[0].message), [str(w.message) for w in caught]


def test_no_warning_for_an_optimizer_that_stepped_or_keeps_no_state(tmp_path, warn_again):
    model = torch.nn.Linear(8, 8)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: no state, ever
    adam = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    adam.step()
    none = torch.optim.AdamW([torch.zeros(2, requires_grad=True)])
    none.param_groups[0]["params"] = []  # holds no parameter: nothing to miss
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gdsckpt.save({"sgd": sgd.state_dict(), "adam": adam, "none": none.state_dict(),
                      "not_an_optimizer": {"state": {}, "param_groups": "x"}}, tmp_path / "a.gdsckpt")
        gdsckpt.reserve({"sgd": sgd}, wait=True)  # reserve's own warning: not for SGD without momentum
    assert _unstepped_warnings(caught) == [] and not [w for w in caught if "holds no state" in str(w.message)]
    momentum = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # keeps a buffer once it steps
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gdsckpt.save({"sgd": momentum.state_dict()}, tmp_path / "b.gdsckpt")
    assert len(_unstepped_warnings(caught)) == 1
