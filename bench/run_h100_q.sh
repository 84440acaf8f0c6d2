# Round Q (session 2): the disk probe now writes unique bytes (round P: one repeated block read
# back ~20% faster). 4 GB save/restore, then scale 1 / 4 / 16 / 32 GB, three loops each.
set -uo pipefail
export GDSCKPT_CACHE=/tmp/gdsckpt-cache PYTHONUNBUFFERED=1
B="python3 -m gdsckpt.bench"
for s in 1GB 4GB 16GB 32GB; do
  $B --size $s --loops 3 --directory /tmp/bench --output $OUT/scale-$s.json > /tmp/scale-$s.txt 2>&1; echo "$s rc=$?"
  cat /tmp/scale-$s.txt >> $OUT/scale.txt; grep -E "disk|bw:|vs disk|bit-exact" /tmp/scale-$s.txt
done
