"""Issue 22, "every path": GdsckptWriter(snapshot="device") in the bench's training loop, as it
stages now (the state copied on the GPU, then compressed into the pool on a background thread, the
copy let go) against its staging before 2026-11-25 (the copy held until DCP's background
write_data had compressed and written it), in the same run.

    OUT=dir python bench/probes/dcp_device_staging.py [gdsckpt-bench --train options]

Runs `gdsckpt-bench --train` with one more method, "dcp-device-before": the device staging with
GdsckptWriter.stage answering as it did before (snapshot_state_dict's copy, returned to DCP).
Defaults: --methods none,dcp-gdsckpt,dcp-gdsckpt-device,dcp-device-before,dcp-gdsckpt-overlap,
--output $OUT/dcp_device_staging.json, --directory $BENCH_DIR or /tmp/bench.
"""
from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from idle_trace import train_with_defaults  # noqa: E402

from gdsckpt.bench import train_methods as tm  # noqa: E402
from gdsckpt.dcp import writer as dcp_writer  # noqa: E402


def _stage_before(self, state_dict):
    return dcp_writer.snapshot_state_dict(state_dict)


class DeviceBefore(tm.DcpGdsckpt):
    def __init__(self):
        super().__init__(snapshot="device")
        self.name = "dcp.async_save GdsckptWriter snapshot=device, before"

    def save(self, ctx, state, path):
        with mock.patch.object(dcp_writer.GdsckptWriter, "stage", _stage_before):
            return super().save(ctx, state, path)


tm.METHODS.append(DeviceBefore)
tm.ALIASES["dcp-device-before"] = "dcp.async_save GdsckptWriter snapshot=device, before"

if __name__ == "__main__":
    sys.exit(train_with_defaults("none,dcp-gdsckpt,dcp-gdsckpt-device,dcp-device-before,dcp-gdsckpt-overlap",
                                 "dcp_device_staging.json"))
