"""What gdsckpt-bench shows while it runs, and what it keeps as it goes.

Progress goes to stderr, never stdout (where the report goes): on a terminal one line that
rewrites itself and is cleared before the report; elsewhere (a pipe, a log file) one plain line
per message. TrainProgress adds --train's position and an ETA. JsonLines appends one JSON object
per line to a file as each figure is measured, so that an interrupted run keeps them.
quiet_dcp_process keeps the INFO lines of DCP's save process out of it.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path


def _clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    """A status line on stderr: rewritten in place on a terminal (at most every `every` seconds
    but for the first of a new message), a plain line per message elsewhere; `done` ends it."""

    def __init__(self, every: float = 0.2, quiet: bool = False):
        self.quiet = quiet  # shows nothing (a torchrun rank but the first)
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.every, self.shown_at, self.showing, self.last = every, 0.0, False, ""

    def __call__(self, msg: str, *, update: bool = False) -> None:
        """Show `msg`; update=True: a refresh of the same message (skipped elsewhere than on a
        terminal, and on one if shown less than `every` seconds ago)."""
        now = time.perf_counter()
        if self.quiet:
            return
        if update and (not self.tty or now - self.shown_at < self.every):
            return
        self.shown_at, self.last = now, msg
        line = f"[{_clock(now - self.t0)}] {msg}"
        if self.tty:
            sys.stderr.write(f"\r\x1b[K{line}")
            self.showing = True
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def note(self, msg: str) -> None:
        """A line that stays (the status line, if any, is redrawn under it on its next update)."""
        if self.quiet:
            return
        self.done()
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        """Clear the status line, so that what comes next starts on a clean line."""
        if self.showing:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self.showing = False


class TrainProgress(Progress):
    """--train's progress: the phase, the loop (method, repeat, step) and an ETA of the loops: the
    steps left at the rate the loops have gone so far (in the first loop: its own rate so far)."""

    def __init__(self, loops: int, steps: int, step_s: float | None = None, **kw):
        super().__init__(**kw)
        self.loops, self.steps, self.loop = loops, steps, 0
        self.step_s = step_s  # the warm-up's seconds a step, until the loops have their own
        self.loop_s = 0.0  # seconds spent in finished loops
        self.loop_t0 = None
        self.label = ""

    def phase(self, msg: str) -> None:
        """A step before the loops (or after them), whose time the ETA does not know ahead."""
        self(msg)

    def start_loop(self, label: str) -> None:
        self.label, self.loop_t0 = label, time.perf_counter()
        self(f"loop {self.loop + 1}/{self.loops}: {label}{self._eta(0)}")

    def step(self, i: int) -> None:
        self(f"loop {self.loop + 1}/{self.loops}: {self.label}, step {i}/{self.steps}{self._eta(i)}", update=True)

    def end_loop(self) -> None:
        self.loop_s += time.perf_counter() - self.loop_t0
        self.loop += 1

    def _eta(self, step: int) -> str:
        done = self.loop * self.steps + step
        rate = self.loop_s / (self.loop * self.steps) if self.loop else self.step_s
        if not rate:
            return ""
        if self.loop_t0 is not None and step and not self.loop:  # the first loop: its own rate so far
            rate = (time.perf_counter() - self.loop_t0) / step
        return f" (ETA {_clock(rate * (self.loops * self.steps - done))})"


class JsonLines:
    """One JSON object per line, appended to `path` by one write(2) each (so that a process
    killed right after keeps it);
    every process of a torchrun job appends to the same file (O_APPEND, one write a line: lines
    are not interleaved). `start` empties the file; `None` as path writes nothing."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = Path(path) if path else None

    def start(self) -> None:
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def write(self, record: dict) -> None:
        if not self.path:
            return
        data = (json.dumps(record, default=str) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


# A line DCP's save process logs at INFO, in the format its logger is given there (rank, time,
# logger name, level, message): "[0] 2026-11-28 13:55:41,269 - root - INFO - Checkpoint background
# process is running..."
_DCP_INFO = re.compile(rb"^\[\d+\] [\d-]+ [\d:,]+ - [\w.]+ - INFO - ")


@contextmanager
def quiet_dcp_process():
    """Inside, processes started get a stderr without DCP's INFO lines; ours is itself again after.

    dcp.async_save(async_checkpointer_type=PROCESS) spawns a save process that gives the root
    logger a handler at INFO ("Checkpoint background process is running...", a few lines a save).
    Nothing in this process configures that one, so its stderr is a pipe, whose lines a thread
    passes on but for those (warnings, errors and tracebacks go through), for as long as it lives."""
    sys.stderr.flush()
    read, write = os.pipe()
    ours = os.dup(2)
    sink = os.dup(2)

    def forward() -> None:
        with os.fdopen(read, "rb") as lines:
            for line in lines:
                if not _DCP_INFO.match(line):
                    os.write(sink, line)
    threading.Thread(target=forward, name="bench-dcp-stderr", daemon=True).start()
    os.dup2(write, 2)
    os.close(write)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(ours, 2)
        os.close(ours)
