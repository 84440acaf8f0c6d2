"""Tuned defaults: one home for every number chosen by measurement, with its reason and the result
folder that measured it. Limits of the file format live in format.py; these are only choices.

Results: bench/results/ (H100 80GB HBM3 host, KvikIO compat mode, virtio ext4, 2026-11-22).
"""

from __future__ import annotations

# Chunk size per backend. One nvCOMP call costs a fixed ~0.1 ms, so gather+compress reached
# 107-111 GB/s at 128 MiB and 151-165 GB/s at 256 MiB; the disk was the limit at every size
# (2026-11-22-h100-b/). The CPU cuts 16 MiB: zstd's ratio stops improving there, and a small
# chunk keeps the CPU ring's memory low.
CHUNK_BYTES = {"gpu": 256 << 20, "cpu": 16 << 20}

# Ring slots. Two let compression of chunk i+1 overlap the write of chunk i; a third gained
# nothing measurable, the disk being the limit (2026-11-22-h100-b/). Two slots of 256 MiB cost
# 835 MiB of GPU memory: one staging buffer + nvCOMP's worst-case output per slot.
RING_DEPTH = 2

# KvikIO: 4 threads, O_DIRECT. Best cold restore (2.9 GB/s logical) and a save within the
# sweep's noise of the best (2026-11-22-h100-b/kvikio-sweep.json); over 8 saves interleaved with
# the disk probe the steadiest, 81-99% of the disk's bound, where 8 threads x 16 MiB tasks
# averaged a few points higher but swung between 56% and 126% (2026-11-22-h100-k/save-paths-8rounds.json).
KVIKIO_THREADS = 4
KVIKIO_DIRECT_IO = True

# The CPU backend's pwrite/pread workers: enough to overlap one write with the next compression.
CPU_IO_THREADS = 2

# zstd frames. The GPU cuts small frames for parallelism (nvCOMP's RAW zstd takes one frame
# per batch entry, 16 MiB at most); the CPU cuts large ones for ratio.
ZSTD_FRAME_BYTES = {"cpu": 16 << 20, "gpu": 1 << 20}
ZSTD_LEVEL = 3

# nvCOMP ANS splits each chunk into pieces of this size, each with its own frequency table.
# 512 KiB instead of nvCOMP's 64 KiB saved 33.5% instead of 31.4% of bf16 weights and 14.1%
# instead of 12.1% of fp32 state, at the same speed (2026-11-22-h100-e/ans-options.json).
ANS_INTERNAL_CHUNK = 512 << 10

# Host tensors up to this size (AdamW's `step` counters) are packed and uploaded to the GPU
# together, once per save, instead of one copy per segment.
SMALL_HOST_TENSOR = 1 << 20
