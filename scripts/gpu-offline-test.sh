#!/usr/bin/env bash
# On an offline GPU host: install the .whl/ bundle into a prefix (default /tmp/site), put it and
# this source tree on PYTHONPATH, and run the GPU tests. Extra arguments go to pytest.
# Usage: scripts/gpu-offline-test.sh [-p PREFIX] [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=/tmp/site
if [ "${1:-}" = "-p" ]; then prefix=$2; shift 2; fi
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$prefix" .whl/*.whl
export PYTHONPATH="$prefix:$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import gdsckpt.engine.backend as b; ok, why = b.gpu_status(); print('GPU backend:', 'ready' if ok else why)"
exec python3 -m pytest -q -m gpu -W ignore::DeprecationWarning "$@"
