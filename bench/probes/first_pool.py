"""What a first save_async's host memory could cost (issue 22, target 3, for a save nobody
reserved for): the ways of getting N GB of host memory that a device-to-host copy can fill, each
timed to the copy done, in a fresh process-wide state per way.

    OUT=dir python bench/probes/first_pool.py [--gb 4] [--repeats 2]

Ways (each into N GB, the device source random bytes, the copy in 256 MiB pieces as the ring's):
  pinned-arenas    torch.empty(pin_memory=True) in POOL_ARENA_BYTES arenas (what the pool does), then the copy
  pinned-4threads  the same arenas allocated by 4 threads at once
  pageable         torch.empty (untouched), the copy into it (first touch inside the copy), then again (warm)
  pageable-huge    an anonymous mmap with MADV_HUGEPAGE, the copy into it, then again
  register         pageable memory touched first (memset), then cudaHostRegister, then the copy
  pool-arenas(-huge, -256MiB, -1024MiB) the pool's own kind of arenas (pinned_pool._registered;
                   64 MiB on 4 KiB or transparent huge pages, or larger), made one after another
                   on a second thread, then the copy
Writes first_pool.json with the host's transparent hugepage setting.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gdsckpt.core.defaults import POOL_ARENA_BYTES  # noqa: E402
from gdsckpt.engine.gpu.host_register import register, unregister  # noqa: E402

PIECE = 256 << 20


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for off in range(0, dst.numel(), PIECE):
        dst[off:off + PIECE].copy_(src[off:off + PIECE], non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def arenas(n: int, threads: int) -> tuple[list, float]:
    sizes = [POOL_ARENA_BYTES] * (n // POOL_ARENA_BYTES)
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        out = list(ex.map(lambda s: torch.empty(s, dtype=torch.uint8, pin_memory=True), sizes))
    return out, time.perf_counter() - t


def pool_arena(size: int, huge: bool, touch: str = "fill") -> torch.Tensor:
    """pinned_pool._registered's arena (an anonymous mapping, filled, registered), optionally on
    transparent huge pages (MADV_HUGEPAGE), which the library tried and dropped: no faster here."""
    populate = touch == "populate"  # the kernel faults every page in at mmap, not torch's fill
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (mmap.MAP_POPULATE if populate else 0))
    m.madvise(mmap.MADV_DONTFORK)
    if huge:
        m.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    t0 = time.perf_counter()
    if not populate:
        t.fill_(0)
    t1 = time.perf_counter()
    register(t.data_ptr(), size)
    SPLIT["fill_s"] += t1 - t0
    SPLIT["register_s"] += time.perf_counter() - t1
    return t


SPLIT = {"fill_s": 0.0, "register_s": 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only-arenas", action="store_true")
    args = ap.parse_args()
    n = int(args.gb * (1 << 30)) // POOL_ARENA_BYTES * POOL_ARENA_BYTES
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": torch.cuda.get_device_name(), "bytes": n,
           "arena_bytes": POOL_ARENA_BYTES, "thp": thp.read_text().strip() if thp.exists() else None, "ways": {}}

    def record(name, row):
        out["ways"].setdefault(name, []).append({k: round(v, 4) for k, v in row.items()})
        print(name, out["ways"][name][-1], flush=True)

    for _ in range(args.repeats):
        for threads, name in () if args.only_arenas else ((1, "pinned-arenas"), (4, "pinned-4threads")):
            got, alloc = arenas(n, threads)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for i, a in enumerate(got):
                a.copy_(src[i * POOL_ARENA_BYTES:(i + 1) * POOL_ARENA_BYTES], non_blocking=True)
            torch.cuda.synchronize()
            record(name, {"alloc_s": alloc, "copy_s": time.perf_counter() - t})
            del got
            getattr(torch._C, "_host_emptyCache", lambda: None)()  # torch keeps freed pinned blocks for reuse: the next way starts afresh
        for size, huge, where, touch in ((POOL_ARENA_BYTES, True, "thread", "fill"), (POOL_ARENA_BYTES, False, "thread", "fill"),
                                         (256 << 20, False, "thread", "fill"), (1 << 30, False, "thread", "fill"),
                                         (POOL_ARENA_BYTES, False, "main", "fill"), (POOL_ARENA_BYTES, False, "thread", "populate")):
            SPLIT.update(fill_s=0.0, register_s=0.0)
            t = time.perf_counter()  # the pool's own kind of arenas, made one after another

            def make():
                return [pool_arena(size, huge, touch) for _ in range(n // size)]
            if where == "main":
                got = make()
            else:
                with ThreadPoolExecutor(1) as ex:
                    got = ex.submit(make).result()
            alloc = time.perf_counter() - t
            torch.cuda.synchronize()
            t = time.perf_counter()
            for i, a in enumerate(got):
                a.copy_(src[i * size:(i + 1) * size], non_blocking=True)
            torch.cuda.synchronize()
            name = "pool-arenas" + ("-huge" if huge else "") + ("" if size == POOL_ARENA_BYTES else f"-{size >> 20}MiB") \
                + ("-main-thread" if where == "main" else "") + ("-populate" if touch == "populate" else "")
            record(name, {"alloc_s": alloc, "copy_s": time.perf_counter() - t} | SPLIT)
            for a in got:
                unregister(a.data_ptr())
            del got
        if args.only_arenas:
            continue
        dst = torch.empty(n, dtype=torch.uint8)
        first = copy_into(dst, src)
        record("pageable", {"first_copy_s": first, "warm_copy_s": copy_into(dst, src)})
        del dst
        m = mmap.mmap(-1, n)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            m.madvise(mmap.MADV_HUGEPAGE)
        dst = torch.frombuffer(m, dtype=torch.uint8)
        first = copy_into(dst, src)
        record("pageable-huge", {"first_copy_s": first, "warm_copy_s": copy_into(dst, src)})
        del dst
        m.close()
        dst = torch.empty(n, dtype=torch.uint8)
        t = time.perf_counter()
        dst.fill_(0)
        touch = time.perf_counter() - t
        t = time.perf_counter()
        register(dst.data_ptr(), n)
        reg = time.perf_counter() - t
        record("register", {"touch_s": touch, "register_s": reg, "copy_s": copy_into(dst, src)})
        unregister(dst.data_ptr())
        del dst
    Path(os.environ.get("OUT", "."), "first_pool.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
