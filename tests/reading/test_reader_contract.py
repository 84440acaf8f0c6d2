"""Issue 12, findings 2-6: load_into's contract, shared tensors, paths and arguments, loose ends,
and files from elsewhere (trusted=False). Each test failed on main before the fix (2026-11-23).
(Finding 1, the checksum, is tests/format/test_checksum.py and tests/format/test_format_versions.py.)"""

from __future__ import annotations

import collections
import copy
import enum
import errno
import json
import os
import stat
from pathlib import Path
import subprocess
import sys
import time

import pytest
import torch

import gdsckpt
from gdsckpt import cli
from gdsckpt.reading import isolated
from gdsckpt.format import file as fmt
from gdsckpt.engine.cpu_backend import CpuBackend
from conftest import assert_same
from ckpt_tools import rebuild, set_chunk, split

CUDA = torch.cuda.is_available()


def _flip(p, offset: int) -> None:
    b = bytearray(p.read_bytes())
    b[offset] ^= 0x01
    p.write_bytes(bytes(b))


def _state(n=8, elems=3000):
    g = torch.Generator().manual_seed(1)
    return {f"t{i}": torch.randn(elems, generator=g) for i in range(n)}


# ---------------------------------------------------------------- 2. load_into's contract


def _sentinel_like(state):
    return {k: torch.full_like(v, -12345.0) for k, v in state.items()}


def _changed(target) -> list[str]:
    return [k for k, v in target.items() if not torch.all(v == -12345.0)]


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_load_into_failure_lists_exactly_the_overwritten_keys(tmp_path, codec):
    """A corrupt chunk half-way: the error names the keys already written (wholly or in part),
    as a list on the exception too, and every other target is untouched."""
    state = _state()  # 8 x 12,000 bytes in 16 KiB chunks: tensors straddle chunk boundaries
    p = tmp_path / "c.gdsckpt"
    gdsckpt.save(state, p, codec=codec, chunk_bytes=16 << 10)
    ck = gdsckpt.open(p)
    bad = 3
    _flip(p, ck.index.records[bad].file_offset + 100)
    target = _sentinel_like(state)
    with pytest.raises(gdsckpt.ChecksumError) as ei:
        gdsckpt.load_into(p, target)
    e = ei.value
    changed = _changed(target)
    assert 0 < len(changed) < len(state)
    assert e.overwritten == changed, (e.overwritten, changed)
    assert f"chunk {bad}" in str(e) and "already overwritten" in str(e) and repr(changed[0]) in str(e)
    # exactly the tensors of chunks 0..bad-1 (the checksum of chunk `bad` failed before its decode)
    plan = ck.index.plan
    expect = sorted({plan.tensors[s.tensor].key for c in plan.chunks[:bad] for s in c.segments})
    assert sorted(changed) == expect


def test_load_into_atomic_touches_nothing_on_damage(tmp_path):
    state = _state()
    p = tmp_path / "a.gdsckpt"
    gdsckpt.save(state, p, codec="raw", chunk_bytes=16 << 10)
    last = gdsckpt.open(p).index.records[-1]
    _flip(p, last.file_offset + 7)  # the last chunk: a streaming load would have written all but it
    target = _sentinel_like(state)
    with pytest.raises(gdsckpt.ChecksumError) as ei:
        gdsckpt.load_into(p, target, atomic=True)
    assert ei.value.overwritten == [] and _changed(target) == []
    assert "had not overwritten any target" in str(ei.value)
    streaming = _sentinel_like(state)
    with pytest.raises(gdsckpt.ChecksumError) as ei:
        gdsckpt.load_into(p, streaming)
    assert len(ei.value.overwritten) == len(state) - 1 or len(ei.value.overwritten) == len(state)


def test_load_into_atomic_checks_forged_zstd_frame_headers_first(tmp_path):
    """A chunk whose checksum is right but whose zstd frame header lies (a forger's chunk) is
    refused in atomic's first pass, before any target is written."""
    state = _state()
    p = tmp_path / "z.gdsckpt"
    gdsckpt.save(state, p, codec="zstd", chunk_bytes=16 << 10)
    data = p.read_bytes()
    _, doc, _ = split(data)
    i = max(k for k, c in enumerate(doc["chunks"]) if not c.get("raw"))
    rec = doc["chunks"][i]
    stored = bytearray(data[rec["file_offset"]:rec["file_offset"] + rec["stored"]])
    stored[0] ^= 0xFF  # the zstd magic
    area, doc = set_chunk(data, doc, i, bytes(stored), frames=rec["frames"])
    p.write_bytes(rebuild(data, doc, data_area=area))
    target = _sentinel_like(state)
    with pytest.raises(gdsckpt.CheckpointFormatError, match=f"chunk {i}") as ei:
        gdsckpt.load_into(p, target, atomic=True)
    assert ei.value.overwritten == [] and _changed(target) == []


