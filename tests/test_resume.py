"""The README's resume example, as a user runs it (issue 20, item 2): one process runs it to the
end; another is SIGKILLed while a save is in progress (its temporary file on disk), then run again
in the same directory. The killed run printed the same losses as the uninterrupted one, and the
resumed run goes on from the newest committed step with exactly the uninterrupted run's losses,
bit for bit: model, AdamW moments, scheduler, step and every generator restored from objects.

In the killed run each fsync is slowed (a wrapper installed before the example runs) so that a save stays in
progress long enough to be killed in the middle of; nothing else is changed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_readme import resume_example

REPO = Path(__file__).resolve().parent.parent

RUNNER = """
import os, sys, time
_fsync = os.fsync
def slow_fsync(fd):
    time.sleep(float(os.environ["SLOW_FSYNC_S"]))
    _fsync(fd)
os.fsync = slow_fsync
code = open(sys.argv[1]).read()
exec(compile(code, "README.md resume example", "exec"), {"__name__": "__main__"})
"""

TEMPORARY = re.compile(r"^\.step_(\d+)\.gdsckpt\.gdsckpt-tmp\.")
LOSS = re.compile(r"^step (\d+) loss (\S+)$")


def _start(tmp: Path, workdir: Path, slow_fsync_s: float = 0.0) -> subprocess.Popen:
    workdir.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               SLOW_FSYNC_S=str(slow_fsync_s), PYTHONWARNINGS="ignore")
    return subprocess.Popen([sys.executable, str(tmp / "runner.py"), str(tmp / "example.py")], cwd=workdir,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _losses(stdout: str) -> dict[int, str]:
    out = {}
    for line in stdout.splitlines():
        m = LOSS.match(line)
        if m:
            out[int(m.group(1))] = m.group(2)
    return out


def test_readme_example_killed_during_a_save_resumes_bit_exact(tmp_path):
    (tmp_path / "runner.py").write_text(RUNNER)
    (tmp_path / "example.py").write_text(resume_example())

    ref = _start(tmp_path, tmp_path / "uninterrupted")
    out, err = ref.communicate(timeout=300)
    assert ref.returncode == 0, err
    want = _losses(out)
    assert sorted(want) == list(range(1, 61))

    run = tmp_path / "killed"
    victim = _start(tmp_path, run, slow_fsync_s=1.0)  # a save takes 2 s: ample time to be killed in
    killed_at = None
    deadline = time.monotonic() + 300
    while killed_at is None and victim.poll() is None and time.monotonic() < deadline:
        temps = [int(m.group(1)) for m in map(TEMPORARY.match, os.listdir(run / "run7") if (run / "run7").is_dir()
                                              else []) if m]
        if temps and max(temps) >= 30:  # step 30's save is being written: kill it now
            victim.send_signal(signal.SIGKILL)
            killed_at = max(temps)
        else:
            time.sleep(0.005)
    out, err = victim.communicate(timeout=60)
    assert killed_at is not None and victim.returncode == -signal.SIGKILL, (victim.returncode, err)
    printed = _losses(out)
    assert printed and all(printed[s] == want[s] for s in printed)
    committed = sorted(int(p.name[5:13]) for p in (run / "run7").glob("step_*.gdsckpt"))
    assert killed_at not in committed and max(committed) < killed_at  # its save was cut short
    assert any(TEMPORARY.match(p) for p in os.listdir(run / "run7"))  # the torn temporary is still there

    again = _start(tmp_path, run)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    resumed = _losses(out)
    assert sorted(resumed) == list(range(max(committed) + 1, 61))
    assert resumed == {s: want[s] for s in resumed}
