"""Issue 22, "every path": save_async(snapshot="device") in the bench's training loop, against the
design of a first save (async_save._copied_save) taken by every save: the state copied on its GPU
in the call, the compressed host snapshot taken from the copy on a background thread and the
copy freed once it is in the pool, the file written by the pool's writer.

    OUT=dir python bench/probes/device_snapshot.py [gdsckpt-bench --train options]

Runs `gdsckpt-bench --train` (its GPT, AdamW, bf16 autocast, loss.item() every step) with one more
method, "copied": save_async(state, path) with the pool-empty test of device_copy.copy_first
answered True during the call, so that every save takes the first save's path. Defaults:
--methods none,async,async-device,copied,async-overlap, --output $OUT/device_snapshot.json,
--directory $BENCH_DIR or /tmp/bench; the other options are --train's.

Backs: docs/measured.md: save_async(snapshot="device") blocks 0.030 s, 0.083 +- 0.019 s idle a
checkpoint, against 0.63 s blocked in its earlier design (bench/results/: 2026-11-25-h100-device-
mode/ (design/)).
"""
from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from idle_trace import train_with_defaults  # noqa: E402

from gdsckpt.engine import device_copy  # noqa: E402
from gdsckpt.bench import train_methods as tm  # noqa: E402


class Copied(tm.GdsSaveAsync):
    def __init__(self):
        super().__init__("gdsckpt.save_async copied every save", {})

    def save(self, ctx, state, path):
        with mock.patch.object(device_copy, "_pool_empty", lambda gpu: True):
            return super().save(ctx, state, path)


tm.METHODS.append(Copied)
tm.ALIASES["copied"] = "gdsckpt.save_async copied every save"

if __name__ == "__main__":
    sys.exit(train_with_defaults("none,async,async-device,copied,async-overlap", "device_snapshot.json"))