def test_load_into_failure_does_not_list_non_contiguous_targets_not_yet_copied(tmp_path):
    state = {"a": torch.randn(4096), "t": torch.randn(64, 64).t().contiguous(), "z": torch.randn(4096)}
    p = tmp_path / "n.gdsckpt"
    gdsckpt.save(state, p, codec="raw", chunk_bytes=16 << 10)
    ck = gdsckpt.open(p)
    _flip(p, ck.index.records[-1].file_offset)
    t_target = torch.full((64, 64), -12345.0).t()  # non-contiguous: decoded into a temporary first
    target = {"a": torch.full((4096,), -12345.0), "t": t_target, "z": torch.full((4096,), -12345.0)}
    with pytest.raises(gdsckpt.ChecksumError) as ei:
        gdsckpt.load_into(p, target)
    assert ei.value.overwritten == _changed(target) == ["a"]


def test_load_into_parameter_targets_copied_after_the_read(tmp_path):
    """nn.Parameter targets (leaves that require grad) that get a copy after the read: the second
    untied target of a tied file, and a non-contiguous target's copy back from its temporary."""
    w = torch.randn(4, 3)
    p = tmp_path / "tied.gdsckpt"
    gdsckpt.save({"wte": w, "lm_head": w, "step": 3, "b": torch.arange(6.0).reshape(2, 3)}, p)
    param = lambda *shape: torch.nn.Parameter(torch.zeros(*shape))  # noqa: E731
    state = {"wte": param(4, 3), "lm_head": param(4, 3), "step": 0, "b": param(3, 2).t()}
    gdsckpt.load_into(p, state)
    assert torch.equal(state["wte"], w) and torch.equal(state["lm_head"], w) and state["step"] == 3
    assert torch.equal(state["b"], torch.arange(6.0).reshape(2, 3)) and state["lm_head"].requires_grad


def test_load_into_conjugate_and_negative_view_targets(tmp_path):
    """A conjugate (or negative) view's bytes are not its values: it is filled as a non-contiguous
    target is, through a temporary copied back, and reads as the saved tensor."""
    c = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    p = tmp_path / "c.gdsckpt"
    gdsckpt.save({"c": c, "n": torch.arange(3.0)}, p)
    target = {"c": torch.zeros(2, dtype=torch.complex64).conj(), "n": torch._neg_view(torch.zeros(3))}
    gdsckpt.load_into(p, target)
    assert target["c"].is_conj() and torch.equal(target["c"].resolve_conj(), c)
    assert target["n"].is_neg() and torch.equal(target["n"].resolve_neg(), torch.arange(3.0))


def test_load_into_refuses_a_target_whose_elements_share_memory(tmp_path):
    """An expand()ed (stride-0) or self-overlapping as_strided target cannot hold distinct values:
    a StateMismatchError naming it before anything is read. Transposes and slices are fine."""
    p = tmp_path / "x.gdsckpt"
    gdsckpt.save({"a": torch.arange(4.0), "b": torch.arange(6.0).reshape(2, 3)}, p)
    for b in (torch.zeros(3).expand(2, 3), torch.zeros(10).as_strided((2, 3), (2, 1))):
        target = {"a": torch.zeros(4), "b": b}
        with pytest.raises(gdsckpt.StateMismatchError, match="'b'.*share memory"):
            gdsckpt.load_into(p, target)
        assert not target["a"].any() and not b.any()
    for b in (torch.zeros(3, 2).t(), torch.zeros(2, 6)[:, ::2], torch.zeros(6).as_strided((2, 3), (1, 2))):
        gdsckpt.load_into(p, {"a": torch.zeros(4), "b": b})
        assert torch.equal(b, torch.arange(6.0).reshape(2, 3)), b


def test_load_into_failure_in_a_copy_after_the_read_lists_what_it_wrote(tmp_path):
    """A copy after the read that fails (here into an inference tensor, whose in-place update
    outside inference mode raises, after writing it): the error lists every target the read
    filled and the copies made, the failing one included, and no other."""
    p = tmp_path / "c.gdsckpt"
    w = torch.randn(2, 3)
    gdsckpt.save({"a": torch.arange(4.0), "w": w, "u": w, "z": torch.ones(3)}, p, codec="raw")
    with torch.inference_mode():
        frozen, frozen_too = torch.full((3, 2), -12345.0), torch.full((2, 3), -12345.0)
    # non-contiguous: copied back from its temporary after the read
    target = {"a": torch.full((4,), -12345.0), "w": frozen.t(), "u": torch.full((2, 3), -12345.0),
              "z": torch.full((3,), -12345.0)}
    with pytest.raises(RuntimeError, match="inference") as ei:
        gdsckpt.load_into(p, target)
    assert ei.value.overwritten == _changed(target) == ["a", "w", "z"], ei.value.overwritten
    assert "already overwritten 3 target" in str(ei.value.__notes__)
    # an untied second target of a tied file: copied from the first after the read
    target = {"a": torch.full((4,), -12345.0), "w": torch.full((2, 3), -12345.0), "u": frozen_too,
              "z": torch.full((3,), -12345.0)}
    with pytest.raises(RuntimeError, match="inference") as ei:
        gdsckpt.load_into(p, target)
    assert ei.value.overwritten == _changed(target) == ["a", "w", "u", "z"], ei.value.overwritten


