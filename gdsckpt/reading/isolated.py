"""Files you did not write (`trusted=False`): no chunk reaches a GPU decoder in this process.

Why: a checksum catches damage, not a forger. A chunk crafted to carry a valid checksum still
reaches nvCOMP, and NVIDIA documents that its Bitcomp, Cascaded, GDeflate and Zstd decoders need
valid input and that ANS only sometimes detects bad input; on the H100, Bitcomp and ANS given
forged chunks faulted the CUDA context (illegal address), which takes the whole training process
down with it. Here such a chunk can only take down a child.

Why the child decodes for the parent, rather than only vetting chunks the parent then decodes:
whether a decoder that reads out of bounds faults depends on what memory lies beyond its buffers.
On the H100 a forged ANS chunk that the child decoded without a fault still faulted the parent,
whose memory is laid out differently (bench/results/2026-11-23-h100-integrity/). So under
trusted=False the parent never runs nvCOMP on the file's chunks at all.

How: `run` starts `python -m gdsckpt.reading.isolated` (a fresh interpreter: never fork, which CUDA does not
survive, and not multiprocessing's spawn, which re-runs the caller's unguarded `__main__` code in
the child), hands it the file (its open descriptor: the very inode the parent opened, from which
the child reads the index again, after checking it is the same file) and the chunk ids on stdin,
and reads one line per event from a private pipe. The child reads each chunk, checks its checksum,
decodes it with the same backend code the parent would use, synchronizes the device, and (mode
"decode") copies the logical bytes into one of two slots of a shared host buffer (a memfd), "done
i slot"; the parent copies them from there into its tensors and hands the slot back ("free slot"
on the child's stdin). Mode "vet" decodes into scratch memory only (`gdsckpt verify --isolated`,
and load_into(atomic=True, trusted=False) before any target is written). A Python error, a CUDA
fault, a signal or a hang in the child is a CheckpointFormatError naming the chunk under way (a
ChecksumError for a checksum mismatch); the parent keeps running.

What it costs: a Python + torch start in the child (CUDA and nvCOMP initialisation on top on a
GPU), and the decoded bytes cross host memory once (device-to-host in the child, host-to-device
in the parent). Measured: README, "What gdsckpt guarantees". Chunks the CPU backend decodes
(zstd, with `zstandard`, which checks its input) and raw chunks do not need a child.

What it does not cover: the decoded bytes of a forged chunk are whatever the forger chose (the
checksum of stored bytes says nothing about them); and a decoder that loops forever is killed
after CHUNK_TIMEOUT seconds without progress.
"""

from __future__ import annotations

import json
import mmap
import os
import select
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gdsckpt.engine.backend import make_backend
from gdsckpt.errors import BackendUnavailableError, CheckpointFormatError, ChecksumError
from gdsckpt.format.file import Index, read_index
from gdsckpt.engine.ring import announce, verify_chunk
from .interfaces import ChunkSource
from .sources import LocalFile

# Seconds: for the child to import torch and gdsckpt and open the file (CUDA and nvCOMP start
# inside the first chunk), and without any progress on one chunk (read + verify + decode + copy
# of at most 2 GiB).
STARTUP_TIMEOUT = 300.0
CHUNK_TIMEOUT = 300.0
SLOTS = 2  # host slots in decode mode: the child decodes chunk i+1 while the parent copies chunk i


def needs_child(kind: str, spec: dict, raw: bool) -> bool:
    """Must this chunk be decoded in a child? Every chunk bound for an nvCOMP decoder (the GPU
    backend decodes zstd with nvCOMP too); not raw chunks (a copy), not chunks the CPU backend
    decodes (zstandard)."""
    return kind == "gpu" and not raw


@dataclass(frozen=True)
class IndexedFile:
    """What `run` decodes from: a checkpoint the parent opened (a local file: the child opens it
    again through `file.child_file()`) and its validated index (which chunks, where, which key)."""

    file: ChunkSource
    index: Index


def _child_argv() -> list[str]:
    """The child's command line (tests replace it to make a child that crashes)."""
    return [sys.executable, "-m", "gdsckpt.reading.isolated"]


