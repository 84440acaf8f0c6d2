"""The Checkpointer's options, grouped by tier: frozen dataclasses, each checked on construction
(a ValueError or TypeError naming the field), public through gdsckpt.options.

    Checkpointer(directory, local=LocalOptions(keep=LatestN(3) | KeepEvery(1000)),
                 memory=MemoryOptions(keep=2, every_local=10),
                 remote=RemoteOptions("s3://bucket/run7", keep=10, every=5))
    Checkpointer(directory, options=CheckpointerOptions(local=..., memory=..., remote=...))

The flat keywords (keep=, keep_memory=, every_local=, memory_bytes=, keep_remote=,
every_remote=, remote_options=, upload=, ...) are shorthand for the same fields:
`checkpointer_options` turns a Checkpointer's arguments into one CheckpointerOptions, refusing a
setting given twice (as a keyword and inside its group).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gdsckpt.core.defaults import MEMORY_KEEP
from .policy import Policy, RetentionPolicy, retention, whole_number

__all__ = ["LocalOptions", "MemoryOptions", "RemoteOptions", "CheckpointerOptions", "checkpointer_options", "UNSET"]


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()  # a flat keyword not given (a default would not tell "not given" from "given as the default")


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def _dict(name: str, value) -> dict | None:
    if value is not None and not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict of keyword arguments or None, got {type(value).__name__} {value!r}")
    return dict(value) if value is not None else None  # a copy: a dict changed later is not this one


@dataclass(frozen=True)
class LocalOptions:
    """The directory's steps. keep: the newest n steps (an int >= 1), or a RetentionPolicy."""

    keep: int | RetentionPolicy = 3

    def __post_init__(self):
        object.__setattr__(self, "keep", retention("LocalOptions.keep", self.keep))


@dataclass(frozen=True)
class MemoryOptions:
    """The memory tier (every saved step in shared memory on this host). keep: the copies kept (an
    int >= 1, or a RetentionPolicy: the tier holds no more copies than it keeps); every_local:
    write every n-th saved step (the 1st, 1 + n, ...) to the directory; cap_bytes: the tier's cap
    (None: defaults.MEMORY_*). Under torch.distributed, replicas: each step's copy also held in the
    memory of that many ranks on other nodes (docs/replicas.md); node: this rank's node (None:
    torchrun's, else the host, with its memory root); placement: {rank: [holder ranks]} in place of
    the ring over nodes."""

    keep: int | RetentionPolicy = MEMORY_KEEP
    every_local: int = 1
    cap_bytes: int | None = None
    replicas: int = 0
    node: object = None
    placement: dict | None = None

    def __post_init__(self):
        object.__setattr__(self, "keep", retention("MemoryOptions.keep", self.keep, ""))
        object.__setattr__(self, "every_local", whole_number("MemoryOptions.every_local", self.every_local, 1))
        if self.cap_bytes is not None:
            object.__setattr__(self, "cap_bytes", whole_number("MemoryOptions.cap_bytes", self.cap_bytes, 1))
        object.__setattr__(self, "replicas", whole_number("MemoryOptions.replicas", self.replicas, 0))


@dataclass(frozen=True)
class RemoteOptions:
    """The object-store tier. url: "s3://bucket/prefix"; keep: the uploaded steps kept (an int >= 1,
    a RetentionPolicy, or None: all); every: upload the 1st, (1 + every)th, ... saved step;
    store_options: keyword arguments of gdsckpt.stores.open_store (part_bytes, concurrency,
    timeout, max_retries); upload=False: no uploader thread (the CLI's prune)."""

    url: str
    keep: int | RetentionPolicy | None = None
    every: int = 1
    store_options: dict | None = None
    upload: bool = True

    def __post_init__(self):
        if not isinstance(self.url, str):
            raise TypeError(f"RemoteOptions.url must be a string such as 's3://bucket/prefix', "
                            f"got {type(self.url).__name__} {self.url!r}")
        if self.keep is not None:
            object.__setattr__(self, "keep", retention("RemoteOptions.keep", self.keep, "or None: all"))
        object.__setattr__(self, "every", whole_number("RemoteOptions.every", self.every, 1))
        object.__setattr__(self, "store_options", _dict("RemoteOptions.store_options", self.store_options))
        _flag("RemoteOptions.upload", self.upload)