# ---------------------------------------------------------------- 3. shared tensors


def test_tied_tensors_are_stored_once_and_load_tied(tmp_path):
    w = torch.randn(1000, 37)
    p = tmp_path / "tied.gdsckpt"
    stats = gdsckpt.save({"wte": w, "lm_head": w, "other": [w, 5]}, p, codec="raw")
    assert stats.logical_bytes == w.nbytes and stats.stored_bytes == w.nbytes
    out = gdsckpt.load(p)
    assert out["wte"] is out["lm_head"] is out["other"][0]
    assert torch.equal(out["wte"], w)
    ck = gdsckpt.open(p)
    assert ck.keys() == ["wte", "lm_head", "other/0"]
    assert torch.equal(ck.get_tensor("lm_head"), w)
    got = ck.read(["wte", "lm_head"])
    assert got["wte"] is got["lm_head"]


class _Tied(torch.nn.Module):
    def __init__(self, n=50):
        super().__init__()
        self.wte = torch.nn.Embedding(n, 8)
        self.lm_head = torch.nn.Linear(8, n, bias=False)
        self.lm_head.weight = self.wte.weight


def test_model_state_dict_with_tied_weights(tmp_path):
    """state_dict() gives each name its own detach() of the tied parameter: same memory, two
    objects. Stored once; load_into fills the shared parameter once; torch.save agrees."""
    torch.manual_seed(0)
    src = _Tied()
    p = tmp_path / "m.gdsckpt"
    stats = gdsckpt.save(src.state_dict(), p, codec="raw")
    assert stats.logical_bytes == src.wte.weight.nbytes
    out = gdsckpt.load(p)
    assert out["wte.weight"] is out["lm_head.weight"]
    dst = _Tied()
    stats = gdsckpt.load_into(p, dst.state_dict())
    assert stats.logical_bytes == src.wte.weight.nbytes  # read and filled once
    assert torch.equal(dst.lm_head.weight, src.wte.weight) and dst.lm_head.weight is dst.wte.weight
    # tied in the file, untied in the target: both targets are filled
    untied = {"wte.weight": torch.zeros(50, 8), "lm_head.weight": torch.zeros(50, 8)}
    gdsckpt.load_into(p, untied)
    assert torch.equal(untied["wte.weight"], src.wte.weight) and torch.equal(untied["lm_head.weight"], src.wte.weight)


def test_untied_file_into_tied_target(tmp_path):
    """A file that stores tied weights twice (format 1.0 did) fills a tied target once, from the
    first of its keys; the second stored copy is not read."""
    w = torch.randn(128, 8)  # 4 KiB: one chunk each
    p = tmp_path / "u.gdsckpt"
    gdsckpt.save({"wte.weight": w.clone(), "lm_head.weight": w.clone() + 1}, p, codec="raw", chunk_bytes=4096)
    dst = _Tied(128)
    stats = gdsckpt.load_into(p, dst.state_dict())
    assert torch.equal(dst.wte.weight, w) and stats.logical_bytes == 4096  # one of two chunks


def test_overlapping_views_that_differ_are_refused_naming_both(tmp_path):
    w = torch.randn(10, 10)
    for other in (w.t(), w[3], w[2:5], w.view(torch.int32)):
        with pytest.raises(gdsckpt.UnsupportedStateError, match="'a' and 'b'"):
            gdsckpt.save({"a": w, "b": other}, tmp_path / "o.gdsckpt")
    assert not (tmp_path / "o.gdsckpt").exists()
    # views of one storage that do not overlap are stored apart, as before
    gdsckpt.save({"a": w[:5], "b": w[5:]}, tmp_path / "ok.gdsckpt")
    assert torch.equal(gdsckpt.load(tmp_path / "ok.gdsckpt")["b"], w[5:])


def test_load_into_overlapping_targets_are_refused_naming_both(tmp_path):
    """Targets that overlap without being identical views would be filled one over the other: a
    StateMismatchError naming both, before anything is read. Identical views (tied) and views of
    one buffer that do not overlap are filled."""
    src = {"a": torch.arange(4.0), "b": torch.arange(6.0).reshape(2, 3) + 10}
    p = tmp_path / "o.gdsckpt"
    gdsckpt.save(src, p)
    buf = torch.zeros(12)
    for a, b in ((buf[0:4], buf[1:7].view(2, 3)), (buf[4:8], buf[0:6].view(2, 3)), (buf[0:8:2], buf[1:7].view(2, 3))):
        with pytest.raises(gdsckpt.StateMismatchError, match="'a' and 'b'|'b' and 'a'"):
            gdsckpt.load_into(p, {"a": a, "b": b})
        assert not buf.any()
    c = torch.zeros(2, dtype=torch.complex64)
    gdsckpt.save({"a": c, "b": c + 1j}, p)
    with pytest.raises(gdsckpt.StateMismatchError, match="'a' and 'b'"):
        gdsckpt.load_into(p, {"a": c, "b": c.conj()})  # one memory, seen two ways
    gdsckpt.save(src, p)
    state = {"a": buf[0:4], "b": buf[4:10].view(2, 3)}
    gdsckpt.load_into(p, state)
    assert torch.equal(state["a"], src["a"]) and torch.equal(state["b"], src["b"])


