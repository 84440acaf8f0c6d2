"""The public options (gdsckpt/options.py, gdsckpt/manager/options.py): the save options
and snapshot modes the integrations take from there (and from no private module), and the
Checkpointer's options grouped by tier, frozen and checked on construction (a typed error naming
the field), the same Checkpointer as today's flat keywords, which stay shorthand for them."""

from __future__ import annotations

import ast
import dataclasses
import importlib
from pathlib import Path

import pytest

import gdsckpt
from gdsckpt.manager.checkpointer import Checkpointer
from gdsckpt.options import (
    CheckpointerOptions, KeepEvery, LatestN, LocalOptions, MemoryOptions, RemoteOptions, SaveOptions, Snapshot,
    check_save_options,
)
from conftest import assert_same
from test_manager import OPTS, state_for

PACKAGE = Path(gdsckpt.__file__).parent
INTEGRATIONS = PACKAGE / "integrations"
PUBLIC = {"gdsckpt", "gdsckpt.options", "gdsckpt.errors", "gdsckpt.dcp"}


def test_the_options_are_the_pipelines():
    pipeline = importlib.import_module("gdsckpt.writing.save")
    assert pipeline.SaveOptions is SaveOptions and pipeline.Snapshot is Snapshot
    assert SaveOptions(codec="zstd").chunk_bytes_for("cpu") > 0
    with pytest.raises(ValueError, match="^'chunk' is not a save option here"):
        check_save_options({"chunk": 1})
    with pytest.raises(ValueError, match="^snapshot must be one of 'host', not 'device'"):
        check_save_options({"snapshot": "device"}, {"snapshot"}, (Snapshot.HOST,))


