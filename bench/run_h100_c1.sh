#!/usr/bin/env bash
# H100 round C1: GPU tests, the default compare run, and the storage-removed targets (claims 1, 2).
set -uo pipefail
export GDSCKPT_CACHE=/tmp/gdsckpt-cache PYTHONUNBUFFERED=1
B="python3 -m gdsckpt.bench"
python3 -m pytest -q -m gpu -W ignore::DeprecationWarning -W ignore::UserWarning -s tests/ > $OUT/gpu-tests.log 2>&1; echo "tests rc=$?"
$B --compare --plot $OUT/compare.png --output $OUT/compare.json --directory /tmp/bench > $OUT/compare.txt 2>&1; echo "compare rc=$?"
$B --size 4GB --target null --bs 128M,256M --iodepth 2,3 --loops 5 --output $OUT/null.json > /dev/null 2>&1; echo "null rc=$?"
$B --size 4GB --target null-d2h --bs 128M,256M --iodepth 2,3 --loops 5 --output $OUT/d2h.json > /dev/null 2>&1; echo "d2h rc=$?"
tail -3 $OUT/gpu-tests.log; cat $OUT/compare.txt
python3 - <<'PY'
import json, os
for f in ("null.json", "d2h.json"):
    d = json.load(open(os.path.join(os.environ["OUT"], f)))
    for j in d["jobs"]:
        print(f, j["bs"] >> 20, j["iodepth"], "e2e", round(j["logical_gbps"], 1), "stages", round(j["stage_gbps"]["gather+compress+checksum"], 1), "setup", round(j["setup_s"], 4), j["memory"])
PY