def test_shared_tensors_in_the_skeleton_need_format_1_1():
    T = fmt.TensorEntry
    tensors = [T("a", "float32", (2,), 0, 0, 8)]
    sk = {"dict": [["a", {"tensor": 0}], ["b", {"list": [{"tensor": 0}]}]]}
    bad = lambda msg, **kw: gdsckpt.CheckpointFormatError(msg, **kw)  # noqa: E731
    assert fmt._check_skeleton(sk, tensors, (1, 1), bad) == {"a": 0, "b/0": 0}
    with pytest.raises(gdsckpt.CheckpointFormatError, match="twice"):
        fmt._check_skeleton(sk, tensors, (1, 0), bad)
    with pytest.raises(gdsckpt.CheckpointFormatError, match="first at another path"):  # first place != key
        fmt._check_skeleton({"list": [{"tensor": 0}, {"tensor": 0}]}, tensors, (1, 1), bad)
    with pytest.raises(gdsckpt.CheckpointFormatError, match="share this key path"):  # 1 and "1": one path
        fmt._check_skeleton({"dict": [["a", {"tensor": 0}], [1, {"tensor": 0}], ["1", {"tensor": 0}]]}, tensors,
                            (1, 1), bad)
    with pytest.raises(gdsckpt.CheckpointFormatError, match="key 'a' twice"):
        fmt._check_skeleton({"dict": [["a", {"tensor": 0}], ["a", {"tensor": 0}]]}, tensors, (1, 1), bad)
    with pytest.raises(gdsckpt.CheckpointFormatError, match="every tensor"):
        fmt._check_skeleton({"dict": [["a", {"value": 1}]]}, tensors, (1, 1), bad)
    with pytest.raises(gdsckpt.CheckpointFormatError, match="odict"):
        fmt._check_skeleton({"odict": {"items": [["a", {"tensor": 0}]]}}, tensors, (1, 0), bad)


def test_hostile_alias_paths_are_refused_in_a_file(tmp_path):
    p = tmp_path / "h.gdsckpt"
    gdsckpt.save({"a": torch.ones(3), "b": torch.zeros(3)}, p, codec="raw")
    data = p.read_bytes()
    _, doc, _ = split(data)
    for skeleton, match in [({"dict": [["a", {"tensor": 0}], ["b", {"tensor": 1}], [2, {"tensor": 0}],
                                       ["2", {"tensor": 1}]]}, "share"),
                            ({"dict": [["a", {"tensor": 0}], ["b", {"tensor": 1}], ["b", {"tensor": 0}]]}, "'b' twice"),
                            ({"dict": [["b", {"tensor": 0}], ["a", {"tensor": 1}]]}, "first at another path"),
                            ({"dict": [["a", {"tensor": 0}], ["c", {"tensor": 0}]]}, "every tensor")]:
        d = copy.deepcopy(doc)
        d["skeleton"] = skeleton
        q = tmp_path / "bad.gdsckpt"
        q.write_bytes(rebuild(data, d))
        with pytest.raises(gdsckpt.CheckpointFormatError, match=match):
            gdsckpt.open(q)
    d = copy.deepcopy(doc)
    d["skeleton"] = {"dict": [["a", {"tensor": 0}], ["b", {"tensor": 1}], ["c", {"list": [{"tensor": 1}]}]]}
    q.write_bytes(rebuild(data, d))
    out = gdsckpt.load(q)
    assert out["c"][0] is out["b"]


# ---------------------------------------------------------------- 4. paths


def test_saving_over_a_file_keeps_its_mode_and_new_files_follow_the_umask(tmp_path):
    p = tmp_path / "m.gdsckpt"
    gdsckpt.save({"w": torch.ones(3)}, p)
    os.chmod(p, 0o600)
    gdsckpt.save({"w": torch.zeros(3)}, p)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    for mask, mode in ((0o027, 0o640), (0o002, 0o664)):  # 0666 less the umask, save and save_async alike
        old = os.umask(mask)
        try:
            q, r = tmp_path / f"new{mask}.gdsckpt", tmp_path / f"async{mask}.gdsckpt"
            gdsckpt.save({"w": torch.ones(3)}, q)
            gdsckpt.save_async({"w": torch.ones(3)}, r).result()
        finally:
            os.umask(old)
        assert stat.S_IMODE(os.stat(q).st_mode) == stat.S_IMODE(os.stat(r).st_mode) == mode


