#!/usr/bin/env bash
# The main job: save and restore the built-in realistic training state, on the GPU when there
# is one, else on the CPU, and print the figures (gdsckpt-bench with no arguments; arguments
# go to gdsckpt-bench: --help lists them, --train --help the training loop's).
# Sets up .venv first with gdsckpt and the bench's extra only (scripts/setup.sh bench).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh bench
exec .venv/bin/gdsckpt-bench "$@"
