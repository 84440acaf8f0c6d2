#!/usr/bin/env bash
# Create .venv (once) with gdsckpt and its test/bench extras. Sourced by test.sh and bench.sh.
# With no NVIDIA GPU: the CPU torch 2.13 first, so that nothing pulls a multi-GB CUDA build.
# With one: the CUDA 13 extras (nvCOMP, KvikIO, CuPy) as well.
# Each step says what it does on stderr, and pip shows what it fetches and installs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
_setup_t0=$SECONDS
_step() { echo "[setup $((SECONDS - _setup_t0))s] $*" >&2; }
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import gdsckpt, pytest, hypothesis, awscrt, obstore, boto3, tqdm" 2>/dev/null; then
  _step "creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
  _step "upgrading pip"
  .venv/bin/python -m pip install --progress-bar off -q --upgrade pip
  extras="test,bench"
  constraints=()
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    extras="$extras,cu13"
    _step "an NVIDIA GPU is here: the CUDA 13 extras (nvCOMP, KvikIO, CuPy) come with gdsckpt"
  else
    _step "no NVIDIA GPU: installing the CPU build of torch 2.13 first (about 200 MB unpacked)"
    .venv/bin/python -m pip install --progress-bar off "torch==2.13.0" 2>&1 | grep -E "^(Collecting|Successfully|ERROR)" >&2 || true
    # No extra (lightning, torchtitan, ...) may swap in a CUDA torch: pin the very build installed,
    # local label included ("2.13.0+cpu"), which no CUDA wheel of the same version matches.
    .venv/bin/python -c "import torch; print('torch==' + torch.__version__)" > .venv/torch-constraint.txt
    constraints=(-c .venv/torch-constraint.txt)
  fi
  _step "installing gdsckpt in editable mode with the extras $extras"
  .venv/bin/python -m pip install --progress-bar off "${constraints[@]}" -e ".[$extras]" 2>&1 | grep -E "^(Collecting|Successfully|ERROR)" >&2 || true
  .venv/bin/python -c "import gdsckpt, pytest, hypothesis, awscrt, obstore, boto3, tqdm" \
    || { _step "the installation failed: see pip's errors above"; exit 1; }
  _step "done"
fi