def test_a_save_over_a_fifo_or_device_refuses_it_and_leaves_it(tmp_path):
    """The rename would put a checkpoint in place of a special file (/dev/null, as root)."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for save in (gdsckpt.save, lambda s, p: gdsckpt.save_async(s, p).result()):
        for path in (fifo, Path("/dev/null")):
            with pytest.raises(OSError, match="Not a regular file") as e:
                save({"w": torch.ones(3)}, path)
            assert e.value.filename == str(path)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert os.listdir(tmp_path) == ["pipe"]


def test_save_writes_through_a_symlink(tmp_path):
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    link_dir = tmp_path / "links"
    link_dir.mkdir()
    target = real_dir / "ckpt.gdsckpt"
    gdsckpt.save({"w": torch.ones(3)}, target)
    link = link_dir / "latest.gdsckpt"
    link.symlink_to(target)
    gdsckpt.save({"w": torch.zeros(3)}, link)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert torch.equal(gdsckpt.load(target)["w"], torch.zeros(3))
    assert sorted(os.listdir(link_dir)) == ["latest.gdsckpt"]  # the temporary went beside the target
    # a dangling link: the save creates its target
    dangling = link_dir / "next.gdsckpt"
    dangling.symlink_to(real_dir / "next-real.gdsckpt")
    gdsckpt.save({"w": torch.ones(2)}, dangling)
    assert dangling.is_symlink() and (real_dir / "next-real.gdsckpt").is_file()
    loop = link_dir / "loop.gdsckpt"
    loop.symlink_to(loop)
    with pytest.raises(OSError, match="symbolic links") as ei:
        gdsckpt.save({"w": torch.ones(2)}, loop)
    assert ei.value.filename == str(loop)


class _Exploding(dict):
    """A state whose walk fails loudly: proves a path error comes before the state is touched."""

    def items(self):
        raise AssertionError("the state was walked before the path was checked")


def test_bad_destinations_are_refused_before_anything_is_written(tmp_path):
    (tmp_path / "d.gdsckpt").mkdir()
    with pytest.raises(IsADirectoryError) as ei:
        gdsckpt.save(_Exploding(), tmp_path / "d.gdsckpt")
    assert ei.value.filename == str(tmp_path / "d.gdsckpt")
    missing = tmp_path / "no" / "such" / "x.gdsckpt"
    with pytest.raises(FileNotFoundError) as ei:
        gdsckpt.save(_Exploding(), missing)
    assert ei.value.filename == str(missing) and ".gdsckpt-tmp" not in str(ei.value)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError) as ei:
        gdsckpt.save(_Exploding(), tmp_path / "file" / "x.gdsckpt")
    assert ei.value.filename == str(tmp_path / "file" / "x.gdsckpt")
    assert sorted(os.listdir(tmp_path)) == ["d.gdsckpt", "file"]


def test_unwritable_directory_error_names_the_users_path(tmp_path):
    if os.geteuid() == 0:
        where = "/sys"  # root writes anywhere a mode allows; sysfs refuses new files even to root
    else:
        where = tmp_path / "ro"
        where.mkdir()
        os.chmod(where, 0o500)
    p = os.path.join(where, "x.gdsckpt")
    with pytest.raises(PermissionError) as ei:
        gdsckpt.save({"w": torch.ones(3)}, p)
    assert ei.value.filename == p and ".gdsckpt-tmp" not in str(ei.value), ei.value


def test_path_none_and_non_paths_are_type_errors(tmp_path):
    for bad in (None, 3, [tmp_path / "x"]):
        with pytest.raises(TypeError, match="path must be a str or os.PathLike"):
            gdsckpt.save({"w": torch.ones(1)}, bad)
        with pytest.raises(TypeError, match="path must be a str or os.PathLike"):
            gdsckpt.load(bad)


# ---------------------------------------------------------------- 4./5. arguments


@pytest.fixture
def small(tmp_path):
    p = tmp_path / "s.gdsckpt"
    gdsckpt.save({"w": torch.arange(10.0), "n": {"b": torch.ones(2)}}, p)
    return p


@pytest.mark.parametrize("device", ["cuda:99", "nonsense", "meta", "mps", 3.5] + ([] if CUDA else ["cuda", "cuda:3", 0]))
def test_a_device_that_does_not_exist_is_an_error(small, device):
    with pytest.raises(ValueError, match="device"):
        gdsckpt.load(small, device=device)
    with gdsckpt.open(small) as ck:
        with pytest.raises(ValueError, match="device"):
            ck.get_tensor("w", device=device)
        with pytest.raises(ValueError, match="device"):
            ck.read(["w", "n/b"], device=device)
    assert torch.equal(gdsckpt.load(small, device="cpu")["w"], torch.arange(10.0))


def test_unknown_io_codec_and_options_are_value_errors_before_writing(tmp_path):
    p = tmp_path / "x.gdsckpt"
    for kw in ({"io": "nonsense"}, {"io": None}, {"codec": "nonsense"}, {"codec": {"flaot32": "zstd"}},
               {"codec": {"float32": "lz4"}}, {"codec": 3}, {"chunk_bytes": 4 << 30}, {"chunk_bytes": 4096.0},
               {"ring_depth": 2.5}, {"io_threads": 0}, {"backend": "tpu"}):
        with pytest.raises(ValueError):
            gdsckpt.save({}, p, **kw)  # no tensor: nothing would have looked at the codec before
        with pytest.raises(ValueError):
            gdsckpt.save({"w": torch.ones(3)}, p, **kw)
        assert not p.exists() and os.listdir(tmp_path) == [], kw
    gdsckpt.save({"w": torch.ones(3)}, p)
    with pytest.raises(ValueError):
        gdsckpt.open(p, io="nonsense")
    with pytest.raises(ValueError):
        gdsckpt.open(p, backend="tpu")


def test_io_gds_on_the_cpu_backend_is_gds_unavailable(tmp_path, small):
    p = tmp_path / "g.gdsckpt"
    with pytest.raises(gdsckpt.GDSUnavailableError, match="CPU backend"):
        gdsckpt.save({"w": torch.ones(3)}, p, io="gds")
    assert not p.exists()
    with pytest.raises(gdsckpt.GDSUnavailableError):
        gdsckpt.save({"w": torch.ones(3)}, p, io="gds", backend="cpu")
    with pytest.raises(gdsckpt.GDSUnavailableError):
        gdsckpt.load(small, io="gds", backend="cpu")


@pytest.mark.skipif(CUDA, reason="needs a machine with no GPU")
def test_backend_gpu_without_a_gpu_is_backend_unavailable(tmp_path, small):
    """backend="gpu" where there is no GPU: BackendUnavailableError on load as on save, not torch's
    error from asking for the current CUDA device."""
    with pytest.raises(gdsckpt.BackendUnavailableError):
        gdsckpt.save({"w": torch.ones(3)}, tmp_path / "g.gdsckpt", backend="gpu")
    with pytest.raises(gdsckpt.BackendUnavailableError):
        gdsckpt.load(small, backend="gpu")
    with pytest.raises(gdsckpt.BackendUnavailableError):
        gdsckpt.load_into(small, {"w": torch.zeros(10), "n": {"b": torch.zeros(2)}}, backend="gpu")


# ---------------------------------------------------------------- 6. loose ends


def test_unsupported_tensors_are_typed_errors(tmp_path):
    from torch._subclasses.fake_tensor import FakeTensorMode

    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with FakeTensorMode():
        fake = torch.ones(3)
    for t, match in [(nested, "nested"), (fake, "subclass"), (torch.ones(2, device="meta"), "meta")]:
        with pytest.raises(gdsckpt.UnsupportedStateError, match=match):
            gdsckpt.save({"x": [t]}, tmp_path / "n.gdsckpt")
    assert not (tmp_path / "n.gdsckpt").exists()


def test_save_refuses_what_load_would_refuse(tmp_path):
    p = tmp_path / "z.gdsckpt"
    with pytest.raises(gdsckpt.UnsupportedStateError, match="absurdly large"):
        gdsckpt.save({"z": torch.empty(2 ** 31, 0, 2 ** 31)}, p)
    assert not p.exists()
    gdsckpt.save({"z": torch.empty(2 ** 30, 0, 2 ** 30)}, p)  # just below the limit: saves and loads
    assert gdsckpt.load(p)["z"].shape == (2 ** 30, 0, 2 ** 30)
    with pytest.raises(gdsckpt.UnsupportedStateError, match="digits"):
        gdsckpt.save({10 ** 5000: torch.ones(1)}, p)


def test_ordered_dict_and_metadata_round_trip(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    sd = model.state_dict()
    state = {"model": sd, "plain": {"b": 1, "a": 2}, "od": collections.OrderedDict([("z", 1), ("y", torch.ones(1))])}
    p = tmp_path / "o.gdsckpt"
    gdsckpt.save(state, p)
    out = gdsckpt.load(p)
    assert type(out["model"]) is collections.OrderedDict and type(out["plain"]) is dict
    assert type(out["od"]) is collections.OrderedDict and not hasattr(out["od"], "_metadata")
    assert out["model"]._metadata == sd._metadata and out["model"]._metadata["1"]["version"] == 2
    assert list(out["model"]) == list(sd)
    # load_state_dict reads _metadata: without it BatchNorm's version-1 path would run
    seen = {}
    bn = torch.nn.BatchNorm1d(4)
    real = bn._load_from_state_dict

    def spy(state_dict, prefix, local_metadata, *a, **kw):
        seen.update(local_metadata)
        return real(state_dict, prefix, local_metadata, *a, **kw)

    bn._load_from_state_dict = spy
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), bn)
    fresh.load_state_dict(out["model"])
    assert seen == {"version": 2}


class _Color(enum.IntEnum):
    RED = 1


class _Mode(str, enum.Enum):
    FAST = "fast"


class _Tagged(dict):
    pass


class _Ordered(collections.OrderedDict):
    pass


class _Meters(float):
    pass


class _Raw(bytes):
    pass


@pytest.mark.parametrize("value, base", [
    (_Color.RED, "int"), (_Mode.FAST, "str"), (_Meters(1.5), "float"), (_Raw(b"x"), "bytes"),
    (collections.defaultdict(int, a=1), "dict"), (collections.Counter("ab"), "dict"), (_Tagged(a=1), "dict"),
    (_Ordered(a=1), "dict")], ids=["IntEnum", "str Enum", "float", "bytes", "defaultdict", "Counter", "dict",
                                   "OrderedDict"])
def test_subclasses_of_plain_values_and_dicts_are_refused_naming_the_key(tmp_path, value, base):
    """Nothing in the file could say what the subclass was: it would load, silently, as its base
    type (an IntEnum as an int, a defaultdict without its factory). Refused before anything is
    written, as list and tuple subclasses are; bool, NumPy's scalars (np.float64 is a float) and
    an OrderedDict are values of their own and keep loading as themselves."""
    p = tmp_path / "s.gdsckpt"
    with pytest.raises(gdsckpt.UnsupportedStateError, match=f"at 'cfg/v/0': a subclass of {base}") as info:
        gdsckpt.save({"w": torch.ones(2), "cfg": {"v": [value]}}, p)
    assert f"{base}(value)" in str(info.value)
    assert not p.exists()


def test_bool_numpy_scalars_and_ordered_dicts_keep_their_types(tmp_path):
    import numpy as np
    p = tmp_path / "t.gdsckpt"
    state = {"b": True, "f": np.float64(1.5), "od": collections.OrderedDict(a=1), "s": "x", "i": 3}
    gdsckpt.save(state, p)
    out = gdsckpt.load(p)
    assert out == state and {k: type(v) for k, v in out.items()} == {k: type(v) for k, v in state.items()}


def test_malformed_metadata_is_refused_at_save_and_in_a_file(tmp_path):
    sd = torch.nn.Linear(2, 2).state_dict()
    p = tmp_path / "m.gdsckpt"
    for bad in ({"": {"version": torch.ones(1)}}, {"": 3}, {1: {"version": 1}}, [1]):
        sd._metadata = bad
        with pytest.raises(gdsckpt.UnsupportedStateError, match="_metadata"):
            gdsckpt.save(sd, p)
    sd._metadata = collections.OrderedDict([("", {"version": 1})])
    gdsckpt.save(sd, p)
    data = p.read_bytes()
    _, doc, _ = split(data)
    for body in ({"items": doc["skeleton"]["odict"]["items"], "metadata": {"": {"version": [1]}}},
                 {"items": doc["skeleton"]["odict"]["items"], "metadata": []},
                 {"items": doc["skeleton"]["odict"]["items"], "other": 1},
                 doc["skeleton"]["odict"]["items"]):
        d = copy.deepcopy(doc)
        d["skeleton"] = {"odict": body}
        q = tmp_path / "bad.gdsckpt"
        q.write_bytes(rebuild(data, d))
        with pytest.raises(gdsckpt.CheckpointFormatError, match="odict"):
            gdsckpt.open(q)


# ---------------------------------------------------------------- 5. files from elsewhere


@pytest.fixture
def isolate_cpu_chunks(monkeypatch):
    """The GPU rule on the CPU: every compressed chunk goes to the child first (there, zstd on the
    CPU backend), so that CI exercises the child path. Returns the parent's decode calls."""
    monkeypatch.setattr(isolated, "needs_child", lambda kind, spec, raw: not raw)
    calls = []
    real = CpuBackend.decode

    def decode(self, spec, stored, out, frames):
        calls.append(bytes(stored.numpy()[:32]))
        return real(self, spec, stored, out, frames)

    monkeypatch.setattr(CpuBackend, "decode", decode)
    return calls


