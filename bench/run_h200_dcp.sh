#!/usr/bin/env bash
# 2-GPU round for issue 6 (DCP storage plugin): the FSDP2 GPU tests, then the DCP comparison
# (gdsckpt plugin vs FileSystemWriter/Reader plain and with ZStandard) on the same state.
# Run from the repository root on the 2-GPU host; results go to $OUT (default bench/results/DATE-dcp-2gpu).
# Usage: OUT=/path bash bench/run_h200_dcp.sh [--size 8GB] [--loops 2] (extra args go to dcp_bench.py)
set -uo pipefail
cd "$(dirname "$0")/.."
export GDSCKPT_CACHE=${GDSCKPT_CACHE:-/tmp/gdsckpt-cache} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-bench/results/$(date -u +%F)-dcp-2gpu}
mkdir -p "$OUT"
nvidia-smi -L > "$OUT/devices.txt" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/devices.txt"
# installs .whl/ into /tmp/site and runs pytest -m gpu on the given file
bash scripts/gpu-offline-test.sh -v -s tests/test_dcp_gpu.py > "$OUT/gpu-dcp-tests.log" 2>&1; echo "tests rc=$?"
tail -5 "$OUT/gpu-dcp-tests.log"
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 bench/dcp_bench.py --out "$OUT/dcp-2gpu.json" --dir /tmp/dcp-bench "$@" > "$OUT/dcp-2gpu.txt" 2>&1; echo "bench rc=$?"
cat "$OUT/dcp-2gpu.txt"
