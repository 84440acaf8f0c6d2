"""The CLI's exit codes, and the one place that decides which error means which.

    0  OK           the command did what it was asked; the checkpoint is intact
    1  DAMAGED      a checkpoint is damaged or failed verification, or the command failed
                    (an I/O error, a store that refused or could not be reached, no decoder here)
    2  USAGE        the command line asks for something impossible (argparse's own code too)
    3  NOT_FOUND    a file, directory, step, bucket or object named is not there
"""

from __future__ import annotations

import enum

from ..errors import CheckpointFormatError, GdsckptError, UnsupportedStateError

__all__ = ["ExitCode", "exit_code_for"]


class ExitCode(enum.IntEnum):
    OK = 0
    DAMAGED = 1
    USAGE = 2
    NOT_FOUND = 3


def exit_code_for(error: BaseException) -> ExitCode:
    """The exit code of a command that raised `error` (the most specific kind first: a missing
    store object is a RemoteStoreError and a FileNotFoundError, and it is NOT_FOUND)."""
    if isinstance(error, (FileNotFoundError, KeyError)):
        return ExitCode.NOT_FOUND
    if isinstance(error, CheckpointFormatError):  # ChecksumError, VersionError, a torn or hostile file
        return ExitCode.DAMAGED
    if isinstance(error, (UnsupportedStateError, ValueError, NotADirectoryError, IsADirectoryError,
                          FileExistsError)):
        return ExitCode.USAGE
    if isinstance(error, (GdsckptError, OSError)):
        return ExitCode.DAMAGED
    raise TypeError(f"no exit code for {type(error).__name__}")  # a bug: let its traceback show