def _forged_zstd(tmp_path, state):
    """A file whose chunk i carries a valid checksum and valid zstd frame headers around garbage."""
    p = tmp_path / "f.gdsckpt"
    gdsckpt.save(state, p, codec="zstd", chunk_bytes=16 << 10)
    data = p.read_bytes()
    _, doc, _ = split(data)
    i = [k for k, c in enumerate(doc["chunks"]) if not c.get("raw")][1]
    rec = doc["chunks"][i]
    stored = bytearray(data[rec["file_offset"]:rec["file_offset"] + rec["stored"]])
    stored[20:] = bytes(b ^ 0x5A for b in stored[20:])  # header kept, blocks garbage
    area, doc = set_chunk(data, doc, i, bytes(stored), frames=rec["frames"])
    q = tmp_path / "forged.gdsckpt"
    q.write_bytes(rebuild(data, doc, data_area=area))
    return q, i, bytes(stored[:32])


def test_trusted_false_decodes_in_a_child(tmp_path, isolate_cpu_chunks, monkeypatch):
    """Every compressed chunk is decoded by the child and handed back; this process decodes none."""
    state = {f"t{i}": torch.arange(4000.0) * i for i in range(6)}
    state["raw"] = torch.randint(0, 256, (20000,), dtype=torch.uint8)  # incompressible: raw chunks, read here
    p = tmp_path / "ok.gdsckpt"
    gdsckpt.save(state, p, codec="zstd", chunk_bytes=16 << 10)
    runs = []
    real_run = isolated.run
    monkeypatch.setattr(isolated, "run", lambda *a, **kw: runs.append(list(a[1])) or real_run(*a, **kw))
    with gdsckpt.open(p, trusted=False) as ck:
        assert_same(ck.load(), state)
        assert torch.equal(ck.get_tensor("t3"), state["t3"])
        records = ck.index.records
    compressed = [c for c, r in enumerate(records) if not r.raw]
    assert any(r.raw for r in records) and runs[0] == compressed and len(runs) == 2
    assert isolate_cpu_chunks == []  # nothing decoded in this process
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    gdsckpt.load_into(p, target, trusted=False, atomic=True)  # atomic: a vetting child, then a decoding one
    assert_same(target, state) and len(runs) == 4 and isolate_cpu_chunks == []
    assert_same(gdsckpt.load(p), state) and len(runs) == 4  # trusted (the default): no child
    assert isolate_cpu_chunks


