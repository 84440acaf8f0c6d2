"""The "device" snapshot mode (writing/snapshot/modes.py): every save copies the state on its own device
(device_copy.snapshot_tensors, from torch's cache), returns, and takes the compressed snapshot
from the copy on a background thread, which lets the copy go once its chunks are in the pool.
No optimizer step waits. Where the device has no room for the copy, the snapshot is taken in
the call instead (logged; its stats say mode "host")."""

from __future__ import annotations

import logging

from gdsckpt.writing.save import Snapshot

__all__ = ["DeviceSnapshot"]

log = logging.getLogger("gdsckpt.save_async")


class DeviceSnapshot:
    """snapshot="device" for save_async and GdsckptWriter (a SnapshotMode)."""

    name = Snapshot.DEVICE
    used_by = ("save_async", "dcp")
    optimizer = "unused"
    with_optimizer = None
    uses_pool = True

    def save(self, call):
        fut = call.copied(block=None)
        if fut is None:
            log.warning("gdsckpt: save_async(snapshot='device') of %s: no room on the GPU for a copy of the "
                        "state; took the host snapshot in the call", call.label)
            fut = call.take()
        return fut

    def stage(self, call):
        staged = call.copied(block=None)
        return call.take() if staged is None else staged
