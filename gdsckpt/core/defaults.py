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

# The pipeline's CUDA stream runs at the device's highest priority (torch maps any lower number to
# it). Alone on the GPU it changes nothing; beside training (an overlapped snapshot) the ring's
# kernels at the default priority waited behind the training kernels for SMs, up to 5-8 ms per
# chunk, while the copy engine idled and the optimizer step waited for the snapshot
# (bench/results/2026-11-24-h100-priority/).
PIPELINE_STREAM_PRIORITY = -(1 << 20)

# KvikIO: 4 threads, O_DIRECT. Best cold restore (2.9 GB/s logical) and a save within the
# sweep's noise of the best (2026-11-22-h100-b/kvikio-sweep.json); over 8 saves interleaved with
# the disk probe the steadiest, 81-99% of the disk's bound, where 8 threads x 16 MiB tasks
# averaged a few points higher but swung between 56% and 126% (2026-11-22-h100-k/save-paths-8rounds.json).
KVIKIO_THREADS = 4
KVIKIO_DIRECT_IO = True

# KvikIO's task and bounce buffer when reading a checkpoint file (KvikIO's own: 4 MiB tasks, 16
# MiB buffers). In compat mode each thread reads one task into its bounce buffer, copies it to the
# GPU and only then reads on, so the task size is what the disk is asked for at once. Cold 20 GB
# restores (16.4 GB stored) read 1.47 GB/s with 64 MiB against 1.29 with KvikIO's defaults, over
# 18 loops on three machines with the order turned (16 faster); 32 MiB gained half as much, 128
# MiB or 8 threads nothing more (2026-11-24-h100-read-tasks/). Costs 4 x 64 MiB of pinned bounce
# buffers, which KvikIO's pool keeps until a save asks for its own size. Writes keep KvikIO's
# defaults: the durable save already ran above the O_DIRECT write probe (2026-11-24-h100-disk20/).
# A memory-tier copy too: its "disk" is RAM, which more, smaller tasks read in parallel.
KVIKIO_READ_TASK_BYTES = 64 << 20

# A checkpoint file read into a GPU in KvikIO's compat mode (no GPUDirect Storage) is read ahead of
# the ring by our own threads (gdsckpt/engine/read_ahead.py): this many O_DIRECT reads of this many bytes
# in flight at all times, into a window of page-locked host memory (the widest record's blocks +
# one block per thread: ~10 x 64 MiB, from torch's caching host allocator, which keeps it for the
# next read), each record then copied into its GPU slot. Cold 20 GB restores (atomic=False): 0.99x
# an 8-thread O_DIRECT read of the file, 1.03x KvikIO's reads over 13 loops on four machines
# (+10% on the slowest disk, none on an H200's faster one at 40 GB); 8 threads slower than 4; a pageable window no faster than KvikIO,
# its copies ~6 GB/s in the ring's thread where pinned ones run at ~50 GB/s. atomic=True asks
# for every record at once, which fills KvikIO's queue too: no gain there, no loss
# (bench/results/2026-11-25-h100-read-ahead/).
# 0 threads: KvikIO reads each record when the ring asks for it, as on a GDS host.
READ_AHEAD_THREADS = 4
READ_AHEAD_BLOCK_BYTES = 64 << 20
READ_AHEAD_PINNED = True

# The CPU backend's pwrite/pread workers: enough to overlap one write with the next compression.
CPU_IO_THREADS = 2

# codec="auto" on the CPU: zstd from this level over byte-shuffled chunks (FORMAT.md, "shuffle").
# Shuffled, fp32 planes 0-2 do not compress at all and the sign/exponent plane to 0.30-0.35, so
# a 350 MB AdamW state stores 81.3% (zstd level 3 on whole words: 90.3%, 2-5x slower); levels
# above 1 cost time for no gain on byte planes (2026-11-23-cpu-compare/README.md).
CPU_AUTO_LEVEL = 1

# ...on hosts with at least this many cores the save may use; on fewer, codec="auto" on the CPU
# stores raw. On the 2-core VM, shared with other processes, compressing a 64 MB AdamW state
# (18.7% saved) made the save slower than torch.save + fsync, raw faster: the shuffle and zstd
# compete for the cores with the writes and the page cache's writeback (docs/cpu-codec.md).
CPU_AUTO_COMPRESS_MIN_CORES = 4

# zstd's match finder for shuffled chunks, on top of the spec's level: an 8-bit hash table,
# 7-byte minimum matches, a 128 KiB window. Byte planes of floats are mostly literals (Huffman
# coded); a small match finder compressed them 1.0-1.4 GB/s instead of level 1's 0.65, for 0.3%
# more bytes, and they decode at 3.3-3.7 GB/s instead of 1.2 (2026-11-23-cpu-compare/).
ZSTD_SHUFFLED_PARAMS = {"hash_log": 8, "chain_log": 8, "min_match": 7, "window_log": 17, "strategy": 1}

