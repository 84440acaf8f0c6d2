"""What a checkpoint is, on disk and in memory: the file layout (`file`, its contract FORMAT.md
beside it), the state tree and its skeleton (`tree`, `stateful`), the plan that cuts tensors into
dtype streams and chunks (`plan`) and the chunk checksums (`checksum`).

May import: `core`, `codecs` (the codec specs a chunk record names), `errors`."""
