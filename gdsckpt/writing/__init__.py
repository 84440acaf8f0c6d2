"""Saving: one file through the ring (`save`: options, the pipeline, the commit), in the
background (`async_save`: a snapshot, then the write on another thread; `background_writer`),
host memory ahead of the first save (`reserve`), and the snapshot modes (`snapshot/`).

May import: `core`, `codecs`, `format`, `engine`, `errors`, `stats`; and the memory tier's slot
size (`manager.memory.snapshot.slot_bytes`, for `reserve`: the one arrow back up)."""
