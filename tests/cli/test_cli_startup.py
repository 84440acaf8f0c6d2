"""`gdsckpt --version`, --help and a usage error answer before torch loads (it takes seconds on a
busy machine): the command line is parsed first and a command's modules imported after, and
`import gdsckpt` imports each public name's module on first use. Asserted on what a real
`python -m gdsckpt` process imported (-X importtime), not on a timing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "numpy", "tqdm", "gdsckpt.api", "gdsckpt.cli.files", "gdsckpt.cli.export", "gdsckpt.core.storage")


def _imported(*argv: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `python -X importtime -m gdsckpt ARGV`: the process, and every module it imported."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "gdsckpt", *argv], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    modules = {line.rpartition("|")[2].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "gdsckpt.cli" in modules, r.stderr[-2000:]  # the listing is what it claims to be
    return r, modules


@pytest.mark.parametrize("argv,code,says", [
    (["--version"], 0, "gdsckpt 0.1.0 (file format 1.1, torch "),
    (["--help"], 0, "usage: gdsckpt"),
    (["inspect", "--help"], 0, "usage: gdsckpt inspect"),
    (["inspekt", "x"], 2, "invalid choice: 'inspekt'"),
    (["inspect"], 2, "the following arguments are required: path"),
    (["convert", "a", "b", "--codec", "lz4"], 2, "invalid choice: 'lz4'"),
])
def test_version_help_and_usage_errors_import_no_torch(argv, code, says):
    r, modules = _imported(*argv)
    assert r.returncode == code and says in r.stdout + r.stderr, (r.stdout, r.stderr[-2000:])
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


def test_a_command_imports_its_modules_after_parsing(tmp_path):
    r, modules = _imported("inspect", str(tmp_path / "missing.gdsckpt"))
    assert r.returncode == 3 and {"torch", "gdsckpt.cli.files"} <= modules


def test_version_names_the_installed_torch_without_importing_it():
    import torch
    r, _ = _imported("--version")
    assert f"torch {torch.__version__}," in r.stdout and "nvCOMP " in r.stdout, r.stdout


def test_the_codecs_convert_offers_are_the_librarys():
    from gdsckpt import cli, codecs
    assert cli.CODECS == codecs.ALL_CODECS


def test_import_gdsckpt_imports_names_on_first_use():
    code = """
import sys
import gdsckpt
assert "torch" not in sys.modules and "gdsckpt.api" not in sys.modules, "eager"
import gdsckpt.writing.save, gdsckpt.writing.reserve  # the pipeline's modules: gdsckpt.save stays the function
assert callable(gdsckpt.save) and gdsckpt.save.__module__ == "gdsckpt.api", gdsckpt.save
assert gdsckpt.reserve.__module__ == "gdsckpt.writing.reserve" and callable(gdsckpt.reserve), gdsckpt.reserve
from gdsckpt import *
assert Checkpointer is gdsckpt.manager.checkpointer.Checkpointer and ChecksumError.__module__ == "gdsckpt.errors"
assert all(hasattr(gdsckpt, name) for name in gdsckpt.__all__)
assert gdsckpt.stats.Stats is gdsckpt.Stats  # a submodule, as when the package imported them all
assert set(gdsckpt.__all__) <= set(dir(gdsckpt))
try:
    gdsckpt.no_such_name
except AttributeError as e:
    assert "no_such_name" in str(e)
else:
    raise AssertionError("no AttributeError")
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
