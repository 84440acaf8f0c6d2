"""The options, public: what gdsckpt.save, save_async, GdsckptWriter, the Checkpointer and the
integrations take, each checked where it enters (a ValueError naming the option before the state
is walked or anything written).

    from gdsckpt.options import SaveOptions, Snapshot, check_save_options
    opts = SaveOptions(codec="zstd", chunk_bytes=64 << 20)
    check_save_options({"codec": "zstd", "snapshot": "device"}, {"snapshot"}, (Snapshot.DEVICE,))

A save's (gdsckpt/writing/options.py): `SaveOptions`, `Snapshot`, `check_save_options`,
`check_codec`. The Checkpointer's, grouped by tier (gdsckpt/manager/options.py):
`CheckpointerOptions`, `LocalOptions`, `MemoryOptions`, `RemoteOptions`; and its retention
policies (gdsckpt/manager/policy.py): `RetentionPolicy`, `LatestN`, `KeepEvery`, `AnyOf`.
"""

from .manager.options import CheckpointerOptions, LocalOptions, MemoryOptions, RemoteOptions
from .manager.policy import AnyOf, KeepEvery, LatestN, RetentionPolicy
from .writing.options import SaveOptions, Snapshot, check_codec, check_save_options, is_int

__all__ = ["SaveOptions", "Snapshot", "check_save_options", "check_codec", "is_int", "CheckpointerOptions",
           "LocalOptions", "MemoryOptions", "RemoteOptions", "RetentionPolicy", "LatestN", "KeepEvery", "AnyOf"]
