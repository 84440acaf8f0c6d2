"""A step that is a symlink (a shared base checkpoint linked into a run's directory), or a link
inside a DCP step's directory, is never followed when the step is deleted: retention, `gdsckpt
prune` and rollback unlink the link itself, say so (naming the link and its target), and leave what
it points to, another run's checkpoint, intact (issue 44, 4). The two-rank DCP case, with real
DCP steps over gloo: test_manager_dcp.py."""

from __future__ import annotations

import logging
import os

import pytest

from gdsckpt.manager.checkpointer import Checkpointer, step_name
from gdsckpt.manager.steps import DCP_METADATA, DcpSteps, FileSteps
from conftest import assert_same
from test_cli import run_cli
from test_manager import OPTS, state_for


def _base_run(root, steps=(0,)):
    """Another run's directory, its steps saved by its own Checkpointer."""
    base = root / "base"
    with Checkpointer(base, keep=len(steps), save_options=OPTS) as ck:
        for s in steps:
            ck.save(s, state_for(s))
    return base


def _link_in(run, base, step, distributed=False):
    run.mkdir(exist_ok=True)
    link = run / step_name(step, distributed)
    link.symlink_to(base / step_name(step, distributed))
    return link


def _said(caplog, link, target):
    return any("symlink" in r.getMessage() and str(link) in r.getMessage() and str(target) in r.getMessage()
               and "link only" in r.getMessage() for r in caplog.records)


def test_retention_unlinks_a_linked_step_file_and_says_so(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="gdsckpt.manager.checkpointer")
    base = _base_run(tmp_path)
    target = base / step_name(0, False)
    before = target.read_bytes()
    run = tmp_path / "run"
    link = _link_in(run, base, 0)
    with Checkpointer(run, keep=2, save_options=OPTS) as ck:
        assert ck.steps() == [0]
        for s in (1, 2):
            ck.save(s, state_for(s))
        assert ck.steps() == [1, 2]
    assert not os.path.lexists(link)
    assert target.read_bytes() == before  # the other run's step, untouched
    assert _said(caplog, link, target), caplog.text
    with Checkpointer(base) as ck:
        assert_same(ck.restore().state, state_for(0))


def test_prune_and_rollback_unlink_linked_steps(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="gdsckpt.manager.checkpointer")
    base = _base_run(tmp_path, steps=(0, 9))
    run = tmp_path / "run"
    old, new = _link_in(run, base, 0), _link_in(run, base, 9)
    with Checkpointer(run, keep=5, save_options=OPTS) as ck:
        ck.rollback(0)  # step 9, a link to the other run's: the link goes
        assert ck.steps() == [0]
        for s in (1, 2):
            ck.save(s, state_for(s))
    assert not os.path.lexists(new) and _said(caplog, new, base / step_name(9, False)), caplog.text
    rc, out, err = run_cli("prune", run, "--keep", "1", "--yes")
    assert rc == 0, err
    assert "removed: local steps [0, 1]" in out, out
    assert not os.path.lexists(old) and _said(caplog, old, base / step_name(0, False)), caplog.text
    with Checkpointer(base, keep=2) as ck:  # both of the other run's steps, intact
        assert ck.steps() == [0, 9]
        assert_same(ck.restore(step=0).state, state_for(0))
        assert_same(ck.restore(step=9).state, state_for(9))


def _dcp_step(d, files=("__0_0.gdsckpt",)):
    """A DCP step's directory as DcpSteps.delete meets it: its .metadata and rank files."""
    d.mkdir(parents=True)
    for name in (DCP_METADATA, *files):
        (d / name).write_bytes(b"x" * 100)
    return d


def test_deleting_a_linked_dcp_step_leaves_its_target(tmp_path, caplog):
    """The reproduction's step: DIR/step_00000000 -> another run's step directory. Its .metadata
    (that step's commit point) was unlinked through the link, then rmtree of the link failed,
    silently."""
    caplog.set_level(logging.INFO, logger="gdsckpt.manager.checkpointer")
    other = _dcp_step(tmp_path / "base" / step_name(0, True))
    run = tmp_path / "run"
    link = _link_in(run, tmp_path / "base", 0, distributed=True)
    layout = DcpSteps(run, {}, rank=0)
    assert layout.local_steps() == [0]
    layout.delete(0)
    assert not os.path.lexists(link)
    assert sorted(os.listdir(other)) == [DCP_METADATA, "__0_0.gdsckpt"]
    assert _said(caplog, link, other), caplog.text
    assert layout.local_steps() == []


def test_links_inside_a_dcp_step_are_unlinked_not_followed(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="gdsckpt.manager.checkpointer")
    outside = _dcp_step(tmp_path / "elsewhere", files=("__1_0.gdsckpt", "shared"))
    run = tmp_path / "run"
    step = _dcp_step(run / step_name(3, True))
    (step / DCP_METADATA).unlink()
    (step / DCP_METADATA).symlink_to(outside / DCP_METADATA)  # its commit point, linked
    (step / "__1_0.gdsckpt").symlink_to(outside / "__1_0.gdsckpt")
    (step / "sub").symlink_to(outside)  # a linked directory
    layout = DcpSteps(run, {}, rank=0)
    assert layout.local_steps() == [3]
    layout.delete(3)
    assert not os.path.lexists(step)
    assert sorted(os.listdir(outside)) == [DCP_METADATA, "__1_0.gdsckpt", "shared"]
    for name in (DCP_METADATA, "__1_0.gdsckpt", "sub"):
        assert _said(caplog, step / name, outside / name if name != "sub" else outside), (name, caplog.text)


def test_a_failed_removal_is_logged_not_silent(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="gdsckpt.manager.checkpointer")
    step = _dcp_step(tmp_path / "run" / step_name(4, True))
    real = os.unlink

    def refuse(path, *a, **k):
        if os.fspath(path).endswith("__0_0.gdsckpt"):
            raise PermissionError(13, "Permission denied (injected)", os.fspath(path))
        return real(path, *a, **k)
    monkeypatch.setattr(os, "unlink", refuse)
    DcpSteps(tmp_path / "run", {}, rank=0).delete(4)
    monkeypatch.undo()
    assert not (step / DCP_METADATA).exists()  # uncommitted all the same
    assert "cannot remove" in caplog.text and "__0_0.gdsckpt" in caplog.text and "injected" in caplog.text


@pytest.mark.parametrize("distributed", [False, True])
def test_a_linked_step_does_not_count_once_its_link_is_gone(tmp_path, distributed):
    """The directory's listing sees a link removed by another process (not through this layout)."""
    if distributed:
        _dcp_step(tmp_path / "base" / step_name(0, True))
    else:
        _base_run(tmp_path)
    link = _link_in(tmp_path / "run", tmp_path / "base", 0, distributed)
    layout = DcpSteps(tmp_path / "run", {}, rank=0) if distributed else FileSteps(tmp_path / "run", {})
    assert layout.local_steps() == [0]
    link.unlink()
    assert layout.local_steps() == []
