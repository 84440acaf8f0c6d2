# Round O (session 2): scale 1 / 4 / 16 / 32 GB again, now that a "1GB" state really is ~1 GB (a
# shallower GPT; round M's 1 GB point was the 2.28 GB base state). Three saves and cold restores each.
set -uo pipefail
export GDSCKPT_CACHE=/tmp/gdsckpt-cache PYTHONUNBUFFERED=1
B="python3 -m gdsckpt.bench"
for s in 1GB 4GB 16GB 32GB; do
  $B --size $s --loops 3 --directory /tmp/bench --output $OUT/scale-$s.json > /tmp/scale-$s.txt 2>&1; echo "$s rc=$?"
  cat /tmp/scale-$s.txt >> $OUT/scale.txt; grep -E "GB  |disk|bw:|vs disk|bit-exact" /tmp/scale-$s.txt
done
