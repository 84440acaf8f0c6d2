"""Durable save to the local disk in compat mode: KvikIO bouncing device memory itself, against
gdsckpt staging each chunk into pinned host memory first (GDSCKPT_COMPAT_STAGING=1); alternating
runs on one state, with the raw O_DIRECT probe before and after. JSON to $OUT/staging.json."""
import json, os
from pathlib import Path
import torch
import gdsckpt
from gdsckpt import tree
from gdsckpt.bench.disk import disk_probe
from gdsckpt.bench.workload import make_state

d = Path("/tmp/staging"); d.mkdir(exist_ok=True)
state = make_state("4GB", device="cuda")
rows = [{"probe_before": disk_probe(d, 4 << 30)}]
p = d / "s.gdsckpt"
for rep in range(3):
    for staging in ("0", "1"):
        os.environ["GDSCKPT_COMPAT_STAGING"] = staging
        s = gdsckpt.save(state, p)
        out = gdsckpt.load(p)
        ok = all(torch.equal(a.tensor, b.tensor) for a, b in zip(tree.flatten(out)[1], tree.flatten(state)[1]))
        del out
        row = {"rep": rep, "staging": staging == "1", "save_gbps": round(s.gbps, 3), "ratio": round(s.ratio, 4),
               "wait_io": round(s.stages.get("wait_io", 0), 3), "memory": s.memory, "bit_exact": ok}
        print(json.dumps(row), flush=True)
        rows.append(row)
rows.append({"probe_after": disk_probe(d, 4 << 30)})
print(rows[0], rows[-1])
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "staging.json"), "w"), indent=1)
