"""`gdsckpt --version`: the versions installed, read from the packages' metadata without importing
them (torch takes seconds to import; nvCOMP's version, as the GPU stack would load it, needs a GPU
probe). Not on the load path (tests/reading/test_reader_hostile.py): it reads package metadata only."""

from __future__ import annotations

from importlib import metadata

__all__ = ["installed"]


def installed(*distributions: str) -> str:
    """The version of the first of `distributions` installed, else "not installed"."""
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return "not installed"