# Cores that shuffle and compress (or decompress) one CPU chunk: the pool of CpuCodecs and the
# zstd workers of a large frame. On the 2-core test VM, 2 against 1: the whole state's encode
# alone 0.22-0.27 s against 0.35-0.48; in full saves no difference while other processes held
# the second core (2026-11-23-cpu-compare/variants.txt, threads-writeback.json).
CPU_CODEC_THREADS = 2

# A zstd frame on the CPU whose four 4 KiB samples save less than this fraction is written as
# raw blocks, with a copy instead of a compressor run: in a shuffled fp32 chunk, the three
# mantissa planes. Compressing every frame instead: save median 0.68 s vs 0.62 in the same rounds,
# for the same size (2026-11-23-cpu-compare/variants.txt).
CPU_MIN_SAVING = 0.05

# Start each buffered chunk write's write-back at once (sync_file_range), not in the final fsync:
# save median 0.56 s against 0.66 s (2026-11-23-cpu-compare/threads-writeback.json, buffered writes).
CPU_WRITEBACK = True

# Write the CPU ring's slots with O_DIRECT (buffered where the file system refuses it): no copy
# into the page cache, nothing left for the fsync. Save median 0.48 s against 0.58 s buffered,
# torch.save 0.44 s in the same rounds (2026-11-23-cpu-compare/direct-vs-buffered.json).
CPU_DIRECT_IO = True

# zstd frames. The GPU cuts small frames for parallelism (nvCOMP's RAW zstd takes one frame
# per batch entry, 16 MiB at most). The CPU cuts 4 MiB: a 16 MiB chunk of fp32, shuffled, is then
# one frame per byte plane, so the three mantissa planes are stored as raw blocks and only the
# exponent plane is compressed; 4 frames also decode in parallel (2026-11-23-cpu-compare/).
ZSTD_FRAME_BYTES = {"cpu": 4 << 20, "gpu": 1 << 20}
ZSTD_LEVEL = 3

# nvCOMP ANS splits each chunk into pieces of this size, each with its own frequency table.
# 512 KiB instead of nvCOMP's 64 KiB saved 33.5% instead of 31.4% of bf16 weights and 14.1%
# instead of 12.1% of fp32 state, at the same speed (2026-11-22-h100-e/ans-options.json).
ANS_INTERNAL_CHUNK = 512 << 10

# Host tensors up to this size (AdamW's `step` counters) are packed and uploaded to the GPU
# together, once per save, instead of one copy per segment.
SMALL_HOST_TENSOR = 1 << 20

# save_async's host pool (gdsckpt/engine/pinned_pool.py), where compressed chunks wait for the disk.
# Its bound, unless pool_bytes= is given: the most the save can store, its chunks' logical
# lengths each rounded up to 4 KiB as the pool holds them (a chunk that would not shrink is
# stored raw), so one save never waits for the disk; a save_async while an earlier one is
# still writing waits (back-pressure, reported as blocked time) only for the bytes that one
# has not written yet. The pool grows as stored bytes arrive, so what it holds is the stored
# size (1.006x on the H100 for 3.60 GB stored of 4.37 GB: 2026-11-23-h100-async/), not the bound.
POOL_STATE_FRACTION = 1.0
# ... and never more than this share of the host's memory: pinned pages cannot be swapped or
# reclaimed, and a host that runs out of them fails in ways far from the cause.
POOL_HOST_FRACTION = 0.5
# The pool grows by arenas of this size: a power of two, which torch's pinned allocator rounds
# every request up to, so nothing is lost to rounding; small enough that the pool ends at most
# one arena (1.5% of a 4.3 GB state) above what a save needed.
POOL_ARENA_BYTES = 64 << 20
# A save_async (or GdsckptWriter's compressed staging) that finds its GPU's pool empty (the
# process's first, or the first after release_pools) and has no reservation growing it copies
# the state on the GPU first (device_copy.copy_first), when the copy fits in this share of the
# device's free memory (cudaMemGetInfo: memory no allocator of the process holds), and takes the
# host snapshot from the copy on a background thread, growing the pool there. Page-locking ~5 GB
# inside the call blocked a first save 2.1-2.2 s beyond a steady one; the copy, 0.07-0.13 s
# (H100, 2026-11-24-h100-first-copy/). The copy comes from CUDA's stream-ordered allocator, not
# torch's cache, and goes back to the device once the snapshot has ended. 0 turns the copy off
# (the first save then grows the pool in its call).
FIRST_SAVE_COPY_FREE_FRACTION = 0.5
# The background writer opens the file with O_DIRECT (falls back to buffered writes where the
# file system refuses it): pinned bytes go to the disk without a page-cache copy, so the
# writer neither spends memory bandwidth next to a training step nor leaves gigabytes of dirty
# pages for the fsync to flush at once. KvikIO's O_DIRECT writes were the steadiest on the
# H100 host's disk (KVIKIO_DIRECT_IO above).
POOL_DIRECT_IO = True

