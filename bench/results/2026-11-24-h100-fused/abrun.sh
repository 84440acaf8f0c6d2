#!/usr/bin/env bash
# A/B of --train runs: ab NAME DIR [python -c prefix]; run from the device copy's root.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export GDSCKPT_CACHE=/tmp/gdsckpt-cache PYTHONUNBUFFERED=1
ARGS="--train --directory /tmp/bench --size gpt2-medium --interval 40 --repeats 1"
ab() {  # name, source dir, steps, methods, [switch interval]
  ( cd "$2" && PYTHONPATH=/tmp/site:$PWD python3 -c "import sys, runpy; sys.setswitchinterval(float('${5:-0.005}')); sys.argv = ['gdsckpt-bench'] + sys.argv[1:]; runpy.run_module('gdsckpt.bench', run_name='__main__')" \
      $ARGS --steps "$3" --methods "$4" --output "$OUT/$1.json" > "$OUT/$1.txt" 2>&1; echo "$1 rc=$?" )
  python3 - "$OUT/$1.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for m in r["methods"]:
    if m["name"] == "none": continue
    loc = m["overhead_local_per_ckpt_s"]
    print(sys.argv[1].split("/")[-1], m["name"], "median", round(m["overhead_median_per_ckpt_s"] or 0, 4), "local", round(loc["mean"], 4), "+-", round(loc.get("se") or 0, 4),
          "call", round(m["call_s"]["mean"], 4), "blocked", round(m["blocked_s"]["mean"], 4), "step1", m["steps_after_ckpt_extra_s"][0])
PY
}
