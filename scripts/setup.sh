#!/usr/bin/env bash
# Create or complete .venv for one job. Sourced by bench.sh, test.sh and check-package.sh, with
# the job's mode as its argument (always given: a sourced script otherwise sees its caller's):
#   source scripts/setup.sh bench   torch, gdsckpt's runtime and the bench extra (safetensors):
#                                   the main job's needs, 15 packages
#   source scripts/setup.sh test    also the test and framework extras (pytest, hypothesis,
#                                   matplotlib, SeaweedFS, lightning, torchtitan, transformers...)
# A .venv made for the bench is completed, not rebuilt, by the first `test`.
# With no NVIDIA GPU: the CPU torch 2.13 first, so that nothing pulls a multi-GB CUDA build.
# With one: the CUDA 13 extras (nvCOMP, KvikIO, CuPy) as well.
# Each step says what it does on stderr, and pip shows what it fetches and installs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# Packages are installed without bytecode (--no-compile, below): each module is compiled on its
# first import and its .pyc written then. With PYTHONDONTWRITEBYTECODE set (as on our CI
# machines) nothing is ever written, and every process that imports torch compiles its modules
# again: the suite took 998 s from a fresh clone with it set, 546 s with the bytecode kept.
unset PYTHONDONTWRITEBYTECODE
PY=${PYTHON:-python3}
_setup_mode=${1:?"usage: source scripts/setup.sh bench|test"}
_setup_t0=$SECONDS
_step() { echo "[setup $((SECONDS - _setup_t0))s] $*" >&2; }
_setup_bench="gdsckpt torch numpy zstandard awscrt tqdm safetensors"
case "$_setup_mode" in
  bench) _setup_extras="bench"; _setup_needs="$_setup_bench" ;;
  test) _setup_extras="test,bench"
        _setup_needs="$_setup_bench matplotlib pytest xdist hypothesis obstore boto3 lightning transformers torchtitan deepspeed megatron.core" ;;
  *) echo "setup.sh: unknown mode $_setup_mode (bench or test)" >&2; return 2 2>/dev/null || exit 2 ;;
esac
# Whether every module the mode needs is installed: found, not imported (importing torch alone
# takes seconds, on every run of the job)
_have() { .venv/bin/python -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))" $_setup_needs 2>/dev/null; }
# pip into .venv, showing only its lines that say what it fetches, builds and installs.
# --no-compile: no bytecode for the thousands of modules never imported (torch alone has 2,300;
# Python compiles each one imported on its first import, once).
_pip() { setup_pip; "${_setup_pip[@]}" install --progress-bar off --no-compile "$@" 2>&1 \
  | grep --line-buffered -E "^(Collecting|Building|Installing collected|Successfully|ERROR)" >&2 || true; }
if [ ! -x .venv/bin/python ]; then
  _step "creating .venv with $("$PY" --version 2>&1)"
  # Without a pip of its own where this Python's pip can install into it (pip >= 22.3:
  # --python); bundling one took 25 s of the set-up on the loaded 2-core host.
  "$PY" -m venv --without-pip .venv
fi
# The pip that installs into .venv, as the array _setup_pip (also for the scripts that source
# this one): its own, else this Python's; found on the first call only
setup_pip() {
  [ -n "${_setup_pip+x}" ] && return
  if .venv/bin/python -m pip --version >/dev/null 2>&1; then
    _setup_pip=(.venv/bin/python -m pip)
  elif "$PY" -m pip --python .venv/bin/python --version >/dev/null 2>&1; then
    _setup_pip=("$PY" -m pip --python .venv/bin/python)
  else
    _step "bundling pip into .venv (this Python's pip is older than 22.3)"
    .venv/bin/python -m ensurepip -q
    _setup_pip=(.venv/bin/python -m pip)
  fi
}
if ! _have; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    _setup_extras="$_setup_extras,cu13"
    _step "an NVIDIA GPU is here: the CUDA 13 extras (nvCOMP, KvikIO, CuPy) come with gdsckpt"
    _pip -q "setuptools>=77"
    : > .venv/torch-constraint.txt
  elif [ ! -s .venv/torch-constraint.txt ]; then
    _step "no NVIDIA GPU: installing the CPU build of torch 2.13 first (about 200 MB unpacked)"
    # setuptools too: gdsckpt's editable install below then builds without an isolated env of its own
    _pip "torch==2.13.0" "setuptools>=77"
    # No extra (lightning, torchtitan, ...) may swap in a CUDA torch: pin the very build installed,
    # local label included ("2.13.0+cpu"), which no CUDA wheel of the same version matches.
    .venv/bin/python -c "from importlib.metadata import version; print('torch==' + version('torch'))" \
      > .venv/torch-constraint.txt
  fi
  _step "installing gdsckpt in editable mode with the extras $_setup_extras"
  _pip -c .venv/torch-constraint.txt --no-build-isolation -e ".[$_setup_extras]"
  { .venv/bin/python -c "import gdsckpt" && _have; } \
    || { _step "the installation failed: see pip's errors above"; return 1 2>/dev/null || exit 1; }
  _step "done"
fi
