"""CPU round trips through the same plan, ring, format and commit code the GPU uses."""

import os

import pytest
import torch

import gdsckpt
from conftest import all_dtype_tensors, assert_same


def _state():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(3_000_000, generator=g)
    return {
        "dtypes": all_dtype_tensors(),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 3),
        "empty_bf16": torch.empty(4, 0, dtype=torch.bfloat16),
        "transposed": torch.randn(40, 30, generator=g).t(),
        # a strided view of memory no other tensor here shares (overlapping views of one tensor,
        # big and big[5::7], are refused since issue 12: tests/reading/test_reader_contract.py)
        "strided": torch.randn(2_000_000, generator=g)[5::7],
        "expanded": torch.randn(1, 8, generator=g).expand(6, 8),
        "conj": torch.randn(5, dtype=torch.complex64, generator=g).conj(),
        "big": big,
        "tiny": [torch.full((2,), float(i)) for i in range(3000)],
        "nested": {"list": [1, 2.5, "s", None, True, (3, torch.arange(4))], 7: {"deep": torch.ones(2)}},
        "nan": torch.tensor([float("nan"), -0.0, float("inf")]),
    }


@pytest.mark.parametrize("codec", ["zstd", "raw"])
@pytest.mark.parametrize("chunk_bytes", [4096, 1 << 20])
def test_roundtrip_bit_exact(tmp_path, codec, chunk_bytes):
    state = _state()
    p = tmp_path / "s.gdsckpt"
    stats = gdsckpt.save(state, p, codec=codec, chunk_bytes=chunk_bytes)
    assert stats.io_path == "cpu" and stats.logical_bytes > 12_000_000
    assert os.path.getsize(p) == stats.file_bytes
    assert_same(gdsckpt.load(p), state)


def test_chunk_records_are_4k_aligned(tmp_path):
    p = tmp_path / "a.gdsckpt"
    gdsckpt.save(_state(), p, chunk_bytes=64 << 10)
    ck = gdsckpt.open(p)
    assert len(ck.index.records) > 40
    assert all(r.file_offset % 4096 == 0 for r in ck.index.records)


def test_incompressible_chunks_are_stored_raw(tmp_path):
    p = tmp_path / "r.gdsckpt"
    noise = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    stats = gdsckpt.save({"noise": noise}, p)
    assert stats.streams[0]["raw_chunks"] == 1 and stats.stored_bytes == noise.numel()
    assert torch.equal(gdsckpt.load(p)["noise"], noise)


def test_adamw_resume_is_bit_identical(tmp_path):
    def make():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    def step(m, opt, i):
        g = torch.Generator().manual_seed(100 + i)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()

    m, opt = make()
    for i in range(5):
        step(m, opt, i)
    p = tmp_path / "train.gdsckpt"
    gdsckpt.save({"model": m.state_dict(), "optim": opt.state_dict()}, p)
    for i in range(5, 10):
        step(m, opt, i)

    m2, opt2 = make()
    st = gdsckpt.load(p)
    m2.load_state_dict(st["model"])
    opt2.load_state_dict(st["optim"])
    for i in range(5, 10):
        step(m2, opt2, i)
    assert_same(dict(m2.state_dict()), dict(m.state_dict()))
    assert_same(opt2.state_dict(), opt.state_dict())


def test_load_into_in_place_and_mismatch_names_the_key(tmp_path):
    m = torch.nn.Linear(100, 50)
    p = tmp_path / "m.gdsckpt"
    gdsckpt.save(m.state_dict(), p)
    target = torch.nn.Linear(100, 50)
    ptr = target.weight.data_ptr()
    gdsckpt.load_into(p, target.state_dict())
    assert target.weight.data_ptr() == ptr and torch.equal(target.weight, m.weight)
    with pytest.raises(gdsckpt.StateMismatchError, match="'weight'.*float32\\[50, 100\\].*float32\\[50, 99\\]"):
        gdsckpt.load_into(p, torch.nn.Linear(99, 50).state_dict())
    with pytest.raises(gdsckpt.StateMismatchError, match="bias"):
        gdsckpt.load_into(p, {"weight": torch.empty(50, 100)})
    with pytest.raises(gdsckpt.StateMismatchError, match="'weight'.*float64"):
        gdsckpt.load_into(p, torch.nn.Linear(100, 50).double().state_dict())


