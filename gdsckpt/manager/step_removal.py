"""Removing a step from a Checkpointer's directory without ever following a symlink out of it.

A step may be a link: a run directory with a shared base checkpoint linked in
(DIR/step_00000000 -> ../base/step_00000000), or a step file linked to another run's. What a link
points to is not this run's to delete: the link itself goes, with a warning naming it and its
target. Inside a DCP step directory, a link (a rank file or .metadata linked from elsewhere) is
unlinked as a link too, and named. A removal that fails is logged, never silent."""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

from gdsckpt.core.storage import fsync_dir

log = logging.getLogger("gdsckpt.manager.checkpointer")


def _target(link: Path) -> str:
    try:
        return os.readlink(link)
    except OSError as e:  # removed meanwhile
        return f"? ({type(e).__name__}: {e})"


def _unlink_link(link: Path, what: str) -> None:
    log.warning("gdsckpt: %s %s is a symlink to %s: removing the link only, not what it points to", what, link,
                _target(link))
    link.unlink(missing_ok=True)


def remove_step_path(path: Path, commit_point: str | None = None) -> None:
    """Remove the step at `path` (a file, a DCP directory, or a link to either), then make its
    removal durable. commit_point: the name of a directory step's commit file (DCP's .metadata),
    removed first and durably, so that a kill mid-way leaves an uncommitted directory. A link is
    unlinked, never followed: not the step's link, nor any link inside its directory."""
    parent = path.parent
    if path.is_symlink():
        _unlink_link(path, "step")
    elif path.is_dir():  # not a link (checked above): the step's own directory
        if commit_point is not None and os.path.lexists(path / commit_point):
            meta = path / commit_point
            if meta.is_symlink():
                _unlink_link(meta, "the commit point of step")
            else:
                meta.unlink(missing_ok=True)
            fsync_dir(path)
        for root, dirs, files in os.walk(path):  # os.walk never descends into a linked directory
            for name in dirs + files:
                p = Path(root, name)
                if p.is_symlink():
                    _unlink_link(p, f"in step {path.name}:")

        def failed(_func, failed_path, exc):
            exc = exc[1] if isinstance(exc, tuple) else exc  # onerror's exc_info, onexc's exception
            log.warning("gdsckpt: removing step %s: cannot remove %s: %s: %s", path, failed_path,
                        type(exc).__name__, exc)
        # fd-based on Linux: a link inside is unlinked, never followed (onerror: Python 3.11's name)
        shutil.rmtree(path, **{"onexc" if sys.version_info >= (3, 12) else "onerror": failed})
    else:
        path.unlink(missing_ok=True)
    fsync_dir(parent)
