"""What a save or restore did: `Stats` (save, load) and `AsyncStats` (save_async, which adds the
caller's stall, the background write and the host pool's figures), and `stream_stats`, the
per-stream summary of a plan's records."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .core.units import format_bytes

__all__ = ["Stats", "AsyncStats", "stream_stats", "INNER_STAGES", "outer_seconds"]

# Stages timed inside another one (read_ahead.py's, within the ring's read_wait or atomic_read), or
# before the read began (a whole restore's reads ahead since its open): reported, never added to the others.
INNER_STAGES = frozenset({"read_ahead_wait", "read_ahead_copy", "read_ahead_before_plan"})


def outer_seconds(stages: dict) -> float:
    """The seconds `stages` (a Stats' stages) account for, each counted once."""
    return sum(v for k, v in stages.items() if k not in INNER_STAGES)


@dataclass
class Stats:
    """What one save or restore did. `io_path` is the path the bytes really took: gds, compat or
    cpu; a file read into a GPU in compat mode, read-ahead-direct (or -buffered: read_ahead.py)."""

    op: str
    path: str
    backend: str
    io_path: str
    logical_bytes: int
    stored_bytes: int
    file_bytes: int
    chunks: int
    chunk_bytes: int
    ring_depth: int
    seconds: float
    stages: dict = field(default_factory=dict)
    latencies: list = field(default_factory=list, repr=False)
    streams: list = field(default_factory=list)
    memory: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """stored / logical: 0.85 means 15% of the bytes saved."""
        return self.stored_bytes / self.logical_bytes if self.logical_bytes else 1.0

    @property
    def gbps(self) -> float:
        return self.logical_bytes / self.seconds / 1e9 if self.seconds else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("latencies")
        d["ratio"] = self.ratio
        d["gbps"] = self.gbps
        return d

    def __repr__(self) -> str:  # one line of the key figures; every field is an attribute, and in to_dict()
        return f"{type(self).__name__}({self._figures()})"

    def _figures(self) -> str:
        """One line: what, where, bytes, ratio, seconds, GB/s and the I/O path."""
        return (f"{self.op} {self.path!r}: {format_bytes(self.logical_bytes)} -> {format_bytes(self.stored_bytes)} "
                f"stored (ratio {self.ratio:.2f}), {self.seconds:.3f} s, {self.gbps:.3g} GB/s, "
                f"{self.backend} backend, io {self.io_path}")


@dataclass(repr=False)  # Stats' one line, and the caller's stall
class AsyncStats(Stats):
    """A save_async's Stats. The caller's stall is `blocked_s` (+ `hook_wait_s` in overlap mode)."""

    mode: str = "host"  # "host", "overlap" or "device": the save.Snapshot it took
    blocked_s: float = 0.0  # inside save_async: the snapshot (host), the copies (device), the buffer copies (overlap)
    hook_wait_s: float = 0.0  # overlap: how long optimizer.step() waited for the snapshot
    snapshot_s: float = 0.0  # the ring and the copies into the pool (host, overlap)
    queued_s: float = 0.0  # the file's write waited this long for earlier files
    background_s: float = 0.0  # the writer on this file, its turn to the commit (device: the whole save)
    write_s: float = 0.0  # of which in pwritev of chunk records
    fsync_s: float = 0.0
    commit_s: float = 0.0
    direct_io: bool = False
    pool_bytes: int = 0  # host memory the pool holds (pinned on the GPU), after this snapshot
    pool_peak_bytes: int = 0  # of which in use at most during this snapshot
    pool_limit_bytes: int = 0
    pool_waits: int = 0  # chunk copies that waited for the writer to free room (back-pressure)
    pool_wait_s: float = 0.0
    pool_alloc_s: float = 0.0  # growing the pool (the first saves)
    device_copy_bytes: int = 0  # a device-mode save, or one that found its pool empty: the state's copy on its GPU (a SaveCall's copied or copy_first)

    def _figures(self) -> str:
        stall = f"blocked {self.blocked_s:.3f} s" + (f" + {self.hook_wait_s:.3f} s in step()" if self.hook_wait_s else "")
        return f"{super()._figures()}; {self.mode} mode, {stall}"


def stream_stats(plan, records) -> list[dict]:
    """Per stream of `plan` (a plan.Plan), with its chunk records: dtype, codec, logical and
    stored bytes, raw chunks, tensors and ratio (Stats.streams; `gdsckpt inspect`)."""
    out = [{"dtype": s.dtype, "codec": s.codec["name"], "logical_bytes": s.nbytes, "stored_bytes": 0,
            "raw_chunks": 0, "tensors": len(s.tensors)} for s in plan.streams]
    for c, r in zip(plan.chunks, records):
        out[c.stream]["stored_bytes"] += r.stored
        out[c.stream]["raw_chunks"] += r.raw
    for s in out:
        s["ratio"] = s["stored_bytes"] / s["logical_bytes"] if s["logical_bytes"] else 1.0
    return out
