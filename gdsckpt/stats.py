"""What one save or restore did: `Stats`, which every save and read returns (and `Checkpoint`
keeps as `last_stats`), and the per-stream figures a save reports and `Checkpoint.streams` shows."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Stats:
    """What one save or restore did. `io_path` is the path the bytes really took: gds, compat or cpu."""

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


def stream_stats(plan, records) -> list[dict]:
    """Per stream of `plan` (one per dtype): its codec, logical and stored bytes, raw chunks, ratio."""
    out = [{"dtype": s.dtype, "codec": s.codec["name"], "logical_bytes": s.nbytes, "stored_bytes": 0,
            "raw_chunks": 0, "tensors": len(s.tensors)} for s in plan.streams]
    for c, r in zip(plan.chunks, records):
        out[c.stream]["stored_bytes"] += r.stored
        out[c.stream]["raw_chunks"] += r.raw
    for s in out:
        s["ratio"] = s["stored_bytes"] / s["logical_bytes"] if s["logical_bytes"] else 1.0
    return out
