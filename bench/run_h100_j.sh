# Round J (session 2): GPU tests after the gather/ring rewrite, null targets, 4 GB disk save/restore
# with compare, each file job against the disk probed before and after it.
set -uo pipefail
export GDSCKPT_CACHE=/tmp/gdsckpt-cache PYTHONUNBUFFERED=1
B="python3 -m gdsckpt.bench"
python3 -m pytest -q -m gpu -W ignore::DeprecationWarning -W ignore::UserWarning tests/ > $OUT/gpu-tests.log 2>&1; echo "tests rc=$?"
grep -E "passed|failed|Error|error" $OUT/gpu-tests.log | tail -12
$B --size 4GB --target null --loops 5 --output $OUT/null.json > $OUT/null.txt 2>&1; echo "null rc=$?"; cat $OUT/null.txt
$B --size 4GB --target null-d2h --loops 5 --output $OUT/d2h.json > $OUT/d2h.txt 2>&1; echo "d2h rc=$?"; cat $OUT/d2h.txt
$B --size 4GB --loops 3 --compare --directory /tmp/bench --output $OUT/disk4g.json > $OUT/disk4g.txt 2>&1; echo "disk rc=$?"; cat $OUT/disk4g.txt
python3 -c "
import json,os
for f in ('null.json','d2h.json'):
    j=json.load(open(os.path.join(os.environ['OUT'],f)))['jobs'][0]; print(f, round(j['logical_gbps'],1), j['stage_gbps'], round(j['setup_s'],4), [round(x,1) for x in j['per_loop_gbps']])"
