"""How the CLI writes: JSON documents, progress bars, and a reader that stops reading.

- `emit_json`: one JSON document on stdout (the shapes are in gdsckpt/cli/__init__.py).
- `progress`: a tqdm bar on stderr while stdout and stderr are both a terminal, else nothing
  (piped or redirected output stays clean; TQDM_DISABLE=1 turns it off too).
- `quiet_pipe`: once stdout's reader has gone (`gdsckpt inspect X | head -1`), what is left to
  print goes nowhere and the command runs to its end: no BrokenPipeError traceback, and the exit
  code is still the command's own (a `verify` cut short by `head` does not exit 0 unverified).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from tqdm import tqdm

__all__ = ["emit_json", "progress", "quiet_pipe", "describe_error", "message_of"]


def emit_json(document) -> None:
    json.dump(document, sys.stdout, indent=1, default=str)
    print()


def describe_error(error: BaseException) -> dict:
    """An error as the JSON documents hold it: {"type": its class name, "message"}."""
    return {"type": type(error).__name__, "message": message_of(error)}


def message_of(error: BaseException) -> str:
    """What the CLI says of `error`: an OSError about a path as "PATH: what" (its str() is
    "[Errno 2] No such file or directory: 'PATH'"), anything else as its str()."""
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        names = [n if isinstance(n, str) else os.fsdecode(n) if isinstance(n, bytes) else str(n)
                 for n in (error.filename, error.filename2) if n is not None]
        return f"{' -> '.join(names)}: {error.strerror}"
    return str(error)


def progress(total: float | None, desc: str, unit: str = "B") -> tqdm:
    """A progress bar (update(n) as work is done; close() at the end), shown on a terminal only.
    unit "B": bytes, scaled in decimal units as the rest of the CLI shows them."""
    from tqdm import tqdm  # here: a fraction of a second that --help and a usage error need not wait
    shown = _isatty(sys.stdout) and _isatty(sys.stderr) and not os.environ.get("TQDM_DISABLE")
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1000,
                disable=None if shown else True, leave=False, file=sys.stderr, dynamic_ncols=True)


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced by a test, or closed
        return False


class _PipeGuard:
    """stdout, until its reader goes away: then its descriptor is pointed at /dev/null, so that
    the rest of the output (and the interpreter's last flush) is dropped without an error."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._drop()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._drop()

    def _drop(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def quiet_pipe() -> Iterator[None]:
    """Guard sys.stdout for the block (only where it is a real file: tests' StringIO are left):
    a reader that goes away, and text its encoding cannot show."""
    stream = sys.stdout
    try:
        stream.fileno()
    except (AttributeError, ValueError, OSError):
        yield
        return
    guard = _PipeGuard(stream)
    sys.stdout = guard
    # A key this terminal's encoding cannot show (a lone surrogate, from a file name that was not
    # UTF-8) is shown escaped, not a UnicodeEncodeError that ended the command as a usage error.
    errors = getattr(stream, "errors", None)
    if errors is not None and hasattr(stream, "reconfigure"):
        stream.reconfigure(errors="backslashreplace")
    try:
        yield
    finally:
        guard.flush()
        if errors is not None and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors=errors)
        sys.stdout = stream