def test_load_into_non_contiguous_target(tmp_path):
    src = {"w": torch.randn(30, 40)}
    p = tmp_path / "nc.gdsckpt"
    gdsckpt.save(src, p)
    target = torch.empty(40, 30).t()
    gdsckpt.load_into(p, {"w": target})
    assert torch.equal(target, src["w"])


def test_lazy_reader_reads_only_its_chunks(tmp_path):
    state = {f"t{i}": torch.randn(64 << 10) for i in range(8)}  # 256 KiB each
    p = tmp_path / "l.gdsckpt"
    gdsckpt.save(state, p, chunk_bytes=256 << 10)
    with gdsckpt.open(p) as ck:
        assert ck.keys() == list(state)
        assert ck.info("t5") == {"dtype": "float32", "shape": (64 << 10,), "nbytes": 256 << 10,
                                 "codec": "zstd", "device": "cpu"}
        assert torch.equal(ck.get_tensor("t5"), state["t5"])
        assert ck.last_stats.chunks == 1
        with pytest.raises(KeyError, match="nope"):
            ck.get_tensor("nope")


@pytest.mark.parametrize("bad, match", [
    ({"s": torch.randn(4, 4).to_sparse()}, "'s' has layout"),
    ({"a": {"b": object()}}, "builtins.object at 'a/b'"),
    ({"q": torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.quint8)}, "'q'"),
    ({(1, 2): torch.ones(1)}, "dict key \\(1, 2\\)"),
    ({"x": [torch.ones(1), {1.5: 2}]}, "dict key 1.5 at 'x/1'"),
])
def test_unsupported_state_fails_before_writing(tmp_path, bad, match):
    p = tmp_path / "bad.gdsckpt"
    with pytest.raises(gdsckpt.UnsupportedStateError, match=match):
        gdsckpt.save(bad, p)
    assert os.listdir(tmp_path) == []


def test_replaces_existing_checkpoint_atomically(tmp_path):
    p = tmp_path / "c.gdsckpt"
    gdsckpt.save({"v": torch.zeros(10)}, p)
    gdsckpt.save({"v": torch.ones(10)}, p)
    assert torch.equal(gdsckpt.load(p)["v"], torch.ones(10))
    assert os.listdir(tmp_path) == ["c.gdsckpt"]


def test_replaced_checkpoints_are_let_go_after_the_save(tmp_path):
    """The replaced file is closed on a background thread (its blocks are freed after the save
    returns): no descriptor may be left behind, and the name always holds the newest save."""
    from gdsckpt.core import storage
    p = tmp_path / "c.gdsckpt"
    gdsckpt.save({"v": torch.zeros(10)}, p)
    storage._releaser.submit(lambda: None).result()
    before = len(os.listdir("/proc/self/fd"))
    for i in range(20):
        gdsckpt.save({"v": torch.full((10,), float(i))}, p)
        assert torch.equal(gdsckpt.load(p)["v"], torch.full((10,), float(i)))
    storage._releaser.submit(lambda: None).result()
    assert len(os.listdir("/proc/self/fd")) == before
    assert os.listdir(tmp_path) == ["c.gdsckpt"]


def test_ans_needs_a_gpu_on_save_and_on_load(tmp_path):
    with pytest.raises(gdsckpt.CodecUnavailableError, match="zstd"):
        gdsckpt.save({"w": torch.ones(4)}, tmp_path / "x.gdsckpt", codec="ans")


def test_cli_inspect_and_verify(tmp_path, capsys):
    from gdsckpt.cli import main
    p = tmp_path / "i.gdsckpt"
    gdsckpt.save({"w": torch.randn(1000).bfloat16(), "m": torch.randn(1000)}, p)
    assert main(["inspect", str(p)]) == 0
    out = capsys.readouterr().out
    assert "bfloat16" in out and "zstd" in out and "saved" in out
    assert main(["verify", "--deep", str(p)]) == 0
    assert main(["convert", str(p), str(tmp_path / "raw.gdsckpt"), "--codec", "raw"]) == 0
    assert_same(gdsckpt.load(tmp_path / "raw.gdsckpt"), gdsckpt.load(p))
