"""What pyproject.toml promises about the package: the torch floor the installed torch meets,
nvCOMP pinned to the major the files record, an SPDX license, and the console scripts. The wheel
itself is built, installed into a fresh venv and smoke-tested by scripts/check-package.sh (CI)."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import torch
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirement(reqs: list[str], name: str) -> Requirement:
    found = [Requirement(r) for r in reqs if Requirement(r).name == name]
    assert len(found) == 1, (name, reqs)
    return found[0]


def test_the_installed_torch_meets_the_declared_floor():
    floor = _requirement(PROJECT["dependencies"], "torch").specifier
    assert Version(torch.__version__).release >= Version("2.11").release
    assert floor.contains(Version(torch.__version__).base_version), (floor, torch.__version__)
    assert not floor.contains("2.10.0"), f"{floor}: below the oldest torch the suite has run on (2.11)"


def test_nvcomp_is_pinned_to_the_major_the_files_record():
    """ANS and Bitcomp chunks carry nvCOMP's bitstream, which only the same major reads
    (FORMAT.md): both CUDA extras must resolve nvCOMP 6.x and nothing else."""
    extras = PROJECT["optional-dependencies"]
    for extra, name in (("cu12", "nvidia-nvcomp-cu12"), ("cu13", "nvidia-nvcomp-cu13")):
        spec = _requirement(extras[extra], name).specifier
        assert spec.contains("6.0.0.12") and spec.contains("6.9")
        assert not spec.contains("5.3.0.16") and not spec.contains("7.0"), (extra, spec)


def test_license_and_extras():
    assert PROJECT["license"] == "Apache-2.0"  # an SPDX expression (PEP 639), not the deprecated table
    assert {"obstore", "botocore"} <= {Requirement(r).name for r in PROJECT["optional-dependencies"]["s3"]}
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert _requirement(build, "setuptools").specifier.contains("77.0")
    assert not _requirement(build, "setuptools").specifier.contains("76.0")  # older ones reject the SPDX string


def test_console_scripts_resolve():
    for name, target in PROJECT["scripts"].items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), name
