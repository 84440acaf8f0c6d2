# Round K (session 2): GPU tests on the vectorised gatherer and deferred release of replaced files;
# scale 1 / 4 / 16 / 32 GB, three durable saves and cold restores each, disk probed before and after.
set -uo pipefail
export GDSCKPT_CACHE=/tmp/gdsckpt-cache PYTHONUNBUFFERED=1
B="python3 -m gdsckpt.bench"
python3 -m pytest -q -m gpu -W ignore::DeprecationWarning -W ignore::UserWarning tests/ > $OUT/gpu-tests.log 2>&1; echo "tests rc=$?"
grep -E "passed|failed" $OUT/gpu-tests.log | tail -3
for s in 1GB 4GB 16GB 32GB; do
  $B --size $s --loops 3 --directory /tmp/bench --output $OUT/scale-$s.json > /tmp/scale-$s.txt 2>&1; echo "$s rc=$?"
  cat /tmp/scale-$s.txt >> $OUT/scale.txt; grep -E "disk|bw:|vs disk|bit-exact|stages" /tmp/scale-$s.txt
done
