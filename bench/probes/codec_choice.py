"""Issue 22, target 6: codec="auto" on the GPU chooses typed or byte-plane ANS per stream. On the
bench's GPT state (bf16 weights, fp32 master weights, real AdamW moments), through the save
pipeline with storage removed (api.save_through into a NullSink):

- per codec (ans, ans-planes, auto): per stream saved % and the compression's GB/s (logical bytes
  over the ring's "compress" stage, and over gather + compress + checksum), the median of --loops
  saves after a warm-up; for auto also the first save's sampling time ("codec_choice");
- per tensor role (bf16 weights, fp32 master, exp_avg, exp_avg_sq): saved % with ans and ans-planes,
  and what a choice per role instead of per stream would store (the fp32 stream holds all three);
- the byte-shuffle kernels' own speed on 256 MiB of the fp32 stream;
- the target: auto's fp32 saved % at least 1 point above typed ANS's, compression above 15 GB/s.

    python bench/probes/codec_choice.py [--size auto|gpt2-small|4GB] [--loops 5]    (JSON to $OUT)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from gdsckpt import api
from gdsckpt.bench.provenance import stamp
from gdsckpt.bench.sinks import NullSink
from gdsckpt.bench.workload import make_state
from gdsckpt.format.tree import flatten

CODECS = ("ans", "ans-planes", "auto")


def role(key: str) -> str:
    if key.startswith("model/"):
        return "model_bf16"
    if key.startswith("master/"):
        return "master_fp32"
    return key.rsplit("/", 1)[-1]  # exp_avg, exp_avg_sq, step


def _streams(stats) -> dict:
    return {s["dtype"]: {"codec": s["codec"], "logical_bytes": s["logical_bytes"], "stored_bytes": s["stored_bytes"],
                         "saved_pct": round(100 * (1 - s["ratio"]), 3), "raw_chunks": s["raw_chunks"]}
            for s in stats.streams}


def _gbps(nbytes: int, seconds: float) -> float | None:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else None


def whole_state(state, codec: str, loops: int) -> dict:
    first = api.save_through(state, NullSink(), codec=codec)  # warm-up; auto: samples the layout once
    runs = [api.save_through(state, NullSink(), codec=codec) for _ in range(loops)]
    med = lambda f: statistics.median(f(s) for s in runs)  # noqa: E731
    logical = first.logical_bytes
    compress = med(lambda s: s.stages.get("compress", 0.0))
    pipeline = med(lambda s: sum(s.stages.get(k, 0.0) for k in ("gather", "compress", "checksum")))
    return {"codec": codec, "logical_bytes": logical, "stored_bytes": runs[-1].stored_bytes,
            "saved_pct": round(100 * (1 - runs[-1].stored_bytes / logical), 3), "streams": _streams(runs[-1]),
            "compress_gbps": _gbps(logical, compress), "gather_compress_checksum_gbps": _gbps(logical, pipeline),
            "save_s_median": round(med(lambda s: s.seconds), 4),
            "first_save_codec_choice_s": round(first.stages.get("codec_choice", 0.0), 4),
            "steady_saves_sampled": sum("codec_choice" in s.stages for s in runs)}


def per_role(leaves) -> dict:
    groups: dict[str, dict] = {}
    for leaf in leaves:
        if leaf.tensor.is_cuda and leaf.tensor.dtype in (torch.float32, torch.bfloat16):
            groups.setdefault(role(leaf.key), {})[leaf.key] = leaf.tensor
    out = {}
    for name, tensors in groups.items():
        row = {"logical_bytes": sum(t.nbytes for t in tensors.values())}
        for codec in ("ans", "ans-planes"):
            stored = api.save_through(tensors, NullSink(), codec=codec).stored_bytes
            row[codec] = {"stored_bytes": stored, "saved_pct": round(100 * (1 - stored / row["logical_bytes"]), 3)}
        out[name] = row
    fp32 = [r for n, r in out.items() if n != "model_bf16"]
    logical = sum(r["logical_bytes"] for r in fp32)
    out["fp32_choice_per_role"] = {
        "saved_pct": round(100 * (1 - sum(min(r["ans"]["stored_bytes"], r["ans-planes"]["stored_bytes"])
                                          for r in fp32) / logical), 3),
        "note": "what choosing per tensor role would save on the fp32 stream (the format chooses per stream)"}
    return out


def kernel_speed(leaves, nbytes: int = 256 << 20, reps: int = 10) -> dict:
    import cupy
    from gdsckpt.engine.gpu import kernels
    from gdsckpt.engine.gpu.backend import as_cupy
    parts, have = [], 0
    for leaf in leaves:  # the fp32 stream's first tensors, in stream order, up to nbytes
        if leaf.tensor.is_cuda and leaf.tensor.dtype == torch.float32 and have < nbytes:
            parts.append(leaf.tensor.reshape(-1).view(torch.uint8))
            have += leaf.tensor.nbytes
    src = as_cupy(torch.cat(parts)[:nbytes].contiguous())
    n = src.nbytes
    dst, back = cupy.empty(n, dtype=cupy.uint8), cupy.empty(n, dtype=cupy.uint8)
    stream = cupy.cuda.get_current_stream()
    out = {"bytes": n}
    for name, run in (("shuffle", lambda: kernels.shuffle_bytes(stream, src, dst, 4)),
                      ("unshuffle", lambda: kernels.unshuffle_bytes(stream, dst, back, 4))):
        run()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(reps):
            run()
        end.record(stream)
        end.synchronize()
        out[f"{name}_gbps"] = _gbps(n * reps, cupy.cuda.get_elapsed_time(start, end) / 1e3)
    out["round_trip_exact"] = bool((back == src).all())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="auto", help="make_state size: auto (gpt2-small on CUDA), tiny, or bytes (4GB)")
    ap.add_argument("--loops", type=int, default=5)
    args = ap.parse_args()
    state = make_state(args.size, device="cuda")
    _, leaves = flatten(state)
    result = {**stamp("cuda"), "size": args.size, "loops": args.loops}
    result["codecs"] = {c: whole_state(state, c, args.loops) for c in CODECS}
    result["roles"] = per_role(leaves)
    result["kernels"] = kernel_speed(leaves)
    fp32 = {c: result["codecs"][c]["streams"]["float32"]["saved_pct"] for c in CODECS}
    auto = result["codecs"]["auto"]
    result["target"] = {
        "fp32_saved_pct": fp32, "gain_pp_auto_vs_ans": round(fp32["auto"] - fp32["ans"], 3),
        "whole_state_gain_pp": round(auto["saved_pct"] - result["codecs"]["ans"]["saved_pct"], 3),
        "auto_compress_gbps": auto["compress_gbps"],
        "met": fp32["auto"] - fp32["ans"] >= 1.0 and (auto["compress_gbps"] or 0) > 15}
    text = json.dumps(result, indent=1)
    print(text)
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "codec_choice.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
