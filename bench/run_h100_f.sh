#!/usr/bin/env bash
# H100 round F: the final code (ANS with 512 KiB internal chunks) on workload v2.
set -uo pipefail
export GDSCKPT_CACHE=/tmp/gdsckpt-cache PYTHONUNBUFFERED=1
B="python3 -m gdsckpt.bench"
python3 -m pytest -q -m gpu -W ignore::DeprecationWarning -W ignore::UserWarning -s tests/ > $OUT/gpu-tests.log 2>&1; echo "tests rc=$?"
grep -E "passed|failed|overall|garbage" $OUT/gpu-tests.log | tail -8
$B --compare --plot $OUT/compare.png --output $OUT/compare.json --directory /tmp/bench > $OUT/compare.txt 2>&1; echo "compare rc=$?"
cat $OUT/compare.txt
# (the 4.4 GB disk run of round E stands: the change is codec-internal)

$B --size 4GB --target null --loops 5 --output $OUT/null.json > /dev/null 2>&1; echo "null rc=$?"
$B --size 4GB --target null-d2h --loops 5 --output $OUT/d2h.json > /dev/null 2>&1; echo "d2h rc=$?"
python3 -c "
import json,os
for f in ('null.json','d2h.json'):
    j=json.load(open(os.path.join(os.environ['OUT'],f)))['jobs'][0]; print(f, round(j['logical_gbps'],1), j['stage_gbps'], round(j['setup_s'],4), j['memory'], j['ratio'])"
