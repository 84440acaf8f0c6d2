"""The CLI's commands on a Checkpointer's directory (gdsckpt/cli.py): ls, restore-test, prune and
clean, on what a team finds after weeks: typos, damaged steps, leftovers of killed processes.
The commands against a real S3 server are in test_manager_remote.py."""

from __future__ import annotations

import contextlib
import io

from gdsckpt import cli


def run_cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def test_prune_of_a_missing_directory_creates_nothing(tmp_path):
    typo = tmp_path / "no" / "such" / "run"
    for yes in ([], ["--yes"]):
        rc, out, err = run_cli("prune", typo, "--keep", "1", *yes)
        assert rc == 2 and out == "", (rc, out, err)
        assert err == f"gdsckpt prune: error: [Errno 2] No such checkpoint directory: '{typo}'\n"
    assert list(tmp_path.iterdir()) == []
