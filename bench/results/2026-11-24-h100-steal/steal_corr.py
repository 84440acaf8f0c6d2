import json, sys, statistics as st
from gdsckpt.bench.train_loop import Loop
from gdsckpt.bench import train_report as tr
def loops(m):
    return [Loop(0.0, calls=[c / 1e3 for c in r["calls_ms"]], completion=r["completion_s"], steps=[s / 1e3 for s in r["steps_ms"]],
                 ckpt_steps=r["ckpt_steps"]) for r in m["raw"]]
r = json.load(open(sys.argv[1])); ms = {m["name"]: m for m in r["methods"]}
iv = r["interval"]
none = loops(ms["none"])
xs, ys = [], []
for name in ms:
    if name == "none": continue
    for i, l in enumerate(loops(ms[name])):
        nl = tr._none_of(none, i)
        loc = tr._local_per_ckpt(l, nl, iv)
        sw = ms[name]["raw"][i]["steal_cpu_s_per_interval"]; nw = ms["none"]["raw"][i]["steal_cpu_s_per_interval"]
        # checkpoint at step c (c = k*iv): the local window is the interval after it: steal window index k
        cs = [c for c in l.ckpt_steps if c >= 30 and c + iv <= min(len(l.steps), len(nl.steps))]
        for c, v in zip(cs, loc):
            k = c // iv
            xs.append(sw[k] - nw[k]); ys.append(v)
        # loop-level: the per-loop steal and the per-step mean difference
        dm = st.fmean(l.steps) - st.fmean(nl.steps)
        print(name, i, "loop steal", ms[name]["raw"][i]["steal_cpu_s"], "none", ms["none"]["raw"][i]["steal_cpu_s"], "mean step diff ms %.2f" % (dm * 1e3))
print("n", len(xs), "corr(steal diff, local per ckpt)", round(st.correlation(xs, ys), 2), "slope s per steal-s", round(st.linear_regression(xs, ys).slope, 3))
lo = [y for x, y in zip(xs, ys) if x <= st.median(xs)]; hi = [y for x, y in zip(xs, ys) if x > st.median(xs)]
print("local mean where steal diff <= median %.3f (n %d), above %.3f (n %d)" % (st.fmean(lo), len(lo), st.fmean(hi), len(hi)))
