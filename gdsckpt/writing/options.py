"""A save's options (`SaveOptions`) and snapshot modes (`Snapshot`), checked where they enter:
a ValueError naming the option before the state is walked or anything written. Public through
gdsckpt.options."""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields

from gdsckpt import codecs
from gdsckpt.core.defaults import CHUNK_BYTES, RING_DEPTH
from gdsckpt.core.dtypes import BY_NAME
from gdsckpt.engine.backend import check_io, choose
from gdsckpt.format import file as fmt


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_codec(codec) -> None:
    """codec: "auto", a codec name, or {dtype name: "auto" or a codec name}; else a ValueError,
    before anything is written (a typo must not fall back to a default silently)."""
    names = ("auto",) + codecs.ALL_CODECS
    if isinstance(codec, str):
        if codec not in names:
            raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(names)}, or a dict of dtype name to one")
        return
    if not isinstance(codec, dict):
        raise ValueError(f"codec must be one of {', '.join(names)} or a dict of dtype name to one, not {codec!r}")
    for dtype, name in codec.items():
        if dtype not in BY_NAME:
            raise ValueError(f"codec: {dtype!r} is not a dtype name gdsckpt stores ({', '.join(BY_NAME)})")
        if name not in names:
            raise ValueError(f"codec for {dtype}: unknown codec {name!r}; choose one of {', '.join(names)}")


def _check_chunk_bytes(chunk_bytes) -> None:
    if not is_int(chunk_bytes) or chunk_bytes <= 0 or chunk_bytes % fmt.ALIGN or chunk_bytes > fmt.MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be a positive multiple of {fmt.ALIGN} of at most {fmt.MAX_CHUNK_BYTES} "
                         f"(a reader refuses larger chunks), got {chunk_bytes!r}")


@dataclass(frozen=True)
class SaveOptions:
    """How a save runs, checked on construction (a ValueError names the bad option before the
    state is walked or anything written), so that a SaveOptions in hand is valid.

    codec: "auto" (on the GPU typed ANS, or byte-plane ANS for a float stream where a sample of it
    stores smaller so; on the CPU byte-shuffled zstd, or raw on a host of few cores:
    codecs.cpu_auto_compresses), "ans", "ans-planes", "bitcomp", "zstd", "raw",
    or {dtype name: codec}. chunk_bytes: None (or 0) for the backend's default (defaults.CHUNK_BYTES).
    io: "auto", "gds" (fail if unavailable) or "compat" (GPU backend). backend: None/"auto"
    (the GPU where a tensor is on one and the GPU stack is usable), "cpu" or "gpu"."""

    codec: str | dict = "auto"
    chunk_bytes: int | None = None
    ring_depth: int = RING_DEPTH
    io: str = "auto"
    io_threads: int | None = None
    backend: str | None = None

    def __post_init__(self):
        check_codec(self.codec)
        check_io(self.io, self.io_threads)
        if isinstance(self.codec, dict):  # a copy: a dict changed after the check is not this one
            object.__setattr__(self, "codec", dict(self.codec))
        if not self.chunk_bytes:
            object.__setattr__(self, "chunk_bytes", None)
        else:
            _check_chunk_bytes(self.chunk_bytes)
        if not is_int(self.ring_depth) or self.ring_depth < 2:
            raise ValueError(f"ring_depth must be at least 2 so that compression overlaps I/O, got {self.ring_depth!r}")
        choose(False, self.backend)  # an unknown backend name is a ValueError (probes nothing)

    def chunk_bytes_for(self, kind: str) -> int:
        """The chunk size a save on backend `kind` ("cpu" or "gpu") cuts."""
        return self.chunk_bytes or CHUNK_BYTES[kind]


class Snapshot(str, enum.Enum):
    """Where a save that must not stop training takes its snapshot, before the caller may change
    the state again: save_async(snapshot=) and GdsckptWriter(snapshot=) take these names, the
    built-in modes of writing/snapshot/modes.py (which looks each up by name, and takes others registered).

    HOST: the save ring compresses the live tensors into the host pool during the call (no copy
        of the state; the caller waits for the compression, not for the disk).
    OVERLAP: the same, on a background thread during the next forward/backward; needs optimizer=,
        whose next step() waits for it (async_save.py states the contract).
    DEVICE: a full copy of the state on each tensor's own device, then an ordinary save.
    CPU: a copy in host memory, as torch.distributed.checkpoint's DefaultStager makes it
        (GdsckptWriter only)."""

    HOST = "host"
    OVERLAP = "overlap"
    DEVICE = "device"
    CPU = "cpu"

    @classmethod
    def parse(cls, value, allowed: tuple, keyword: str = "snapshot") -> Snapshot | str:
        """`value` where it is one of `allowed` (members, or names of registered snapshot modes):
        the member of that name, or the name of a mode registered beyond them."""
        names = [str(getattr(m, "value", m)) for m in allowed]
        if isinstance(value, str) and value in names:
            return cls(value) if value in cls._value2member_map_ else str(value)
        raise ValueError(f"{keyword} must be one of {', '.join(map(repr, names))}, not {value!r}")


def check_save_options(options: dict, extra=(), modes: tuple = ()) -> None:
    """Save options given once for saves to come (a Checkpointer's, an integration's), checked
    before the first of them: each name a SaveOptions field or one of `extra`, the values valid
    (SaveOptions' own ValueErrors), and snapshot= one of `modes`. A ValueError naming the option."""
    names = {f.name for f in fields(SaveOptions)}
    unknown = sorted(set(options) - names - set(extra))
    if unknown:
        raise ValueError(f"{', '.join(map(repr, unknown))} is not a save option here; these are "
                         f"{', '.join(sorted(names | set(extra)))}")
    SaveOptions(**{k: v for k, v in options.items() if k in names})
    if "snapshot" in options:
        Snapshot.parse(options["snapshot"], modes)
