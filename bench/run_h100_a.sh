#!/usr/bin/env bash
# H100 round A: GPU tests, the default compare run, and the storage-removed sweeps.
set -uo pipefail
export GDSCKPT_CACHE=/tmp/gdsckpt-cache PYTHONUNBUFFERED=1
B="python3 -m gdsckpt.bench"
python3 -m pytest -q -m gpu -W ignore::DeprecationWarning -W ignore::UserWarning -s tests/ 2>&1 | tail -40 > $OUT/gpu-tests.log
$B --compare --plot $OUT/compare.png --output $OUT/compare.json --directory /tmp/bench > $OUT/compare.txt 2>&1
$B --size 4GB --target null --bs 64M,128M,256M --iodepth 2,3 --loops 3 --output $OUT/null.json --plot $OUT/null.png > /dev/null 2>&1
$B --size 4GB --target null-d2h --bs 64M,128M,256M --iodepth 2,3 --loops 3 --output $OUT/d2h.json > /dev/null 2>&1
tail -5 $OUT/gpu-tests.log; cat $OUT/compare.txt
python3 - <<'PY'
import json, os
for f in ("null.json", "d2h.json"):
    d = json.load(open(os.path.join(os.environ["OUT"], f)))
    for j in d["jobs"]:
        print(f, j["bs"] >> 20, j["iodepth"], round(j["logical_gbps"], 1), round(j["ratio"], 4), j["memory"])
PY