def test_trusted_false_fault_in_the_child_names_the_chunk_and_spares_the_parent(tmp_path, isolate_cpu_chunks):
    state = {f"t{i}": torch.arange(4000.0) * i for i in range(6)}
    q, i, head = _forged_zstd(tmp_path, state)
    with pytest.raises(gdsckpt.CheckpointFormatError, match="isolated child process") as ei:
        gdsckpt.load(q, trusted=False)
    assert ei.value.chunk == i and str(q) in str(ei.value) and ei.value.key
    assert head not in isolate_cpu_chunks, "the forged chunk reached this process's decoder"
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(gdsckpt.CheckpointFormatError) as ei:
        gdsckpt.load_into(q, target, trusted=False)
    changed = [k for k, v in target.items() if v.any()]  # (t0 is all zeros: never counts as changed)
    assert changed and set(changed) <= set(ei.value.overwritten) and len(ei.value.overwritten) < len(state)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(gdsckpt.CheckpointFormatError, match="isolated child") as ei:
        gdsckpt.load_into(q, target, trusted=False, atomic=True)
    assert ei.value.overwritten == [] and all(not v.any() for v in target.values())
    # trusted (the default): the same chunk does reach the decoder here (which, on the CPU, refuses it)
    with pytest.raises(gdsckpt.CheckpointFormatError, match=f"chunk {i}"):
        gdsckpt.load(q)
    assert head in isolate_cpu_chunks


