"""The ground floor: tunables (`defaults`), byte units, dtype names, durable file writes and
commits (`storage`), the per-directory lock (`dirlock`) and the garbage collector's pause
(`collector`). Imports nothing of gdsckpt but `gdsckpt.errors`."""
