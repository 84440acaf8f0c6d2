"""The bench's local and by-medians estimates of each repeat of a --train JSON (train_report's own
functions): python per_repeat.py FILE... with the source tree on PYTHONPATH."""
import json, sys, statistics
from gdsckpt.bench.train_loop import Loop
from gdsckpt.bench import train_report as tr
def loops(m):
    return [Loop(0.0, calls=[c / 1e3 for c in r["calls_ms"]], completion=r["completion_s"], steps=[s / 1e3 for s in r["steps_ms"]],
                 ckpt_steps=r["ckpt_steps"]) for r in m["raw"]]
for p in sys.argv[1:]:
    r = json.load(open(p)); ms = {m["name"]: m for m in r["methods"]}
    none = loops(ms["none"])
    for name in ms:
        if name == "none": continue
        for i, l in enumerate(loops(ms[name])):
            loc = tr._local_per_ckpt(l, tr._none_of(none, i), r["interval"])
            med = tr._median_overhead([l], [tr._none_of(none, i)], r["interval"])
            print(p.split("/")[-1], name, "repeat", i, "local", None if loc is None else (round(statistics.fmean(loc), 4), round(statistics.stdev(loc) / len(loc) ** .5, 4), len(loc)), "by medians", None if med is None else round(med, 4))
