#!/usr/bin/env bash
# The test command: sets everything up from nothing (scripts/setup.sh test: the test and
# framework extras too), then runs the tests. Timings: tests/README.md.
#   scripts/test.sh              the whole suite, on two workers (pytest-xdist)
#   scripts/test.sh --quick      the quick subset: pytest -m "not slow and not integration", the
#                                markers tests/conftest.py gives (tests/README.md lists them)
# Any other argument goes to pytest (a file, -k EXPR, -x ...).
# GPU tests (marker `gpu`) run where a GPU with nvCOMP and KvikIO is present and skip elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh test
args=()
for arg in "$@"; do
  if [ "$arg" = "--quick" ]; then
    args+=(-m "not slow and not integration")
  else
    args+=("$arg")
  fi
done
# Two workers (pytest-xdist), each test file whole on one of them (its module fixtures made once):
# much of the suite waits on child processes, gloo ranks and servers. `-n 0` after turns it off.
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile ${args[@]+"${args[@]}"}
