"""The README runs (issue 20, item 2): every ```python block in README.md runs here, in order, in
one namespace, in a fresh directory, unless the line before it is `<!-- not run: REASON -->` (a
block that needs a GPU, an S3 store or torchrun). The resume example also runs in subprocesses,
killed during a save and resumed: tests/test_resume.py."""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"(?:^(<!--.*?-->)\n)?^```python\n(.*?)^```$", re.S | re.M)
_NOT_RUN = re.compile(r"<!-- not run: \S.*-->", re.S)


def python_blocks(text: str | None = None) -> list[tuple[int, str, str | None]]:
    """(line number, code, the HTML comment right before it or None) of each ```python block."""
    text = README.read_text() if text is None else text
    return [(text.count("\n", 0, m.start(2)) + 1, m.group(2), m.group(1)) for m in _BLOCK.finditer(text)]


def resume_example() -> str:
    """The README's full training example: the block after the comment that names it."""
    found = [code for _, code, note in python_blocks() if note and "the resume example" in note]
    assert len(found) == 1, "README.md must have exactly one block marked as the resume example"
    return found[0]


def test_blocks_are_found_and_markers_say_why():
    blocks = python_blocks()
    assert len(blocks) >= 5
    for line, _, note in blocks:
        if note and "not run" in note:
            assert _NOT_RUN.fullmatch(note), f"README.md line {line}: say why a block is not run"
    text = "<!-- not run: needs a GPU -->\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n"
    assert [(c, n) for _, c, n in python_blocks(text)] == [("x = 1\n", "<!-- not run: needs a GPU -->"),
                                                           ("y = 2\n", None)]


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    ran = 0
    for line, code, note in python_blocks():
        if note and _NOT_RUN.fullmatch(note):
            continue
        out = io.StringIO()
        with warnings.catch_warnings(), contextlib.redirect_stdout(out):
            warnings.simplefilter("ignore")  # DCP's "no process group: a single process" and the like
            try:
                exec(compile(code, f"README.md, block at line {line}", "exec"), namespace)
            except Exception as e:
                pytest.fail(f"README.md block at line {line} failed: {type(e).__name__}: {e}")
        ran += 1
        if "the resume example" in (note or ""):
            lines = out.getvalue().splitlines()
            assert lines[0].startswith("step 1 loss ") and lines[-1].startswith("step 60 loss "), lines[:2]
    assert ran >= 4
    assert (tmp_path / "run7" / "step_00000060.gdsckpt").is_file()