@dataclass(frozen=True)
class CheckpointerOptions:
    """Everything a Checkpointer is opened with. memory / remote: None for no such tier.
    save_options: keyword arguments of gdsckpt.save (snapshot= for save_async), or of
    GdsckptWriter under torch.distributed. distributed: None = whether torch.distributed is
    initialized. read_only: open the directory as one this process cannot write."""

    local: LocalOptions = field(default_factory=LocalOptions)
    memory: MemoryOptions | None = None
    remote: RemoteOptions | None = None
    save_options: dict | None = None
    distributed: bool | None = None
    read_only: bool = False

    def __post_init__(self):
        for name, kind, optional in (("local", LocalOptions, False), ("memory", MemoryOptions, True),
                                     ("remote", RemoteOptions, True)):
            value = getattr(self, name)
            if not (isinstance(value, kind) or (optional and value is None)):
                raise TypeError(f"CheckpointerOptions.{name} must be a {kind.__name__}"
                                + (" or None" if optional else "") + f", got {type(value).__name__} {value!r}")
        object.__setattr__(self, "save_options", _dict("CheckpointerOptions.save_options", self.save_options))
        if self.distributed is not None:
            _flag("CheckpointerOptions.distributed", self.distributed)
        _flag("CheckpointerOptions.read_only", self.read_only)

    def policy(self) -> Policy:
        """Local and remote retention and the upload interval, as the manager applies them."""
        r = self.remote
        return Policy(keep=self.local.keep, keep_remote=r.keep if r else None, every_remote=r.every if r else 1)


def _once(group: str, given: dict) -> None:
    twice = [k for k, v in given.items() if v is not UNSET]
    if twice:
        raise ValueError(f"{', '.join(k + '=' for k in twice)} given beside {group}: set it in {group} or as a "
                         "keyword, not both")


def _or(value, default):
    return default if value is UNSET else value


def checkpointer_options(options: CheckpointerOptions | None, *, local, memory, remote, **flat) -> CheckpointerOptions:
    """A Checkpointer's arguments as one CheckpointerOptions: `options` alone, or the groups
    (local=, memory=MemoryOptions or a bool, remote=RemoteOptions or a URL) with the flat keywords
    (UNSET where not given) filling in what no group holds. Checked in the order the keywords
    have always been (keep, keep_remote, every_remote, every_local, keep_memory, memory_bytes)."""
    if options is not None:
        if not isinstance(options, CheckpointerOptions):
            raise TypeError(f"options must be a CheckpointerOptions, got {type(options).__name__} {options!r}")
        _once("options=", {"local": UNSET if local is None else local, "memory": UNSET if memory is False else memory,
                           "remote": UNSET if remote is None else remote, **flat})
        return options
    # the flat keywords, checked by their own names whatever the groups hold
    Policy(keep=_or(flat["keep"], 3), keep_remote=_or(flat["keep_remote"], None),
           every_remote=_or(flat["every_remote"], 1))
    every_local = whole_number("every_local", _or(flat["every_local"], 1), 1)
    keep_memory = retention("keep_memory", _or(flat["keep_memory"], MEMORY_KEEP), "")
    memory_bytes = _or(flat["memory_bytes"], None)
    if memory_bytes is not None:
        memory_bytes = whole_number("memory_bytes", memory_bytes, 1)

    if local is None:
        local = LocalOptions(keep=_or(flat["keep"], 3))
    elif not isinstance(local, LocalOptions):
        raise TypeError(f"local must be a LocalOptions, got {type(local).__name__} {local!r}")
    else:
        _once("local=LocalOptions(...)", {"keep": flat["keep"]})

    memory_keywords = {k: flat[k] for k in ("every_local", "memory_bytes", "keep_memory", "replicas", "node",
                                            "placement")}
    if isinstance(memory, MemoryOptions):
        _once("memory=MemoryOptions(...)", memory_keywords)
    elif memory:
        memory = MemoryOptions(keep=keep_memory, every_local=every_local, cap_bytes=memory_bytes,
                               replicas=_or(flat["replicas"], 0), node=_or(flat["node"], None),
                               placement=_or(flat["placement"], None))
    else:
        if every_local != 1 or memory_bytes is not None or _or(flat["replicas"], 0):
            raise ValueError("every_local=, memory_bytes= and replicas= configure the memory tier: pass memory=True")
        memory = None

    remote_keywords = {k: flat[k] for k in ("keep_remote", "every_remote", "remote_options", "upload")}
    if isinstance(remote, RemoteOptions):
        _once("remote=RemoteOptions(...)", remote_keywords)
    elif remote is not None:
        remote = RemoteOptions(remote, keep=_or(flat["keep_remote"], None), every=_or(flat["every_remote"], 1),
                               store_options=_or(flat["remote_options"], None), upload=_or(flat["upload"], True))
    return CheckpointerOptions(local=local, memory=memory, remote=remote, save_options=_or(flat["save_options"], None),
                               distributed=_or(flat["distributed"], None), read_only=_or(flat["read_only"], False))
