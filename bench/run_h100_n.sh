# Round N (session 2, final tree after the index moved off the critical path): GPU tests,
# null target, 4 GB durable save and cold restore.
set -uo pipefail
export GDSCKPT_CACHE=/tmp/gdsckpt-cache PYTHONUNBUFFERED=1
B="python3 -m gdsckpt.bench"
python3 -m pytest -q -m gpu -W ignore::DeprecationWarning -W ignore::UserWarning tests/ > $OUT/gpu-tests.log 2>&1; echo "tests rc=$?"
grep -E "passed|failed" $OUT/gpu-tests.log | tail -3
$B --size 4GB --target null --loops 8 --output $OUT/null.json > $OUT/null.txt 2>&1; echo "null rc=$?"; cat $OUT/null.txt
$B --size 4GB --loops 3 --directory /tmp/bench --output $OUT/disk4g.json > $OUT/disk4g.txt 2>&1; echo "disk rc=$?"; cat $OUT/disk4g.txt
