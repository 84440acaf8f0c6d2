"""Summarise a `py-spy record --format raw --threads [--gil]` file: samples per thread, and per
thread the innermost frames that held them (with --gil: who held the GIL, and where).

    python bench/probes/pyspy_summary.py RAW [--depth 3] [--top 25]
"""
import argparse
import collections
import json

ap = argparse.ArgumentParser()
ap.add_argument("raw")
ap.add_argument("--depth", type=int, default=3)
ap.add_argument("--top", type=int, default=25)
args = ap.parse_args()
threads, where = collections.Counter(), collections.Counter()
for line in open(args.raw):
    stack, _, n = line.rstrip("\n").rpartition(" ")
    if not stack or not n.isdigit():
        continue
    frames = stack.split(";")
    thread = frames[0]
    inner = ";".join(f.split(" (")[0] + "@" + f.rsplit("/", 1)[-1].rstrip(")") for f in frames[-args.depth:])
    threads[thread] += int(n)
    where[(thread, inner)] += int(n)
total = sum(threads.values())
print(json.dumps({"samples": total, "threads": threads.most_common()}, indent=1))
for (thread, inner), n in where.most_common(args.top):
    print(f"{n:6d} {100 * n / total:5.1f}%  {thread[:30]:30s} {inner}")
