"""The CLI's path arguments: a local path that names nothing (or the wrong kind of thing) is an
error naming the path and what the command expected there, before anything is opened. Store URLs
(s3://) are left to the store, whose errors name the bucket and key."""

from __future__ import annotations

import errno
import os

from ..stores import is_remote

__all__ = ["CHECKPOINT", "FILE_OR_FOLDER", "CHECKPOINTER_DIR", "expect_path", "expect_directory"]

# What each kind of argument is, as the messages say it.
CHECKPOINT = "a gdsckpt checkpoint file"
FILE_OR_FOLDER = "a gdsckpt checkpoint file or a DCP step folder"
CHECKPOINTER_DIR = "a Checkpointer directory"


def expect_path(path, expected: str) -> None:
    """`path` (a local one) exists, else FileNotFoundError: "PATH: No such file or directory
    (expected EXPECTED)"."""
    if not is_remote(path) and not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, f"No such file or directory (expected {expected})", str(path))


def expect_directory(path, expected: str) -> None:
    """`path` (a local one) is a directory, else FileNotFoundError (nothing there) or
    NotADirectoryError, naming it and what was expected."""
    if is_remote(path):
        return
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, f"No such directory (expected {expected})", str(path))
    if not os.path.isdir(path):
        raise NotADirectoryError(errno.ENOTDIR, f"Not a directory (expected {expected})", str(path))
