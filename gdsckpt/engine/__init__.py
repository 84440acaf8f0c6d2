"""The engine: the ring that moves chunks through gather, codec and I/O (`ring`, its interfaces
`Backend` and `ChunkFile`), the backends that run it (`cpu_backend`; `gpu/`, the only package
that imports cupy, kvikio and nvidia.nvcomp; `backend` chooses), device and pinned host memory
(`device_copy`, `pinned_pool`), reads ahead of the ring (`read_ahead`) and the codec chosen per
stream (`codec_choice`).

May import: `core`, `codecs`, `format`, `errors`, `stats`."""
