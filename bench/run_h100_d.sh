#!/usr/bin/env bash
# H100 round D: the chosen defaults (256 MiB chunks, 2 slots, 4 KvikIO threads, O_DIRECT),
# GPU tests (incl. the GPU corruption subset), and the 4.6 GB disk + compare run.
set -uo pipefail
export GDSCKPT_CACHE=/tmp/gdsckpt-cache PYTHONUNBUFFERED=1
B="python3 -m gdsckpt.bench"
python3 -m pytest -q -m gpu -W ignore::DeprecationWarning -W ignore::UserWarning -s tests/ > $OUT/gpu-tests.log 2>&1; echo "tests rc=$?"
tail -5 $OUT/gpu-tests.log
$B --size 4GB --compare --plot $OUT/disk4g.png --output $OUT/disk4g.json --directory /tmp/bench > $OUT/disk4g.txt 2>&1; echo "disk rc=$?"
cat $OUT/disk4g.txt
$B --size 4GB --target null --loops 5 --output $OUT/null.json > $OUT/null.txt 2>&1; echo "null rc=$?"
$B --size 4GB --target null-d2h --loops 5 --output $OUT/d2h.json > $OUT/d2h.txt 2>&1; echo "d2h rc=$?"
grep -A4 "^write" $OUT/null.txt $OUT/d2h.txt
python3 -c "
import json,os
for f in ('null.json','d2h.json'):
    j=json.load(open(os.path.join(os.environ['OUT'],f)))['jobs'][0]; print(f, round(j['logical_gbps'],1), j['stage_gbps'], j['setup_s'], j['memory'])"