_CRASHING_CHILD = """
import os, signal, sys
sys.path.insert(0, {root!r})
from gdsckpt.engine import cpu_backend
from gdsckpt.reading import isolated
real, n = cpu_backend.CpuBackend.decode, [0]
def decode(self, *a):
    n[0] += 1
    if n[0] == {k}:
        {action}
    return real(self, *a)
cpu_backend.CpuBackend.decode = decode
os._exit(isolated.main())
"""


@pytest.mark.parametrize("action,match", [("os.kill(os.getpid(), signal.SIGSEGV)", "SIGSEGV"),
                                          ("os._exit(7)", "status 7"),
                                          ("import time; time.sleep(60)", "no progress")])
def test_trusted_false_child_that_dies_or_hangs(tmp_path, isolate_cpu_chunks, monkeypatch, action, match):
    """A decoder that kills its process (as a CUDA fault does to a context) or hangs: the parent
    gets a CheckpointFormatError naming the chunk under way and carries on."""
    state = {f"t{i}": torch.arange(4000.0) * i for i in range(6)}
    p = tmp_path / "c.gdsckpt"
    gdsckpt.save(state, p, codec="zstd", chunk_bytes=16 << 10)
    compressed = [c for c, r in enumerate(gdsckpt.open(p).index.records) if not r.raw]
    root = os.path.dirname(os.path.dirname(gdsckpt.__file__))
    script = _CRASHING_CHILD.format(root=root, k=3, action=action)
    monkeypatch.setattr(isolated, "_child_argv", lambda: [sys.executable, "-c", script])
    monkeypatch.setattr(isolated, "CHUNK_TIMEOUT", 3.0)
    t = time.perf_counter()
    with pytest.raises(gdsckpt.CheckpointFormatError, match=match) as ei:
        gdsckpt.load(p, trusted=False)
    assert ei.value.chunk == compressed[2] and time.perf_counter() - t < 30
    assert not isolate_cpu_chunks  # nothing was decoded here
    assert_same(gdsckpt.load(p), state)  # and this process is fine


def test_verify_isolated_cli(tmp_path, capsys):
    state = {f"t{i}": torch.arange(4000.0) * i for i in range(6)}
    p = tmp_path / "v.gdsckpt"
    gdsckpt.save(state, p, codec="zstd", chunk_bytes=16 << 10)
    assert cli.main(["verify", str(p), "--isolated"]) == 0
    assert "decoded in an isolated process" in capsys.readouterr().out
    q, i, _ = _forged_zstd(tmp_path, state)
    assert cli.main(["verify", str(q)]) == 0  # checksums alone cannot see a forgery
    assert cli.main(["verify", str(q), "--isolated"]) == 1  # 1: damaged
    said = capsys.readouterr()
    said = said.out + said.err  # once: the report's DAMAGED line
    assert f"chunk {i}" in said and "isolated child process" in said


def test_isolated_module_has_no_pickle_or_eval():
    src = open(isolated.__file__).read()
    for word in ("pickle", "eval(", "exec(", "multiprocessing", "importlib"):
        assert word not in src.replace("multiprocessing's spawn", ""), word