# A temporary untouched this long (its mtime) is stale whoever wrote it (`storage.stale_temporaries`,
# `gdsckpt clean`): the rule for another host's, whose pid cannot be checked here, and for those of
# an earlier gdsckpt that named no host. A writer touches its file with every chunk it writes, so a
# live save never comes near it; generous, because the cost of waiting is only disk space.
TEMP_STALE_AGE_S = 24 * 3600

# The memory tier (gdsckpt/manager/memory/tier.py: Checkpointer(memory=True)). Its default cap: a quarter
# of the host's memory, shared by the host's ranks, and at most 80% of the shared-memory file
# system (a container's /dev/shm may be far smaller than the host). Not measured: chosen so that
# two copies of a state as large as the GPU's memory fit on a usual 8-GPU host (2 TB of memory,
# 8 x 80 GB GPUs: 500 GB / 8 = 62 GB per rank) while most of the host stays for the data loaders.
MEMORY_HOST_FRACTION = 0.25
MEMORY_SHM_FRACTION = 0.8
# Copies kept where the drop order allows: the newest, and one to fall back to if it is damaged.
MEMORY_KEEP = 2

# codec="auto" on the GPU chooses typed or byte-plane ANS per float stream from a sample
# (gdsckpt/engine/codec_choice.py): this many pieces spread evenly over the stream, each compressed as a
# chunk of its own. A piece of 4 x ANS_INTERNAL_CHUNK holds one 512 KiB ANS piece per fp32 byte
# plane, as a full chunk does, so both codecs see the statistics they would see in the save. A
# training state's fp32 stream is a third each of master weights, exp_avg and exp_avg_sq, which
# gain differently from byte planes: 8 evenly spread pieces land in each part 2-3 times. Streams
# shorter than one piece keep typed ANS unsampled. Not measured: 16 MiB per fp32 stream, compressed
# once per state layout (choices are cached per layout: CODEC_CHOICE_CACHE layouts).
CODEC_SAMPLE_PIECES = 8
CODEC_SAMPLE_PIECE_BYTES = 4 * ANS_INTERNAL_CHUNK
CODEC_CHOICE_CACHE = 64

# Plans kept by layout (plan.PLANS), for saves of a state seen before: one per layout a process
# saves in turn (a model's and its EMA's, each rank's shards); a plan is a few hundred KB.
PLAN_CACHE = 8
# A restore that checks every chunk before it writes a byte (load_into(atomic=True), every
# Checkpointer restore into a state) reads each stored byte once, into device memory, where the
# stored bytes of the chunks it reads fit in this share of the GPU's free memory (then freed):
# checked there by the GPU's kernel, decoded from there. Beyond it, twice through the ring (a
# checking pass, then the decoding one): an H100 restore of 4.13 GB stored spent 0.93 s in the
# first pass and ~0.6 s in the second (2026-11-24-h100-memory/). Half: the state's own tensors
# and the training's first steps need the rest. The buffer comes from cudaMalloc and goes back to
# the device at the end of the restore, not into torch's cache (gpu/device_block.py).
READ_ONCE_GPU_FRACTION = 0.5
# KvikIO threads that read a memory-tier copy (a /dev/shm file) into device memory: each preads
# into its pinned bounce buffer (a copy out of the page cache, one core's memory bandwidth) and
# copies that to the GPU. More than the disk's KVIKIO_THREADS, as the "disk" is memory. Not yet
# measured: bench/probes/memory_restore.py sweeps 4, 8 and 16.
MEMORY_READ_THREADS = 8
# Threads that check a memory copy's chunks (CRC-64/NVME, zstd frame headers) on the CPU
# backend, at most one per core: awscrt lets go of the GIL, and ran 10 GB/s on one thread, 36 on
# 4, 61 on 8 on the H100 host's 16-core Xeon (2026-11-24 probe).
CPU_VERIFY_THREADS = 8

# Peer replicas (gdsckpt/manager/replicas/wire.py). A transfer to or from a peer waits at most
# REPLICA_TIMEOUT_S + its bytes / REPLICA_MIN_BYTES_PER_S for each of its messages (a hung peer:
# the step is not replicated, and the channel to that peer is closed for the run, as gloo closes
# a pair whose wait timed out); the image goes in pieces of REPLICA_PIECE_BYTES (on a GPU host,
# the device staging buffer's size).
REPLICA_TIMEOUT_S = 30.0
REPLICA_MIN_BYTES_PER_S = 200 << 20
REPLICA_PIECE_BYTES = 64 << 20
