"""Restore from S3 straight into GPU memory vs from a local file vs download-then-load (issue 14).

For the GPU host, which has no package index: the S3 server is a moto[server] process on
127.0.0.1 (carried as wheels; objects held in its memory). Saves a GPU training-like state with
gdsckpt (typed ANS), uploads the file (boto3 multipart), then times, --rounds times each:

* s3->gpu: gdsckpt.open(url).read(..., device='cuda') - footer and index by ranged GETs, chunk records by
  KvikIO RemoteFile into device buffers, verified and decompressed into the tensors; no local file;
* local: gdsckpt.load(path, device="cuda") with the file's page cache dropped first (cold);
* download-then-load: boto3 download_file to a local file (fsync'd), then gdsckpt.load (the
  just-written file, warm in the page cache).

Every result is compared with the saved tensors bit for bit. A corrupted object must fail with
a ChecksumError naming the URL. Writes JSON (and the moto log tail) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"probe": "bench/probes/probe_s3_gpu.py", "date": time.strftime("%Y-%m-%d"),
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "server": "moto[server] (Flask, threaded) on 127.0.0.1, objects in its memory"}
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = open(out / "moto.log", "w")
    moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "gdsckpt",
                       "AWS_SECRET_ACCESS_KEY": "gdsckpt-secret", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
    try:
        import boto3
        import kvikio
        from boto3.s3.transfer import TransferConfig

        import gdsckpt
        from gdsckpt.bench.disk import drop_page_cache
        doc["kvikio"] = kvikio.__version__
        doc["remote_file_available"] = kvikio.is_remote_file_available()
        s3 = boto3.client("s3")
        for _ in range(100):
            try:
                s3.create_bucket(Bucket="ckpt")
                break
            except Exception:
                time.sleep(0.1)
        n = (args.mib << 20) // 6  # fp32 master + bf16 weights: 6 bytes per element
        g = torch.Generator(device="cuda").manual_seed(0)
        master = torch.randn(n, device="cuda", generator=g)
        state = {"model": {"w": master.to(torch.bfloat16)}, "optim": {"master": master,
                 "step": torch.tensor(3.0, device="cuda")}}
        logical = sum(t.nbytes for d in state.values() for t in d.values())
        tmp = Path(tempfile.mkdtemp(prefix="gdsckpt-s3gpu-"))
        path = tmp / "step.gdsckpt"
        gdsckpt.save(state, path)  # warm-up
        st = gdsckpt.save(state, path)
        doc["state"] = {"logical_bytes": logical, "file_bytes": path.stat().st_size, "codec": "auto (typed ANS)",
                        "save_seconds": st.seconds, "io_path": st.io_path}
        cfg = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=64 << 20, max_concurrency=8)
        t = time.perf_counter()
        s3.upload_file(str(path), "ckpt", "run/step.gdsckpt", Config=cfg)
        doc["upload_seconds_boto3_to_moto"] = time.perf_counter() - t
        url = "s3://ckpt/run/step.gdsckpt"
        want = {"model/w": state["model"]["w"], "optim/master": master, "optim/step": state["optim"]["step"]}

        def same(got: dict) -> bool:
            return all(torch.equal(got[k].view(torch.uint8) if got[k].dtype == torch.bfloat16 else got[k],
                                   v.view(torch.uint8) if v.dtype == torch.bfloat16 else v) for k, v in want.items())

        rows = []
        for r in range(args.rounds):
            t = time.perf_counter()
            with gdsckpt.open(url) as ck:
                t_index = time.perf_counter() - t
                got = ck.read(ck.keys(), device="cuda")
                torch.cuda.synchronize()
            stats = {"seconds": time.perf_counter() - t, "index_seconds": t_index, "stages": ck.last_stats.stages}
            ok = same(got)
            del got
            rows.append({"method": "s3->gpu (KvikIO RemoteFile)", "round": r, "seconds": stats["seconds"],
                         "index_seconds": stats["index_seconds"], "stages": stats["stages"], "bit_exact": ok})
            drop_page_cache(path)
            torch.cuda.synchronize()
            t = time.perf_counter()
            loaded = gdsckpt.load(path, device="cuda")
            torch.cuda.synchronize()
            sec = time.perf_counter() - t
            ok = same({"model/w": loaded["model"]["w"], "optim/master": loaded["optim"]["master"],
                       "optim/step": loaded["optim"]["step"]})
            del loaded
            rows.append({"method": "local file (cold) -> gpu", "round": r, "seconds": sec, "bit_exact": ok})
            dl = tmp / "download.gdsckpt"
            t = time.perf_counter()
            s3.download_file("ckpt", "run/step.gdsckpt", str(dl), Config=cfg)
            fd = os.open(dl, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            t_dl = time.perf_counter() - t
            loaded = gdsckpt.load(dl, device="cuda")
            torch.cuda.synchronize()
            sec = time.perf_counter() - t
            ok = same({"model/w": loaded["model"]["w"], "optim/master": loaded["optim"]["master"],
                       "optim/step": loaded["optim"]["step"]})
            del loaded
            dl.unlink()
            rows.append({"method": "download (boto3) then load", "round": r, "seconds": sec,
                         "download_seconds": t_dl, "bit_exact": ok})
            for row in rows[-3:]:
                row["GBps"] = logical / row["seconds"] / 1e9
                print(f"round {r} {row['method']:<30} {row['seconds']:.3f} s {row['GBps']:.2f} GB/s "
                      f"bit-exact {row['bit_exact']}", flush=True)
        doc["results"] = rows
        # a corrupted object: one flipped bit in the first chunk record
        with gdsckpt.open(path) as ck:
            off = ck.index.records[0].file_offset
        data = bytearray(path.read_bytes())
        data[off + 100] ^= 1
        s3.put_object(Bucket="ckpt", Key="run/bad.gdsckpt", Body=bytes(data))
        try:
            gdsckpt.load("s3://ckpt/run/bad.gdsckpt")
            doc["corrupt_object"] = "NOT DETECTED"
        except gdsckpt.ChecksumError as e:
            doc["corrupt_object"] = f"ChecksumError: {e}"
        print("corrupt object:", doc["corrupt_object"], flush=True)
    except BaseException:
        doc["error"] = traceback.format_exc()
        print(doc["error"], flush=True)
    finally:
        moto.kill()
        moto.wait()
        log.close()
        (out / "s3-gpu.json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if "error" not in doc else 1


if __name__ == "__main__":
    sys.exit(main())
