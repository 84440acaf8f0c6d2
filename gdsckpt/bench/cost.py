"""gdsckpt-bench --cost: what checkpointing costs a month, from a --train result and your numbers.

Every GPU of a synchronous data-parallel job stands still while one checkpoints, so:

  idle GPU-hours / month = checkpoints / month x overhead per checkpoint (s) / 3600 x GPUs
  idle $ / month         = idle GPU-hours / month x $ per GPU-hour
  storage $ / month      = retention (checkpoints kept) x stored bytes per checkpoint / 1e12 x $ per TB-month

with checkpoints / month = 30 days / the checkpoint interval, the overhead (targets.idle_estimate:
the local estimate where there is one) and stored bytes measured by --train per method. By
default each GPU is assumed to checkpoint a state like the measured one (stored bytes per
checkpoint = the measured file x GPUs); --state-per-gpu scales
both the overhead and the stored bytes linearly from the measured state's size, an assumption
the output names.
"""

from __future__ import annotations

import sys

from .targets import idle_estimate
from .workload import parse_size

MONTH_S = 30 * 24 * 3600


def add_arguments(ap) -> None:
    g = ap.add_argument_group("--cost: monthly idle-GPU and storage cost per method")
    g.add_argument("--cost", action="store_true", help="price the --train result (this run, or --cost-from)")
    g.add_argument("--cost-from", metavar="JSON", help="a --train JSON result to price (instead of running --train)")
    g.add_argument("--gpus", type=int, default=1024, help="GPUs in the job (--cost; default 1024)")
    g.add_argument("--gpu-hour", type=float, default=2.0, help="$ per GPU-hour (--cost; default 2.0)")
    g.add_argument("--ckpt-every", type=float, default=30.0,
                   help="minutes between checkpoints in the real job (--cost; default 30)")
    g.add_argument("--tb-month", type=float, default=23.0, help="$ per TB-month of storage (--cost; default 23)")
    g.add_argument("--retention", type=int, default=5, help="checkpoints kept (--cost; default 5)")
    g.add_argument("--state-per-gpu", default=None,
                   help="each GPU's checkpoint state, e.g. 40GB (--cost; default: the measured state; "
                        "scales overhead and storage linearly)")


def compute(result: dict, args) -> dict:
    if result.get("mode") != "train":
        raise SystemExit("--cost needs a --train result (its JSON has mode: train)")
    if args.ckpt_every <= 0 or args.gpus <= 0:
        raise SystemExit("--ckpt-every and --gpus must be positive")
    # per GPU: under torchrun each rank holds and stores its share (stored_bytes is every rank's files)
    measured = result["state"].get("per_rank_bytes", result["state"]["logical_bytes"])
    world = result.get("world_size", 1)
    scale = parse_size(args.state_per_gpu) / measured if args.state_per_gpu else 1.0
    per_month = MONTH_S / (args.ckpt_every * 60)
    rows = []
    for r in result["methods"]:
        if r["name"] == "none":
            continue
        o, _ = idle_estimate(r)
        if r.get("status") != "ok" or o is None:
            rows.append({"name": r["name"], "error": r.get("error") or r.get("status")})
            continue
        idle_s = max(0.0, o) * scale
        gpu_h = per_month * idle_s / 3600 * args.gpus
        stored = r.get("stored_bytes")
        ckpt_bytes = stored / world * scale * args.gpus if stored else None
        rows.append({"name": r["name"], "idle_s_per_ckpt": idle_s, "idle_gpu_hours_month": gpu_h,
                     "idle_usd_month": gpu_h * args.gpu_hour,
                     "checkpoint_bytes": ckpt_bytes,
                     "storage_usd_month": args.retention * ckpt_bytes / 1e12 * args.tb_month if ckpt_bytes else None,
                     "blocked_s_per_ckpt": r["blocked_s"]["mean"]})
        if rows[-1]["storage_usd_month"] is not None:
            rows[-1]["total_usd_month"] = rows[-1]["idle_usd_month"] + rows[-1]["storage_usd_month"]
    return {"inputs": {"gpus": args.gpus, "usd_per_gpu_hour": args.gpu_hour, "ckpt_every_min": args.ckpt_every,
                       "usd_per_tb_month": args.tb_month, "retention": args.retention,
                       "state_per_gpu_bytes": int(measured * scale), "measured_state_bytes": measured,
                       "scaled": scale != 1.0},
            "checkpoints_per_month": per_month,
            "source": {"date": result.get("date"), "device": result.get("device", {}).get("name"),
                       "interval_steps": result.get("interval"), "step_s": result.get("step_s")},
            "methods": rows}


def print_cost(cost: dict, out=None) -> None:
    out = out or sys.stdout
    i = cost["inputs"]
    print(f"\ncost per month: {i['gpus']} GPUs at ${i['usd_per_gpu_hour']:.2f}/GPU-hour, a checkpoint every "
          f"{i['ckpt_every_min']:g} min ({cost['checkpoints_per_month']:.0f}/month), {i['retention']} kept at "
          f"${i['usd_per_tb_month']:.2f}/TB-month; state per GPU {i['state_per_gpu_bytes'] / 1e9:.2f} GB"
          + (" (scaled linearly from the measured state)" if i["scaled"] else " (as measured)")
          + f"; measured {cost['source']['date']} on {cost['source']['device']}", file=out)
    print(f"{'method':<38}{'idle s/ckpt':>12}{'idle GPU-h':>12}{'idle $':>12}{'stored TB':>11}{'storage $':>11}"
          f"{'total $':>12}", file=out)
    for r in cost["methods"]:
        if "error" in r:
            print(f"{r['name']:<38}  not priced: {r['error']}", file=out)
            continue
        tb = r["checkpoint_bytes"] / 1e12 if r["checkpoint_bytes"] else None
        print(f"{r['name']:<38}{r['idle_s_per_ckpt']:>12.3f}{r['idle_gpu_hours_month']:>12,.0f}"
              f"{r['idle_usd_month']:>12,.0f}{'-' if tb is None else f'{tb:.3f}':>11}"
              f"{'-' if r['storage_usd_month'] is None else format(r['storage_usd_month'], ',.0f'):>11}"
              f"{'-' if r.get('total_usd_month') is None else format(r['total_usd_month'], ',.0f'):>12}", file=out)