def run(source: IndexedFile, chunk_ids, kind: str, device_index: int | None, io: str = "auto", deliver=None) -> int:
    """Decode `chunk_ids` of `source` in a child process, in file order. deliver(chunk id,
    logical bytes as a uint8 CPU tensor valid during the call) receives each decoded chunk (mode
    "decode"); deliver=None only decodes into scratch (mode "vet"). Returns the chunks done.
    Raises a ChecksumError / CheckpointFormatError naming the first chunk the child could not
    decode (or died or hung on), or a BackendUnavailableError if it failed before any chunk; a
    ValueError for a source a child cannot open (an object in a store)."""
    plan, label = source.index.plan, source.file.label
    chunk_ids = sorted(chunk_ids)
    if not chunk_ids:
        return 0
    # The child reads the file the parent opened, through its own copy of the descriptor (a rename
    # over the path since cannot redirect it); by the path once the parent has closed it.
    child_file = source.file.child_file()
    slot_bytes = max(plan.chunks[c].length for c in chunk_ids)
    read_fd, write_fd = os.pipe()
    file_fd = child_file.fd
    shm_fd = None
    if deliver is not None:
        shm_fd = os.memfd_create("gdsckpt-isolated", 0)
        os.ftruncate(shm_fd, SLOTS * slot_bytes)
    request = {"path": child_file.path, "label": str(label), "identity": list(child_file.identity),
               "chunks": chunk_ids, "backend": kind, "device": device_index, "io": io, "fd": write_fd,
               "shm": shm_fd, "slot_bytes": slot_bytes}
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)  # the gdsckpt the parent runs, not another one
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    passed = tuple(fd for fd in (write_fd, file_fd, shm_fd) if fd is not None)
    shared = None
    with tempfile.TemporaryFile() as err:
        try:
            child = subprocess.Popen(_child_argv(), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err,
                                     pass_fds=passed, env=env, close_fds=True)
        finally:
            os.close(write_fd)
        current, done, ready, failure = None, 0, False, None
        try:
            if shm_fd is not None:
                shared = mmap.mmap(shm_fd, SLOTS * slot_bytes)
            child.stdin.write((json.dumps(request) + "\n").encode())
            child.stdin.flush()
            buf = b""
            while failure is None:
                timeout = CHUNK_TIMEOUT if ready else STARTUP_TIMEOUT
                readable, _, _ = select.select([read_fd], [], [], timeout)
                if not readable:
                    child.kill()
                    failure = {"error": f"no progress in {timeout:.0f} s: killed"}
                    break
                data = os.read(read_fd, 65536)
                if not data:
                    break
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    msg = json.loads(line)
                    if "ready" in msg:
                        ready = True
                    elif "start" in msg:
                        current = msg["start"]
                    elif "done" in msg:
                        c, s = msg["done"], msg["slot"]
                        if deliver is not None:
                            _deliver(deliver, c, shared, s * slot_bytes, plan.chunks[c].length)
                        current, done = None, done + 1
                        if deliver is not None and done < len(chunk_ids):
                            # Hand the slot back. Not after the last chunk: the child, needing no
                            # more slots, may have exited already, and the write would break the pipe.
                            child.stdin.write(f"{s}\n".encode())
                            child.stdin.flush()
                    elif "error" in msg:
                        failure = msg
                        current = msg.get("chunk", current)
                        break
        except BrokenPipeError:  # the child died; its status says how
            pass
        finally:
            os.close(read_fd)
            if shared is not None:
                shared.close()
            if shm_fd is not None:
                os.close(shm_fd)
            try:
                child.stdin.close()
            except BrokenPipeError:
                pass
            if failure is not None and child.poll() is None:
                child.kill()
            rc = child.wait()
        if rc == 0 and done == len(chunk_ids) and failure is None:
            return done
        if failure is None:
            detail = (f"the child process died of {signal.Signals(-rc).name}" if rc < 0 and -rc in signal.valid_signals()
                      else f"the child process exited with status {rc}")
            err.seek(0)
            tail = err.read()[-2000:].decode(errors="replace").strip()
            failure = {"error": detail + (f"; its last output: {tail}" if tail else "")}
    if current is None and ready and done < len(chunk_ids):
        current = chunk_ids[done]  # it failed reading the next chunk, before its decode began
    if current is None:
        raise BackendUnavailableError(f"trusted=False: the child process that decodes chunks failed before decoding "
                                      f"any ({failure['error']}); {str(label)!r} was not read")
    key = plan.tensors[plan.chunks[current].segments[0].tensor].key
    if failure.get("checksum"):
        raise ChecksumError("stored bytes do not match their checksum: the chunk is corrupt (found by the isolated "
                            "child process)", path=label, key=key, chunk=current)
    raise CheckpointFormatError(f"chunk failed to decode in an isolated child process ({failure['error']}); it was "
                                "not decoded in this process", path=label, key=key, chunk=current)


