# Round L (session 2, final tree): null and null-d2h targets, 4 GB durable save and cold restore
# (three loops each, disk probed before and after) with the compare table.
set -uo pipefail
export GDSCKPT_CACHE=/tmp/gdsckpt-cache PYTHONUNBUFFERED=1
B="python3 -m gdsckpt.bench"
$B --size 4GB --target null --loops 8 --output $OUT/null.json > $OUT/null.txt 2>&1; echo "null rc=$?"; cat $OUT/null.txt
$B --size 4GB --target null-d2h --loops 8 --output $OUT/d2h.json > $OUT/d2h.txt 2>&1; echo "d2h rc=$?"; cat $OUT/d2h.txt
$B --size 4GB --loops 3 --compare --plot $OUT/compare.png --directory /tmp/bench --output $OUT/disk4g.json > $OUT/disk4g.txt 2>&1; echo "disk rc=$?"; cat $OUT/disk4g.txt
python3 -c "
import json,os
for f in ('null.json','d2h.json','disk4g.json'):
    for j in json.load(open(os.path.join(os.environ['OUT'],f)))['jobs']: print(f, j['name'], round(j['logical_gbps'],1), j['stage_gbps'], round(j['setup_s'],4), [round(x,1) for x in j['per_loop_gbps']])"
