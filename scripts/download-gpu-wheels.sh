#!/usr/bin/env bash
# Download the wheels the GPU extras need, for an offline GPU host with Python 3.12, into .whl/
# (ignored by git). Usage: scripts/download-gpu-wheels.sh [cu13|cu12]   (default cu13)
# The host is expected to have torch and cupy already; add cupy-cuda13x/cupy-cuda12x to NAMES if not.
set -euo pipefail
cd "$(dirname "$0")/.."
cuda=${1:-cu13}
case "$cuda" in cu12|cu13) ;; *) echo "usage: $0 [cu13|cu12]" >&2; exit 2;; esac
NAMES="kvikio-$cuda libkvikio-$cuda nvidia-nvcomp-$cuda nvidia-libnvcomp-$cuda rapids-logger zstandard py-spy awscrt obstore"
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $NAMES
du -sh .whl