def _is_module(name: str) -> bool:
    where = PACKAGE.joinpath(*name.split(".")[1:])
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def _gdsckpt_imports(path: Path) -> list[str]:
    """The gdsckpt modules `path` (a module of gdsckpt.integrations) imports, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] == "gdsckpt"]
        elif isinstance(node, ast.ImportFrom):
            base = ["gdsckpt", "integrations"][:3 - node.level] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if module.split(".")[0] == "gdsckpt":  # `from gdsckpt import save` imports gdsckpt.save
                out += [f"{module}.{a.name}" if _is_module(f"{module}.{a.name}") else module for a in node.names]
    return out


def test_integrations_import_only_public_modules():
    files = sorted(INTEGRATIONS.glob("*.py"))
    assert {p.name for p in files} >= {"accelerate.py", "lightning.py", "torchtitan.py", "transformers.py"}
    for path in files:
        if path.name == "__init__.py":
            continue
        imported = _gdsckpt_imports(path)
        private = [m for m in imported if m not in PUBLIC and not m.startswith("gdsckpt.integrations")]
        assert not private, f"{path.name} imports {private}: integrations use {sorted(PUBLIC)} only"


def test_the_import_check_sees_a_private_import(tmp_path):
    p = tmp_path / "x.py"
    p.write_text("import gdsckpt\nfrom gdsckpt.writing.save import SaveOptions\nfrom gdsckpt.writing import async_save\n"
                 "from gdsckpt.options import Snapshot\nfrom ..errors import GdsckptError\nfrom .. import RNG\n")
    assert _gdsckpt_imports(p) == ["gdsckpt", "gdsckpt.writing.save", "gdsckpt.writing.async_save", "gdsckpt.options",
                                   "gdsckpt.errors", "gdsckpt"]


# ---------------------------------------------------------------- the Checkpointer's options


@pytest.mark.parametrize("make,kind,msg", [
    (lambda: LocalOptions(keep=0), ValueError, "LocalOptions.keep must be at least 1 (the newest step is never "
                                               "deleted), got 0"),
    (lambda: LocalOptions(keep="3"), ValueError, "LocalOptions.keep must be an int, got str '3'"),
    (lambda: MemoryOptions(keep=1.5), ValueError, "MemoryOptions.keep must be an int, got float 1.5"),
    (lambda: MemoryOptions(every_local=0), ValueError, "MemoryOptions.every_local must be at least 1, got 0"),
    (lambda: MemoryOptions(cap_bytes=-1), ValueError, "MemoryOptions.cap_bytes must be at least 1, got -1"),
    (lambda: RemoteOptions(3), TypeError, "RemoteOptions.url must be a string such as 's3://bucket/prefix', got int 3"),
    (lambda: RemoteOptions("s3://b/p", keep=0), ValueError, "RemoteOptions.keep must be at least 1 (or None: all), "
                                                            "got 0"),
    (lambda: RemoteOptions("s3://b/p", every=True), ValueError, "RemoteOptions.every must be an int, got bool True"),
    (lambda: RemoteOptions("s3://b/p", store_options=[1]), TypeError,
     "RemoteOptions.store_options must be a dict of keyword arguments or None, got list [1]"),
    (lambda: RemoteOptions("s3://b/p", upload="no"), TypeError,
     "RemoteOptions.upload must be True or False, got str 'no'"),
    (lambda: CheckpointerOptions(local=3), TypeError, "CheckpointerOptions.local must be a LocalOptions, got int 3"),
    (lambda: CheckpointerOptions(memory=True), TypeError,
     "CheckpointerOptions.memory must be a MemoryOptions or None, got bool True"),
    (lambda: CheckpointerOptions(remote="s3://b/p"), TypeError,
     "CheckpointerOptions.remote must be a RemoteOptions or None, got str 's3://b/p'"),
    (lambda: CheckpointerOptions(read_only=1), TypeError,
     "CheckpointerOptions.read_only must be True or False, got int 1"),
])
def test_options_checked_naming_the_field(make, kind, msg):
    with pytest.raises(kind) as e:
        make()
    assert type(e.value) is kind and str(e.value) == msg


def test_options_are_frozen_and_copied():
    store = {"timeout": 5}
    r = RemoteOptions("s3://b/p", store_options=store)
    store["timeout"] = 50  # changed after: not these options
    assert r.store_options == {"timeout": 5}
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.keep = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        CheckpointerOptions().local = LocalOptions(1)


def test_grouped_options_are_the_flat_keywords(tmp_path, shm):
    policy = LatestN(2) | KeepEvery(4)
    flat = dict(keep=policy, memory=True, keep_memory=3, every_local=3, memory_bytes=1 << 30, save_options=OPTS)
    want = CheckpointerOptions(local=LocalOptions(policy), save_options=OPTS,
                               memory=MemoryOptions(keep=3, every_local=3, cap_bytes=1 << 30))
    runs = {}
    for name, kwargs in {"flat": flat,
                         "groups": dict(local=LocalOptions(keep=policy), save_options=OPTS,
                                        memory=MemoryOptions(keep=3, every_local=3, cap_bytes=1 << 30)),
                         "options": dict(options=want)}.items():
        d = tmp_path / name
        with Checkpointer(d, **kwargs) as ck:
            assert ck.options == want and ck.policy.keep == policy
            for s in range(1, 14):  # on disk: 1, 4, 7, 10, 13
                ck.save_async(s, state_for(s, n=2000)).result()
                ck.memory.wait_local()
            ck.prune()  # retention now: the last local write's own may not have been asked for yet
            runs[name] = (ck.layout.local_steps(), ck.memory.steps(), ck.memory.every_local,
                          ck.status()["memory"]["cap_bytes"])
            assert_same(ck.restore(step=4).state, state_for(4, n=2000))
    assert runs["flat"] == runs["groups"] == runs["options"] == ([4, 10, 13], [11, 12, 13], 3, 1 << 30), runs


def test_a_setting_given_twice_is_refused(tmp_path):
    cases = [
        (dict(local=LocalOptions(2), keep=3), "keep= given beside local=LocalOptions(...)"),
        (dict(memory=MemoryOptions(), keep_memory=3, every_local=2),
         "every_local=, keep_memory= given beside memory=MemoryOptions(...)"),
        (dict(remote=RemoteOptions("s3://b/p"), keep_remote=3), "keep_remote= given beside remote=RemoteOptions(...)"),
        (dict(options=CheckpointerOptions(), keep=2), "keep= given beside options="),
        (dict(options=CheckpointerOptions(), memory=MemoryOptions()), "memory= given beside options="),
    ]
    for kwargs, msg in cases:
        with pytest.raises(ValueError) as e:
            Checkpointer(tmp_path / "d", **kwargs)
        assert str(e.value).startswith(msg + ": set it in "), str(e.value)
    with pytest.raises(TypeError, match="^options must be a CheckpointerOptions, got dict"):
        Checkpointer(tmp_path / "d", options={"keep": 2})
    with pytest.raises(TypeError, match="^local must be a LocalOptions, got int 2"):
        Checkpointer(tmp_path / "d", local=2)
    with pytest.raises(ValueError, match="^every_local=, memory_bytes= and replicas= configure the memory tier: pass memory=True"):
        Checkpointer(tmp_path / "d", every_local=2)
    assert not (tmp_path / "d").exists()  # refused before anything was created


def test_remote_options_reach_the_store(tmp_path):
    with pytest.raises(ValueError, match=r"^'gs://b/p' is not an object-store URL"):
        Checkpointer(tmp_path / "d", remote=RemoteOptions("gs://b/p", keep=KeepEvery(10)))
    with pytest.raises(ValueError, match=r"^'gs://b/p' is not an object-store URL"):
        Checkpointer(tmp_path / "d", remote="gs://b/p", keep_remote=KeepEvery(10))
    assert not (tmp_path / "d").exists()
