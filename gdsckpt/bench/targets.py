"""The stall-free targets, checked against a --train result: met, or short by how much.

--train puts this check in its JSON ("targets") and prints it; for a result written before,
`python -m gdsckpt.bench.targets RESULT.json [OUT.json]`. It names what missed and by how much,
not why: the round's NOTES.md says that. The targets (issue 13), per checkpoint and, under
torchrun, per rank; snapshot="device", which opts into a copy of the state on the GPU, is held to
all of them but extra_gpu_bytes:

  idle_s            overhead per checkpoint <= 0.05 s for the save_async rows (issue 22, target 1),
                    <= 0.10 s for the DCP rows (issue 13; issue 22, target 2): the
                    local estimate (overhead_local_per_ckpt_s: the call and the steps after
                    each checkpoint beyond the quiet steps around it), which drift between
                    loops does not move; the loop's time beyond the 'none' loop's where there
                    is no local estimate (a write outlasted the interval). `estimate`
                    says which; `by_medians`: the same window by per-step medians
                    (overhead_median_per_ckpt_s), beside it;
  blocked_s         caller blocked <= 0.15 s, or <= 0.02 s in an overlap mode (where it includes
                    the optimizer step's wait for the snapshot);
  extra_gpu_bytes   torch's peak GPU memory beyond the 'none' loop <= the ring's bound
                    (RING_DEPTH x 2 x the GPU chunk size; GPU runs only);
  durable_x_sync    call to durable <= 1.3 x the same run's synchronous save (gdsckpt.save, or
                    dcp.save + GdsckptWriter for the DCP rows), when the run has one.

and (issue 22, target 3), for the methods that reserve their host memory ahead of the first
save (the save_async rows and the memory tier's; the DCP rows' staging is not reserved):

  first_blocked_beyond_steady_s   the first save's blocked time (outside the loops, after the
                    method's reservation) minus the loops' mean blocked time <= 0.30 s.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gdsckpt.core.defaults import CHUNK_BYTES, RING_DEPTH

IDLE_S = 0.10
SAVE_ASYNC_IDLE_S = 0.05
BLOCKED_S = 0.15
OVERLAP_BLOCKED_S = 0.02
RING_BYTES = RING_DEPTH * 2 * CHUNK_BYTES["gpu"]
DURABLE_X_SYNC = 1.3
SYNC_SAVE = {"gdsckpt.save_async": "gdsckpt.save", "dcp.async_save GdsckptWriter": "dcp.save GdsckptWriter"}
FIRST_BLOCKED_BEYOND_STEADY_S = 0.30
RESERVING = ("gdsckpt.save_async", "gdsckpt Checkpointer memory")  # rows whose setup reserves (train_methods)


def check(result: dict) -> list[dict]:
    """One entry per background gdsckpt method (and rank): {method, rank, checks: {name:
    {target, measured, met, short_by}}}; rank None in a one-process run."""
    tables = [(r["rank"], r["methods"]) for r in result.get("ranks", [])] or [(None, result["methods"])]
    gpu = result.get("device", {}).get("kind") == "gpu"
    out = []
    for rank, methods in tables:
        rows = {m["name"]: m for m in methods if m.get("status") == "ok" and m.get("blocked_s", {}).get("mean") is not None}
        for name, m in rows.items():
            family = next((f for f in SYNC_SAVE if name.startswith(f)), None)
            checks = {}
            if family is not None:
                checks = {"idle_s": _idle(m, SAVE_ASYNC_IDLE_S if family == "gdsckpt.save_async" else IDLE_S),
                          "blocked_s": _compare(OVERLAP_BLOCKED_S if "overlap" in name else BLOCKED_S,
                                                m["blocked_s"]["mean"])}
                if gpu and "snapshot=device" not in name:
                    checks["extra_gpu_bytes"] = _compare(RING_BYTES, m["gpu"]["peak_extra_torch_bytes"])
                sync = rows.get(SYNC_SAVE[family])
                if sync and m["completion_s"]["mean"] is not None:
                    checks["durable_x_sync"] = _compare(DURABLE_X_SYNC,
                                                        m["completion_s"]["mean"] / sync["blocked_s"]["mean"])
            if name.startswith(RESERVING):
                checks["first_blocked_beyond_steady_s"] = _compare(FIRST_BLOCKED_BEYOND_STEADY_S, _first_beyond(m))
            if checks:
                out.append({"method": name, "rank": rank, "checks": checks})
    return out


def idle_estimate(m: dict) -> tuple[float | None, str]:
    """A --train method row's GPU idle per checkpoint and which estimate it is: the local one
    where there is one ("local"), else the loop's time beyond the 'none' loop's ("loop")."""
    local = (m.get("overhead_local_per_ckpt_s") or {}).get("mean")
    if local is not None:
        return local, "local"
    return (m.get("overhead_per_ckpt_s") or {}).get("mean"), "loop"


def _idle(m: dict, target: float) -> dict:
    measured, estimate = idle_estimate(m)
    by_medians = m.get("overhead_median_per_ckpt_s")
    return {**_compare(target, measured), "estimate": estimate,
            "by_medians": None if by_medians is None else round(by_medians, 4)}


def _first_beyond(m: dict) -> float | None:
    """The first save's blocked seconds beyond the loops' mean; None where either is missing."""
    first = (m.get("first_save") or {}).get("blocked_s")
    steady = m["blocked_s"]["mean"]
    return None if first is None or steady is None else first - steady


def _compare(target: float, measured: float | None) -> dict:
    if measured is None:
        return {"target": target, "measured": None, "met": None, "short_by": None}
    return {"target": target, "measured": round(measured, 4), "met": measured <= target,
            "short_by": round(max(0.0, measured - target), 4)}


def print_targets(entries: list[dict], out=None) -> None:
    out = out or sys.stdout
    if not entries:
        return
    print("  targets (met, or short by):", file=out)
    for e in entries:
        who = e["method"] + ("" if e["rank"] is None else f", rank {e['rank']}")
        parts = []
        for k, c in e["checks"].items():
            if c["measured"] is None:
                continue
            scale, unit = (2**30, " GiB") if k == "extra_gpu_bytes" else (1, "x" if k == "durable_x_sync" else " s")
            short = c["short_by"] / scale
            how = f" ({c['estimate']})" if "estimate" in c else ""
            medians = f" (by medians {c['by_medians']:.3f} s)" if c.get("by_medians") is not None else ""
            parts.append(f"{k}{how} {c['measured'] / scale:.3f}{unit} " +
                         ("met" if c["met"] else f"short by {short:.3f}{unit}" if short >= 5e-4 else "short by <0.001")
                         + medians)
        print(f"    {who}: " + "; ".join(parts), file=out)


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        raise SystemExit("usage: python -m gdsckpt.bench.targets RESULT.json [OUT.json]")
    entries = check(json.loads(Path(argv[0]).read_text()))
    print_targets(entries)
    if len(argv) == 2:
        Path(argv[1]).write_text(json.dumps(entries, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
