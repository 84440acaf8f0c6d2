#!/usr/bin/env bash
# H100 round B: exit cleanly, storage-removed sweep after the batched gather, KvikIO sweep.
set -uo pipefail
export GDSCKPT_CACHE=/tmp/gdsckpt-cache PYTHONUNBUFFERED=1
python3 -c "
import torch, gdsckpt
gdsckpt.save({'w': torch.randn(1 << 20, device='cuda')}, '/tmp/exit.gdsckpt'); gdsckpt.load('/tmp/exit.gdsckpt')
"; echo "exit rc=$?"
python3 -m gdsckpt.bench --size 4GB --target null --bs 64M,128M,256M --iodepth 2,3 --loops 3 --output $OUT/null.json > $OUT/null.txt 2>&1; echo "null rc=$?"
python3 -m gdsckpt.bench --size 4GB --target null-d2h --bs 128M,256M --iodepth 2,3 --loops 3 --output $OUT/d2h.json > /dev/null 2>&1
python3 - <<'PY'
import json, os
for f in ("null.json", "d2h.json"):
    d = json.load(open(os.path.join(os.environ["OUT"], f)))
    for j in d["jobs"]:
        print(f, j["bs"] >> 20, j["iodepth"], round(j["logical_gbps"], 1), {k: round(v, 4) for k, v in j["stages"].items()})
PY
timeout 420 python3 bench/sweep_kvikio.py 4GB 2>&1 | tail -30
