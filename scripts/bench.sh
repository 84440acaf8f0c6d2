#!/usr/bin/env bash
# The main job: save and restore the built-in realistic training state, on the GPU when there
# is one, else on the CPU, and print the figures (gdsckpt-bench with no arguments).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
exec .venv/bin/gdsckpt-bench "$@"
