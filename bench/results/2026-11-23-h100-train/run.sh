#!/usr/bin/env bash
# H100 round for issue 13 (helper D2): gdsckpt-bench --train with today's methods on a 4.87 GB
# state, then bench/probes/probe_train_profile.py (why save_async slows under training).
# The committed results ran commit 0c261e9 with --steps 90 (checkpoints at 40 and 80, a 10-step tail);
# the bench now leaves a full interval after every checkpoint, so a re-run uses --steps 120.
# Run from the repository root on the GPU machine, with the .whl bundle carried; writes into $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 GDSCKPT_CACHE=/tmp/gdsckpt-cache
{ nvidia-smi -L; date -u +%FT%TZ; git rev-parse --short HEAD 2>/dev/null; df -h /tmp | tail -1; } > "$OUT/round.txt" 2>&1
t=$(date +%s)
timeout 270 python3 -m gdsckpt.bench --train --methods none,torch,save,async,dcp-gdsckpt --steps 120 --interval 40 \
  --repeats 2 --directory /tmp/train-bench --cost --output "$OUT/train.json" --plot "$OUT/train.png" \
  > "$OUT/train.txt" 2>&1
echo "train rc=$? $(( $(date +%s) - t )) s" | tee -a "$OUT/round.txt"
rm -rf /tmp/train-bench
t=$(date +%s)
timeout 200 python3 bench/probes/probe_train_profile.py --pyspy /tmp/site/bin/py-spy --dir /tmp/probe-train \
  > "$OUT/probe.log" 2>&1
echo "probe rc=$? $(( $(date +%s) - t )) s" | tee -a "$OUT/round.txt"
tail -60 "$OUT/train.txt"
tail -80 "$OUT/probe.log"
