#!/usr/bin/env bash
# Create .venv (once) with gdsckpt and its test/bench extras. Sourced by test.sh and bench.sh.
# With no NVIDIA GPU: the CPU torch 2.13 first, so that nothing pulls a multi-GB CUDA build.
# With one: the CUDA 13 extras (nvCOMP, KvikIO, CuPy) as well.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import gdsckpt, pytest, hypothesis, awscrt, obstore, boto3" 2>/dev/null; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  extras="test,bench"
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    extras="$extras,cu13"
  else
    .venv/bin/python -m pip install -q "torch==2.13.0"
  fi
  .venv/bin/python -m pip install -q -e ".[$extras]"
fi
