#!/usr/bin/env bash
# H100 round C2: durable saves and cold restores on the local disk against the raw O_DIRECT
# probe and torch.save / torch.load on a 4.6 GB state (claims 3-6), then scale 1-32 GB (claim 7).
set -uo pipefail
export GDSCKPT_CACHE=/tmp/gdsckpt-cache PYTHONUNBUFFERED=1
B="python3 -m gdsckpt.bench"
$B --size 4GB --loops 2 --compare --output $OUT/disk4g.json --directory /tmp/bench > $OUT/disk4g.txt 2>&1; echo "disk rc=$?"
cat $OUT/disk4g.txt
for s in 1GB 4GB 16GB 32GB; do
  $B --size $s --output $OUT/scale-$s.json --directory /tmp/bench --no-disk-probe --output-format terse 2>&1 | tee -a $OUT/scale.txt
done
