"""gdsckpt/writing/save.py, the one save seam (issue 19): SaveOptions checked once, the Destination
protocol's call order, save_flat into any destination, and the snapshot names save_async and
GdsckptWriter share."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import gdsckpt
from gdsckpt.writing.save import NewFile, SaveOptions, Snapshot, save_flat
from gdsckpt.format.tree import flatten
from ckpt_tools import split
from conftest import assert_same


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(50_000, generator=g), "h": torch.randn(300, generator=g).to(torch.bfloat16),
            "step": seed, "tied": [torch.arange(5)] * 2}


# ---------------------------------------------------------------- SaveOptions


@pytest.mark.parametrize("options,message", [
    (dict(codec="lz4"), "unknown codec 'lz4'"),
    (dict(codec={"flaot32": "zstd"}), "'flaot32' is not a dtype name"),
    (dict(codec={"float32": "lz4"}), "codec for float32: unknown codec 'lz4'"),
    (dict(codec=3), "codec must be one of"),
    (dict(io="nonsense"), "io must be one of 'auto', 'gds', 'compat'"),
    (dict(io_threads=0), "io_threads must be a positive int or None"),
    (dict(chunk_bytes=4 << 30), "chunk_bytes must be a positive multiple of 4096"),
    (dict(chunk_bytes=4096.0), "chunk_bytes must be a positive multiple of 4096"),
    (dict(chunk_bytes=5000), "chunk_bytes must be a positive multiple of 4096"),
    (dict(ring_depth=1), "ring_depth must be at least 2"),
    (dict(ring_depth=2.5), "ring_depth must be at least 2"),
    (dict(backend="tpu"), "backend must be 'auto', 'gpu' or 'cpu', not 'tpu'"),
])
def test_bad_options_are_refused_on_construction_with_the_same_messages(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        SaveOptions(**options)
    for save in (lambda: gdsckpt.save(_state(), tmp_path / "x.gdsckpt", **options),
                 lambda: gdsckpt.save_async(_state(), tmp_path / "x.gdsckpt", **options)):
        with pytest.raises(ValueError, match=message):
            save()
    assert os.listdir(tmp_path) == []


def test_options_are_frozen_and_keep_what_was_checked():
    codec = {"float32": "zstd"}
    opts = SaveOptions(codec=codec, chunk_bytes=0)
    codec["float32"] = "lz4"  # the caller's dict changes after the check: the options do not
    assert opts.codec == {"float32": "zstd"} and opts.chunk_bytes is None
    assert opts.chunk_bytes_for("cpu") == 16 << 20 and SaveOptions(chunk_bytes=8192).chunk_bytes_for("gpu") == 8192
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.codec = "raw"
    with pytest.raises(ValueError, match="ring_depth"):
        dataclasses.replace(opts, ring_depth=0)  # a changed copy is checked again


# ---------------------------------------------------------------- Destination


class Recording(NewFile):
    """NewFile, recording the protocol's calls."""

    def __init__(self, path, fail_at: int | None = None):
        super().__init__(path)
        self.calls: list[str] = []
        self.fail_at = fail_at

    def open(self, be):
        self.calls.append("open")
        file = super().open(be)
        if self.fail_at is not None:
            real, n = file.pwrite, [0]

            def pwrite(*a):
                n[0] += 1
                if n[0] == self.fail_at:
                    raise KeyboardInterrupt("stopped in the ring")
                return real(*a)
            file.pwrite = pwrite
        return file

    def layout(self, fd, meta, skeleton, devices, plan):
        self.calls.append("layout")
        return super().layout(fd, meta, skeleton, devices, plan)

    def commit(self, file):
        self.calls.append("commit")
        super().commit(file)

    def abort(self, file, error):
        self.calls.append(f"abort:{type(error).__name__}")
        super().abort(file, error)


def test_save_flat_calls_a_destination_in_its_documented_order(tmp_path):
    p = tmp_path / "x.gdsckpt"
    dest = Recording(p)
    stats = save_flat(*flatten(_state(1)), dest, SaveOptions(backend="cpu", chunk_bytes=16 << 10))
    assert dest.calls == ["open", "layout", "commit"]
    assert stats.path == str(p) and stats.file_bytes == p.stat().st_size and stats.chunks > 3
    assert_same(gdsckpt.load(p), _state(1))
    failing = Recording(p, fail_at=3)
    with pytest.raises(KeyboardInterrupt):
        save_flat(*flatten(_state(2)), failing, SaveOptions(backend="cpu", chunk_bytes=16 << 10))
    assert failing.calls == ["open", "layout", "abort:KeyboardInterrupt"]
    assert os.listdir(tmp_path) == ["x.gdsckpt"]  # no temporary left
    assert_same(gdsckpt.load(p), _state(1))


def test_new_file_refuses_a_bad_path_before_the_state_is_walked(tmp_path):
    with pytest.raises(FileNotFoundError):
        NewFile(tmp_path / "missing" / "x.gdsckpt")
    with pytest.raises(IsADirectoryError):
        NewFile(tmp_path)


def test_the_ring_and_the_file_agree_on_the_layout(tmp_path):
    """A destination lays the file out through format.FileWriter (save_async's pool through
    its subclass DeferredLayout): same bytes as save, apart from the writer's io_path and time."""
    a, b = tmp_path / "a.gdsckpt", tmp_path / "b.gdsckpt"
    gdsckpt.save(_state(3), a, backend="cpu", chunk_bytes=16 << 10)
    gdsckpt.save_async(_state(3), b, backend="cpu", chunk_bytes=16 << 10).result(30)
    (head_a, index_a, _), (head_b, index_b, _) = split(a.read_bytes()), split(b.read_bytes())
    assert head_a == head_b  # header, every record and its padding
    assert index_a["chunks"] == index_b["chunks"] and index_b["writer"]["io_path"] == "pool"


# ---------------------------------------------------------------- one snapshot vocabulary


def test_save_async_takes_the_snapshot_names(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    for mode in ("host", "device"):
        assert gdsckpt.save_async(state, tmp_path / f"{mode}.gdsckpt", snapshot=mode).result(30).mode == mode
    for spelling in (dict(snapshot="overlap"), dict(overlap=True), dict(snapshot=Snapshot.OVERLAP)):
        fut = gdsckpt.save_async(state, tmp_path / "o.gdsckpt", optimizer=opt, **spelling)
        model(torch.randn(2, 8)).sum().backward()
        opt.step()  # waits for the snapshot
        assert fut.result(30).mode == "overlap"
    with pytest.raises(ValueError, match="snapshot must be one of 'host', 'overlap', 'device', not 'cpu'"):
        gdsckpt.save_async(state, tmp_path / "c.gdsckpt", snapshot="cpu")  # GdsckptWriter's only
    with pytest.raises(ValueError, match="needs optimizer="):
        gdsckpt.save_async(state, tmp_path / "c.gdsckpt", snapshot="overlap")
    with pytest.raises(ValueError, match="host snapshot"):
        gdsckpt.save_async(state, tmp_path / "c.gdsckpt", snapshot="device", overlap=True, optimizer=opt)
    assert not (tmp_path / "c.gdsckpt").exists()