def _deliver(deliver, chunk: int, shared: mmap.mmap, offset: int, length: int) -> None:
    import torch

    view = memoryview(shared)[offset:offset + length]
    try:
        deliver(chunk, torch.frombuffer(view, dtype=torch.uint8) if length else torch.empty(0, dtype=torch.uint8))
    finally:
        view.release()


# ---------------------------------------------------------------- the child


def _emit(fd: int, msg: dict) -> None:
    os.write(fd, (json.dumps(msg) + "\n").encode())


def main() -> int:
    req = json.loads(sys.stdin.readline())
    fd = req["fd"]
    current = None
    try:
        import torch

        label = req["label"]
        source = LocalFile(Path(req["path"]))  # trusted: this process is the sandbox
        if list(source.identity) != req["identity"]:
            raise RuntimeError("the child opened another file than the parent's")
        index = read_index(source.pread, source.size, label)
        plan, records = index.plan, index.records
        chunks = req["chunks"]
        gpu = req["backend"] == "gpu"
        if gpu:
            torch.cuda.set_device(req["device"] or 0)
        host = None
        if req["shm"] is not None:
            shared = mmap.mmap(req["shm"], SLOTS * req["slot_bytes"])
            host = torch.frombuffer(shared, dtype=torch.uint8)
        free = list(range(SLOTS))
        with make_backend(req["backend"], io=req["io"], read_task_bytes=source.read_task_bytes) as be:
            file = source.open_chunks(be)
            _emit(fd, {"ready": True})
            try:
                be.begin()
                max_len = max(plan.chunks[c].length for c in chunks)
                max_stored = max(records[c].stored for c in chunks)
                staging = be.empty(max_len)
                stored_bufs = [be.empty(max_stored) for _ in range(2)]
                announce(file, index, chunks)
                pending = file.pread(stored_bufs[0], records[chunks[0]].stored, records[chunks[0]].file_offset)
                for j, c in enumerate(chunks):
                    chunk, rec = plan.chunks[c], records[c]
                    key = plan.tensors[chunk.segments[0].tensor].key
                    got = pending.get()
                    stored = stored_bufs[j % 2][:rec.stored]
                    if j + 1 < len(chunks):  # read ahead while this chunk is verified and decoded
                        nxt = records[chunks[j + 1]]
                        pending = file.pread(stored_bufs[(j + 1) % 2], nxt.stored, nxt.file_offset)
                    verify_chunk(got, be.checksum(stored, index.checksum) if got == rec.stored else 0, rec, label,
                                 key, c)
                    current = c
                    _emit(fd, {"start": c})
                    out = staging[:chunk.length]
                    if rec.raw:
                        be.copy(out, stored)
                    else:
                        be.decode(plan.streams[chunk.stream].codec, stored, out, rec.frames)
                    be.synchronize()
                    if gpu:
                        torch.cuda.synchronize()  # a fault surfaces here, against this chunk
                    if host is None:
                        _emit(fd, {"done": c, "slot": None})
                    else:
                        if not free:
                            free.append(int(sys.stdin.readline()))
                        s = free.pop(0)
                        host[s * req["slot_bytes"]:s * req["slot_bytes"] + chunk.length].copy_(out)
                        _emit(fd, {"done": c, "slot": s})
                    current = None
                pending.get()
                be.finish()
            finally:
                file.close()
        return 0
    except BaseException as e:  # report it against the chunk under way, then die
        from gdsckpt.errors import ChecksumError as _ChecksumError

        msg = {"error": f"{type(e).__name__}: {e}", "checksum": isinstance(e, _ChecksumError)}
        if isinstance(e, CheckpointFormatError) and e.chunk is not None:
            msg["chunk"] = e.chunk
        elif current is not None:
            msg["chunk"] = current  # (otherwise the parent blames the next chunk it has no "done" for)
        try:
            _emit(fd, msg)
        except OSError:
            pass
        return 1


if __name__ == "__main__":
    os._exit(main())  # no interpreter teardown: nothing of a faulted CUDA context runs again
