"""What every `gdsckpt` command shares: --version, --json, the exit codes (one mapping), a
progress bar only on a terminal, and a reader that closes the pipe early (`| head -1`)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import torch

import gdsckpt
from gdsckpt import errors
from gdsckpt.cli import build_parser
from gdsckpt.cli.exitcodes import exit_code_for
from gdsckpt.manager.checkpointer import Checkpointer
from test_cli import run_cli
from test_manager import OPTS, corrupt_chunk, state_for

ROOT = Path(__file__).resolve().parents[2]


def _gdsckpt(*argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gdsckpt", *map(str, argv)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, **kw)


def test_version():
    r = _gdsckpt("--version")
    assert r.returncode == 0 and r.stdout.startswith(f"gdsckpt {gdsckpt.__version__} (file format 1.1, torch ")


@pytest.mark.parametrize("error,code", [
    (errors.ChecksumError("x"), 1), (errors.VersionError("x"), 1), (errors.CodecUnavailableError("x"), 1),
    (errors.RemoteUnavailableError("x", bucket="b"), 1), (errors.RemoteAccessError("x", bucket="b"), 1),
    (OSError(5, "I/O error"), 1), (errors.CheckpointLockedError("x"), 1),
    (ValueError("x"), 2), (errors.UnsupportedStateError("x"), 2), (NotADirectoryError(20, "x"), 2),
    (FileNotFoundError(2, "x"), 3), (errors.NoCheckpointError("x"), 3), (errors.BucketNotFoundError("x", bucket="b"), 3),
    (errors.RemoteNotFoundError("x", bucket="b", key="k"), 3), (KeyError("k"), 3),
])
def test_one_mapping_from_errors_to_exit_codes(error, code):
    assert exit_code_for(error) == code


def test_an_unexpected_error_is_a_traceback_not_an_exit_code():
    with pytest.raises(TypeError):
        exit_code_for(ZeroDivisionError())


def test_every_command_takes_json_and_help_names_the_exit_codes():
    ap = build_parser()
    commands = ap._subparsers._group_actions[0].choices  # noqa: SLF001 - argparse keeps them only there
    assert set(commands) == {"inspect", "verify", "convert", "export", "clean", "ls", "restore-test", "prune"}
    for name, sub in commands.items():
        assert "--json" in sub.format_help(), name
        assert "3 not found" in sub.format_help().replace("\n", " "), name


def test_usage_and_not_found_codes_and_the_json_error_document(tmp_path):
    assert _gdsckpt("inspect").returncode == 2  # argparse: a missing argument
    assert _gdsckpt("export", "a", "b", "--to", "zip").returncode == 2
    rc, out, err = run_cli("inspect", tmp_path / "nope.gdsckpt", "--json")
    assert rc == 3 and "No such file" in err
    assert json.loads(out)["error"]["type"] == "FileNotFoundError" and json.loads(out)["error"]["exit_code"] == 3


def test_a_missing_path_is_named_with_what_the_command_expected(tmp_path):
    """Not a bare "[Errno 2]": the path, and what should have been there; exit 3 (not found)."""
    gone = tmp_path / "gone"
    expected = {"inspect": "a gdsckpt checkpoint file or a DCP step folder", "verify":
                "a gdsckpt checkpoint file or a DCP step folder", "convert": "a gdsckpt checkpoint file",
                "export": "a gdsckpt checkpoint file", "ls": "a Checkpointer directory or an s3://bucket/prefix",
                "restore-test": "a Checkpointer directory or an s3://bucket/prefix",
                "prune": "a Checkpointer directory", "clean": "a checkpoint directory"}
    extra = {"convert": [tmp_path / "out.gdsckpt"], "export": [tmp_path / "out", "--to", "torch"]}
    for cmd, what in expected.items():
        rc, out, err = run_cli(cmd, gone, *extra.get(cmd, []))
        noun = "directory" if cmd in ("ls", "restore-test", "prune", "clean") else "file or directory"
        assert (rc, out) == (3, ""), (cmd, rc, out, err)
        assert err == f"gdsckpt {cmd}: error: {gone}: No such {noun} (expected {what})\n", (cmd, err)
    rc, out, err = run_cli("ls", tmp_path / "gone", "--json")
    assert json.loads(out)["error"]["message"] == f"{gone}: No such directory (expected {expected['ls']})"
    p = tmp_path / "a.gdsckpt"
    gdsckpt.save({"x": torch.zeros(3)}, p)
    rc, _, err = run_cli("ls", p)  # a file where a directory belongs: a usage error, saying so
    assert rc == 2 and err == f"gdsckpt ls: error: {p}: Not a directory (expected {expected['ls']})\n", err
    rc, _, err = run_cli("convert", p, tmp_path / "no" / "dir" / "b.gdsckpt")
    assert rc == 3 and err.startswith(f"gdsckpt convert: error: {tmp_path}/no/dir/b.gdsckpt: No such directory "), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without a usable GPU")
def test_convert_to_a_gpu_codec_without_a_gpu_says_what_to_type(tmp_path):
    """In the command line's words (--codec ...), not the API's (codec=, "save CUDA tensors")."""
    p = tmp_path / "a.gdsckpt"
    gdsckpt.save({"x": torch.zeros(3)}, p)
    for codec in ("ans", "bitcomp", "ans-planes"):
        rc, out, err = run_cli("convert", p, tmp_path / "b.gdsckpt", "--codec", codec)
        assert rc == 1 and out == "" and err.startswith(f"gdsckpt convert: error: --codec {codec} compresses with "
                                                        "nvCOMP on a GPU"), err
        assert "--codec zstd" in err and "codec=" not in err and "CUDA tensors" not in err, err
    assert not (tmp_path / "b.gdsckpt").exists()


def test_json_of_the_manager_commands(tmp_path):
    d = tmp_path / "run"
    with Checkpointer(d, keep=5, save_options=OPTS) as ck:
        for s in (1, 2, 3):
            ck.save(s, state_for(s, n=500))
    rc, out, _ = run_cli("restore-test", d, "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["step"] == doc["newest"] == 3 and [r["step"] for r in doc["checked"]] == [3]
    corrupt_chunk(next(p for p in d.iterdir() if p.name.startswith("step_") and "3" in p.name))
    rc, out, _ = run_cli("restore-test", d, "--json")
    assert rc == 1 and json.loads(out)["step"] == 2
    rc, out, _ = run_cli("prune", d, "--keep", "1", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["removed"] is False and doc["local"] == [1] and list(doc["damaged"]) == ["3"], doc
    rc, out, _ = run_cli("clean", d, "--json")
    assert rc == 0 and json.loads(out) == {"directory": str(d), "stale": [], "removed": False, "memory_dropped": [],
                                         "replicas_kept": []}
    rc, out, err = run_cli("restore-test", tmp_path / "empty-run")
    assert rc == 3, (out, err)


def test_a_closed_pipe_ends_quietly_with_the_commands_own_exit_code(tmp_path):
    p = tmp_path / "many.gdsckpt"
    gdsckpt.save({f"layer{i}.weight": torch.zeros(2) for i in range(3000)}, p, codec="raw")
    for argv, code in ((["inspect", p], 0), (["verify", p], 0)):
        r = subprocess.run(f"{sys.executable} -m gdsckpt {' '.join(map(str, argv))} | head -1; "
                           "echo \"rc=${PIPESTATUS[0]}\"", shell=True, executable="/bin/bash", cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert r.stderr == "" and r.stdout.splitlines()[-1] == f"rc={code}", (argv, r.stdout[-300:], r.stderr)
        assert len(r.stdout.splitlines()) == 2


def test_progress_bar_on_a_terminal_only(tmp_path):
    p = tmp_path / "a.gdsckpt"
    gdsckpt.save({"x": torch.randn(200_000)}, p, codec="zstd")
    assert "verify" not in _gdsckpt("verify", "--deep", p).stderr  # not a terminal: no bar
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal 120 columns wide
    try:
        proc = subprocess.run([sys.executable, "-m", "gdsckpt", "verify", "--deep", str(p)], cwd=ROOT,
                              stdout=secondary, stderr=secondary, timeout=120,
                              env={k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"})
        os.close(secondary)
        screen = b""
        while True:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # EIO: the terminal's other side is closed and drained
                break
            if not chunk:
                break
            screen += chunk
    finally:
        os.close(primary)
    text = screen.decode(errors="replace")
    assert proc.returncode == 0 and "verify a.gdsckpt" in text and "OK" in text, text
