#!/usr/bin/env bash
# The test command: sets everything up from nothing, then runs the whole suite.
# GPU tests (marker `gpu`) run where a GPU with nvCOMP and KvikIO is present and skip elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
