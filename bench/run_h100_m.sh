# Round M (session 2, final tree): each write loop writes a fresh file (the previous one deleted
# and synced, untimed). 4 GB save/restore with the compare table; scale 1 / 4 / 16 / 32 GB.
set -uo pipefail
export GDSCKPT_CACHE=/tmp/gdsckpt-cache PYTHONUNBUFFERED=1
B="python3 -m gdsckpt.bench"
$B --size 4GB --loops 3 --compare --directory /tmp/bench --output $OUT/disk4g.json > $OUT/disk4g.txt 2>&1; echo "disk rc=$?"; cat $OUT/disk4g.txt
for s in 1GB 4GB 16GB 32GB; do
  $B --size $s --loops 3 --directory /tmp/bench --output $OUT/scale-$s.json > /tmp/scale-$s.txt 2>&1; echo "$s rc=$?"
  cat /tmp/scale-$s.txt >> $OUT/scale.txt; grep -E "disk|bw:|vs disk|bit-exact" /tmp/scale-$s.txt
done
