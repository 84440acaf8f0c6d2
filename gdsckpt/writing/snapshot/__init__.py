"""Snapshot modes: how save_async copies the state before the caller may go on (into pinned host
memory, `host`; during the next forward/backward, `overlap`).

May import: `core`, `format`, `engine`, `writing.save` and `writing.background_writer`."""
