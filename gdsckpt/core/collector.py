"""Python's cyclic garbage collector, paused while a save builds its objects, and while a load
parses an index and plans.

A save of a thousand tensors keeps a few thousand tracked objects alive while it runs (the
skeleton's containers, a Leaf per tensor, the plan's records). Every 700 of them set off a young
collection, every tenth of those a middle one, and whatever of the save is alive then goes to the
oldest generation: ~2,900 objects a save of the bench's 1,172 tensors, so that a full collection
of the whole process (0.16 s for torch's ~300k objects on a 2-core VM) came every 25 saves, 6.3 ms
a save on the training thread (8.2 ms on an H100's host). Paused, the save's objects meet one
young collection when the save is done with them: ~410 promoted a save, one full collection in
150 saves, 1.0 ms a save on both (`bench/probes/gc_cost.py`; `bench/results/2026-11-24-cpu-gc/`,
`-h100-collector/`). The pause lasts while a save's call or its snapshot thread runs, their
waits for an earlier save included.

A load makes the same kind of objects in bulk: an index's JSON document (~10 objects a tensor) and
the plan of its targets. Collections set off while they are alive cost a restore of 16,000
tensors 0.38-0.52 s where it takes 0.26-0.36 s with the collector paused (2-core VM, 2026-11-24);
in a 20 GB restore on an H100 that Python runs before the first read, with the disk idle.

Only a collector the process has enabled is paused (a loop that runs gc.disable() and collects
on its own schedule, as torchtitan does, is left alone), and it is enabled again when the last
save that paused it leaves; saves on several threads share the pause.
"""

from __future__ import annotations

import contextlib
import gc
import threading

__all__ = ["paused"]

_lock = threading.Lock()
_inside = 0  # saves inside paused(), on any thread
_disabled_here = False  # whether the first of them disabled the collector


@contextlib.contextmanager
def paused():
    global _inside, _disabled_here
    with _lock:
        if _inside == 0:
            _disabled_here = gc.isenabled()
            if _disabled_here:
                gc.disable()
        _inside += 1
    try:
        yield
    finally:
        with _lock:
            _inside -= 1
            if _inside == 0 and _disabled_here:
                _disabled_here = False
                gc.enable()
