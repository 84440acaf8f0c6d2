"""Peer replicas on the wire: a rank's committed memory copy (the compressed image save_async
made, byte for byte) sent to the ranks that hold its replicas (gdsckpt/manager/replicas/placement.py),
in the background, over a torch.distributed process group of its own.

The groups are made once, collectively, when the Checkpointer is made (every rank makes them).
Nothing here ever uses the default group: training's collectives run there, and this runs on
threads of its own. The messages (offers, replies, acks) always go over gloo, on the CPU: a
receiver waits for the next offer for as long as steps are apart, and a NCCL receive posted
that long would be a kernel spinning on the GPU. The images go over gloo too on the CPU, and
over NCCL where the default group is NCCL (a GPU host), only while both ends are in an exchange.
Two groups of each, one per direction of a pair (origin < holder, origin > holder): where two
ranks hold each other's replicas (two nodes), their two exchanges never share a communicator
(NCCL runs a pair's operations in order on one stream: two exchanges issued by two threads could
each wait for the other's receive, queued behind its own send; gloo matches by tag and would
not, but takes the same path).

One exchange, origin -> holder, for each step the origin's sender thread takes (the newest step
committed since its last exchange: a slow wire coalesces, it does not queue):

    origin                                   holder (its receiver thread for that origin)
    header [OFFER, step, bytes, footer]  ->  room in its replica tier for the origin (or not)
                                         <-  reply [step, READY | REFUSED]
    the image, in pieces                 ->  into the replica's segment
                                             every chunk checked, the footer the header named,
                                             then the commit record
                                         <-  ack [step, COMMITTED | DAMAGED]

The step counts as replicated on that holder only with COMMITTED. The pieces are the same on
both back ends; only the buffers differ. On gloo they are the segment's own mapping. On NCCL they
are device staging buffers, PIPELINE_DEPTH pieces in flight, copied on a CUDA stream of the
wire's own (host -> device before a send, device -> host after a receive): the copies overlap
the sends and never queue with training's work. At a restore, the rank that lost its copy
receives the image straight into device memory (Wire.recv_to_device) and decodes it from there.
THE NCCL PATH IS NOT EXERCISED BY THE CPU TESTS: it needs 2 GPUs (tests/manager/test_replicas_gpu.py).

Bounded: every wait on the origin's side is at most defaults.REPLICA_TIMEOUT_S + bytes /
REPLICA_MIN_BYTES_PER_S; a save never waits for replication at all (the copy is held, not
dropped, only while it is on the wire). A peer that died fails the wait at once (its connection
is reset); a peer that hangs fails it at the bound. Either way the step is not replicated on
that holder, and the channel to it is closed for the rest of the run (gloo closes a pair whose
wait timed out): status() says so, and the next run opens it again. The receiver waits for the
next header without a bound (the group's timeout: steps may be hours apart); a receiver whose
origin died ends with the connection's error.
"""

from __future__ import annotations

import datetime
import logging
import struct
import threading
import time
from collections import deque

import torch

from gdsckpt.format import file as fmt
from gdsckpt.core.defaults import REPLICA_MIN_BYTES_PER_S, REPLICA_PIECE_BYTES, REPLICA_TIMEOUT_S
from gdsckpt.errors import GdsckptError

log = logging.getLogger("gdsckpt.manager.replicas.wire")

TAG_OFFER = 46_001  # origin -> holder: headers and images
TAG_REPLY = 46_002  # holder -> origin: replies and acks
TAG_RESTORE = 46_003  # holder -> origin at a restore: the replica's image (replicas/store.py)
OFFER, BYE = 1, 2
READY, REFUSED, COMMITTED, DAMAGED = 1, 2, 3, 4
_HEADER = struct.Struct("<qqq")  # kind, step, bytes; then the image's footer
HEADER_BYTES = _HEADER.size + fmt.FOOTER_SIZE
_IDLE = datetime.timedelta(days=30)  # the group's own timeout: a receiver idles between steps
# Pieces of an image in flight on NCCL at once, each in a staging buffer of its own: copies to and
# from the device overlap the sends, at PIPELINE_DEPTH * REPLICA_PIECE_BYTES of device memory a wire.
PIPELINE_DEPTH = 3
REPLICA_NCCL_CTAS = 4  # (_few_ctas) a point-to-point transfer over NVLink fills the link with a few


def bound(nbytes: int) -> float:
    """Seconds any one wait of a transfer of `nbytes` may take before its peer counts as hung."""
    return REPLICA_TIMEOUT_S + nbytes / REPLICA_MIN_BYTES_PER_S


class ChannelClosed(GdsckptError, ConnectionError):
    """The channel to a peer failed: it died, or hung past the bound (an OSError: a restore
    falls back from it as from an unreadable copy)."""


class Groups:
    """The replication's process groups, made now by every rank (collectives on the default
    group, on the caller's thread): NCCL where the default group is NCCL, else gloo."""

    def __init__(self):
        import torch.distributed as dist
        # "nccl", or a device map such as "cpu:gloo,cuda:nccl"
        nccl = "nccl" in str(dist.get_backend()) and torch.cuda.is_available()
        self.control = [dist.new_group(backend="gloo", timeout=_IDLE) for _ in range(2)]
        self.data = [dist.new_group(backend="nccl", timeout=_IDLE, pg_options=_few_ctas())
                     for _ in range(2)] if nccl else self.control
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else None

    def wire(self, origin: int, holder: int) -> "Wire":
        """A Wire (its own staging buffer: one per thread) for the exchanges of `origin`'s
        replicas held by `holder`, in either direction."""
        d = int(origin < holder)
        return Wire(self.control[d], self.data[d], self.device)


class Wire:
    """Point-to-point on the replication groups: messages on `control` (gloo), images on `data`
    (the same group, or NCCL: then `device` is the CUDA device whose staging buffers NCCL sends
    from and receives into; one Wire per thread)."""

    def __init__(self, control, data, device: torch.device | None = None):
        self.control, self.data, self.device = control, data, device
        self._staging: list[torch.Tensor] = []
        self._stream = None
        # the last image's: bytes, seconds, and prepare's seconds page-locking before it
        self.last: dict = {}
        self._prepared = 0.0

    def bind(self) -> None:
        """On the thread that uses this Wire: NCCL's device is this rank's (not device 0), and
        the image's copies run on a stream of the wire's own (on the thread's default stream
        they would queue behind training's kernels, and training's behind them)."""
        if self.device is not None:
            torch.cuda.set_device(self.device)
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
                self._buffer(0, 0)  # the staging buffers made now, before any exchange (see prepare)

    def prepare(self, slot, nbytes: int) -> float:
        """On NCCL, page-lock the host arenas of `slot` under its first `nbytes` before an
        exchange begins; the seconds it took. A CUDA call such as cudaHostRegister may wait for
        every kernel on the device, this rank's pending NCCL sends and receives among them: made
        inside an exchange, it would wait for a peer that may itself be waiting the same way for
        this rank (NCCL's documentation on using several communicators at once). So the wire
        threads make such calls only before an image's first piece goes out or its receives are
        posted, never between."""
        self._prepared = 0.0 if self.device is None else slot.host(0, min(nbytes, slot.mapped), pin=True)[1]
        return self._prepared

    # ------------------------------------------------------------ messages
    def send(self, tensor: torch.Tensor, dst: int, tag: int, timeout: float | None, group=None) -> None:
        """A message (or, group=self.data, a piece of an image) to `dst`, waited for at most `timeout`."""
        import torch.distributed as dist
        self._wait(self._start(dist.isend, tensor, dst, tag, group), timeout, f"sending to rank {dst}")

    def recv(self, tensor: torch.Tensor, src: int, tag: int, timeout: float | None, group=None) -> torch.Tensor:
        import torch.distributed as dist
        self._wait(self._start(dist.irecv, tensor, src, tag, group), timeout, f"receiving from rank {src}")
        return tensor

    def _start(self, op, tensor: torch.Tensor, peer: int, tag: int, group=None):
        try:
            return op(tensor, peer, self.control if group is None else group, tag)
        except RuntimeError as e:
            raise ChannelClosed(f"rank {peer}: {_short(e)}") from None

    @staticmethod
    def _wait(work, timeout: float | None, what: str) -> None:
        """Until `work` is done (a timeout makes NCCL's wait block this thread too, not only
        order the current stream after it)."""
        try:
            if timeout is None:
                work.wait()
            else:
                work.wait(datetime.timedelta(seconds=timeout))
        except RuntimeError as e:
            raise ChannelClosed(f"{what}: {_short(e)}") from None

    # ------------------------------------------------------------ images, in pieces
    def send_image(self, slot, nbytes: int, dst: int, tag: int, segment=None) -> None:
        """The first `nbytes` of `slot` to `dst`, piece by piece (each wait bounded). On NCCL,
        PIPELINE_DEPTH pieces in flight: a piece is copied to the device while those before it
        are on the wire; from the slot's page-locked arenas (see prepare), or, `segment` given
        (the GPU backend's ChunkFile on the slot's file), read into the device by its threads."""
        import torch.distributed as dist
        t, pin, self._prepared = time.perf_counter(), self._prepared, 0.0
        if self.device is None:
            for lo, hi in pieces(nbytes):
                self.send(host_bytes(slot, lo, hi), dst, tag, bound(hi - lo), self.data)
            self._record(nbytes, t, pin)
            return
        what = f"sending an image to rank {dst}"
        inflight: deque = deque()
        with torch.cuda.stream(self._stream):
            for n, (lo, hi) in enumerate(pieces(nbytes)):
                if len(inflight) == PIPELINE_DEPTH:  # its staging buffer is free once its send is done
                    self._wait(*inflight.popleft(), what)
                buf = self._buffer(n, hi - lo)
                if segment is not None:
                    segment.pread(buf, hi - lo, lo).get()
                else:
                    at = 0
                    for piece in _pinned(slot, lo, hi):  # host -> device on the wire's stream; NCCL's send waits for it
                        buf[at:at + piece.numel()].copy_(piece, non_blocking=True)
                        at += piece.numel()
                inflight.append((self._start(dist.isend, buf, dst, tag, self.data), bound(hi - lo)))
            while inflight:
                self._wait(*inflight.popleft(), what)
        self._record(nbytes, t, pin)

    def recv_image(self, slot, nbytes: int, src: int, tag: int) -> None:
        """`nbytes` from `src` into `slot` from offset 0 (its mapping holds them: made for them).
        On NCCL, PIPELINE_DEPTH pieces in flight: a piece is copied to the segment (page-locked
        arenas) while the next ones arrive."""
        import torch.distributed as dist
        t, pin, self._prepared = time.perf_counter(), self._prepared, 0.0
        if self.device is None:
            for lo, hi in pieces(nbytes):
                slot.host(lo, hi, pin=False)  # its arenas taken first: a full /dev/shm is an error, not a SIGBUS
                self.recv(slot.tensor[lo:hi], src, tag, bound(hi - lo), self.data)
            self._record(nbytes, t, pin)
            return
        what = f"receiving an image from rank {src}"
        ranges = list(pieces(nbytes))
        inflight: deque = deque()

        def post(n: int) -> None:  # NCCL's receive waits for the copy out of its buffer queued before it
            lo, hi = ranges[n]
            buf = self._buffer(n, hi - lo)
            inflight.append((self._start(dist.irecv, buf, src, tag, self.data), n, buf))

        with torch.cuda.stream(self._stream):
            for n in range(min(PIPELINE_DEPTH, len(ranges))):
                post(n)
            while inflight:
                work, n, buf = inflight.popleft()
                lo, hi = ranges[n]
                self._wait(work, bound(hi - lo), what)
                at = 0
                for piece in slot.host(lo, hi, pin=True)[0]:  # locked by prepare: a view, no CUDA call
                    piece.copy_(buf[at:at + piece.numel()], non_blocking=True)
                    at += piece.numel()
                if n + PIPELINE_DEPTH < len(ranges):
                    post(n + PIPELINE_DEPTH)
            self._stream.synchronize()
        self._record(nbytes, t, pin)

    def recv_to_device(self, image: torch.Tensor, src: int, tag: int) -> None:
        """An image sent by send_image received straight into the device tensor `image` (its
        length), PIPELINE_DEPTH pieces posted at a time: no staging, no host memory."""
        import torch.distributed as dist
        what = f"receiving an image from rank {src}"
        t, pin, self._prepared = time.perf_counter(), self._prepared, 0.0
        inflight: deque = deque()
        with torch.cuda.stream(self._stream):
            for lo, hi in pieces(image.numel()):
                if len(inflight) == PIPELINE_DEPTH:
                    self._wait(*inflight.popleft(), what)
                inflight.append((self._start(dist.irecv, image[lo:hi], src, tag, self.data), bound(hi - lo)))
            while inflight:
                self._wait(*inflight.popleft(), what)
            self._stream.synchronize()
        self._record(image.numel(), t, pin)

    def _record(self, nbytes: int, t0: float, pin: float) -> None:
        """The image just sent or received: its bytes, seconds since t0, and prepare's seconds."""
        self.last = {"bytes": nbytes, "seconds": time.perf_counter() - t0, "pin_seconds": pin}

    def _buffer(self, n: int, size: int) -> torch.Tensor:
        """Piece n's staging buffer (PIPELINE_DEPTH of them, made on first use)."""
        while len(self._staging) < PIPELINE_DEPTH:
            self._staging.append(torch.empty(REPLICA_PIECE_BYTES, dtype=torch.uint8, device=self.device))
        return self._staging[n % PIPELINE_DEPTH][:size]


def _few_ctas():
    """NCCL options for the images' groups: at most REPLICA_NCCL_CTAS thread blocks a transfer
    (NCCL's maxCTAs), so that replication running beside training takes a few of the GPU's SMs,
    not as many as a collective of training's; None where this torch has no such option."""
    import torch.distributed as dist
    try:
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.max_ctas = REPLICA_NCCL_CTAS
    except (AttributeError, RuntimeError, TypeError):
        return None
    return opts


def pieces(nbytes: int):
    """The [lo, hi) of each piece an image of `nbytes` goes in."""
    for lo in range(0, nbytes, REPLICA_PIECE_BYTES):
        yield lo, min(nbytes, lo + REPLICA_PIECE_BYTES)


def host_bytes(slot, lo: int, hi: int) -> torch.Tensor:
    """Bytes [lo, hi) of `slot`: the mapping itself, or a copy where an index outgrew it."""
    if hi <= slot.mapped:
        return slot.tensor[lo:hi]
    return torch.frombuffer(bytearray(slot.read(hi - lo, lo)), dtype=torch.uint8)


def _pinned(slot, lo: int, hi: int) -> list[torch.Tensor]:
    """Bytes [lo, hi) of `slot` to copy to a device: its arenas page-locked by prepare, or a
    copy where an index outgrew the mapping."""
    if hi <= slot.mapped:
        return slot.host(lo, hi, pin=True)[0]
    return [host_bytes(slot, lo, hi)]


def header(kind: int, step: int = 0, nbytes: int = 0, footer: bytes = b"") -> torch.Tensor:
    raw = _HEADER.pack(kind, step, nbytes) + footer.ljust(fmt.FOOTER_SIZE, b"\0")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def parse_header(t: torch.Tensor) -> tuple[int, int, int, bytes]:
    raw = bytes(t.numpy())
    kind, step, nbytes = _HEADER.unpack_from(raw)
    return kind, step, nbytes, raw[_HEADER.size:]


def pair(step: int, code: int) -> torch.Tensor:
    return torch.tensor([step, code], dtype=torch.int64)


class Sender:
    """The origin's side: a thread that sends each newest committed step to every holder.
    tier: the rank's own MemoryTier; wires: {holder rank: its Wire}. status() per step and holder."""

    def __init__(self, wires: dict, tier, rank: int):
        self.wires, self.tier, self.rank, self.holders = wires, tier, rank, list(wires)
        self.closed: dict[int, str] = {}  # holder -> why its channel is closed
        self.results: dict[int, dict[int, str]] = {}  # step -> {holder: "committed" | why not}
        self.seconds: deque = deque(maxlen=100)
        self._cond = threading.Condition()
        self._next: int | None = None
        self._to: list[int] | None = None  # the holders of the step waiting (None: all)
        self._busy = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="gdsckpt-replicas-send", daemon=True)
        self._thread.start()

    def submit(self, step: int, holders: list[int] | None = None) -> None:
        """`step` is committed in the rank's tier: replicate it (a step waiting is replaced), on
        `holders` only (after a restore: those that lost their replica; the others hold it)."""
        with self._cond:
            if self._next is not None and self._next != step:
                self.results.setdefault(self._next, {h: "coalesced: a newer step was committed before it was sent"
                                                     for h in self.holders})
            self._next, self._to = step, holders
            self._cond.notify_all()

    def held_already(self, step: int, holders: list[int]) -> None:
        """`holders` hold `step`, committed before this run (a restore's reports): it counts as
        replicated there."""
        with self._cond:
            self.results.setdefault(step, {}).update({h: "committed" for h in holders})

    def wait(self, timeout: float | None = None) -> bool:
        """Until no step waits or is on the wire; whether it got there."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._next is not None or self._busy:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _run(self) -> None:
        for w in self.wires.values():
            w.bind()
        while True:
            with self._cond:
                while self._next is None and not self._stop:
                    self._cond.wait()
                if self._next is None:
                    return
                step, to, self._next, self._busy = self._next, self._to, None, True
            try:
                self._replicate(step, self.holders if to is None else to)
            except Exception as e:  # noqa: BLE001 - the step is simply not replicated
                log.warning("gdsckpt: replicating step %d: %s: %s", step, type(e).__name__, e)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _replicate(self, step: int, holders: list[int]) -> None:
        t = time.perf_counter()
        out = self.results.setdefault(step, {})
        try:
            copy = self.tier.hold(step)
        except KeyError:
            out.update({h: "dropped before it was sent" for h in holders})
            return
        try:
            footer = copy.slot.read(fmt.FOOTER_SIZE, copy.nbytes - fmt.FOOTER_SIZE)
            for h in holders:
                if h in self.closed:
                    out[h] = f"not sent: the channel to rank {h} is closed ({self.closed[h]})"
                    continue
                try:
                    out[h] = self._offer(h, step, copy, footer)
                except ChannelClosed as e:
                    self.closed[h] = str(e)
                    out[h] = f"failed: {e}"
                    log.warning("gdsckpt: step %d is not replicated on rank %d, and no later step will be in this "
                                "run: %s", step, h, e)
        finally:
            self.tier.release(step)
        self.seconds.append({"step": step, "seconds": time.perf_counter() - t, "bytes": copy.nbytes,
                             "wire": {h: dict(self.wires[h].last) for h in holders}})

    def _offer(self, h: int, step: int, copy, footer: bytes) -> str:
        w, b = self.wires[h], bound(copy.nbytes)
        w.prepare(copy.slot, copy.nbytes)
        w.send(header(OFFER, step, copy.nbytes, footer), h, TAG_OFFER, REPLICA_TIMEOUT_S)
        got_step, code = w.recv(pair(0, 0), h, TAG_REPLY, REPLICA_TIMEOUT_S).tolist()
        if got_step != step or code not in (READY, REFUSED):
            raise ChannelClosed(f"rank {h} answered {code} for step {got_step} to an offer of step {step}")
        if code == REFUSED:
            return f"refused by rank {h}: no room in its memory tier (status()['memory']['replicas'] there)"
        w.send_image(copy.slot, copy.nbytes, h, TAG_OFFER)
        got_step, code = w.recv(pair(0, 0), h, TAG_REPLY, b).tolist()
        if got_step != step:
            raise ChannelClosed(f"rank {h} acknowledged step {got_step}, not {step}")
        return "committed" if code == COMMITTED else f"damaged on the wire: rank {h} refused its chunks"

    def replicated(self, step: int) -> list[int]:
        """The holders that committed `step`."""
        return sorted(h for h, what in self.results.get(step, {}).items() if what == "committed")

    def close(self, timeout: float) -> None:
        """Finish the step on the wire, then tell every open holder's receiver to end."""
        self.wait(timeout)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout)
        for h in self.holders:
            if h not in self.closed:
                try:
                    self.wires[h].send(header(BYE), h, TAG_OFFER, REPLICA_TIMEOUT_S)
                except ChannelClosed as e:
                    log.info("gdsckpt: telling rank %d replication ends: %s", h, e)

    def status(self) -> dict:
        return {"holders": self.holders, "closed": dict(self.closed),
                "steps": {s: dict(r) for s, r in sorted(self.results.items())[-16:]},
                "last": self.seconds[-1] if self.seconds else None}


class Receiver:
    """The holder's side for one origin: a thread that takes each offered image into `store`
    (replica_store.ReplicaStore) until the origin says BYE or its channel fails."""

    def __init__(self, wire: Wire, store, origin: int):
        self.wire, self.store, self.origin = wire, store, origin
        self.ended: str | None = None
        self.last: dict = {}  # the last image taken: the wire's timings, and the check and commit's
        self._thread = threading.Thread(target=self._run, name=f"gdsckpt-replicas-recv-{origin}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.wire.bind()
            while True:
                kind, step, nbytes, footer = parse_header(
                    self.wire.recv(torch.zeros(HEADER_BYTES, dtype=torch.uint8), self.origin, TAG_OFFER, None))
                if kind != OFFER:
                    self.ended = "the origin closed"
                    return
                self._take(step, nbytes, footer)
        except ChannelClosed as e:
            self.ended = str(e)
            log.info("gdsckpt: replicas of rank %d end: %s", self.origin, e)
        except Exception as e:  # noqa: BLE001 - never kills the process: the origin's wait ends at its bound
            self.ended = f"{type(e).__name__}: {e}"
            log.warning("gdsckpt: receiving rank %d's replicas: %s", self.origin, self.ended)

    def _take(self, step: int, nbytes: int, footer: bytes) -> None:
        slot = self.store.reserve(self.origin, step, nbytes)
        if slot is None:
            self.wire.send(pair(step, REFUSED), self.origin, TAG_REPLY, REPLICA_TIMEOUT_S)
            return
        try:
            self.wire.prepare(slot, nbytes)  # before READY: the origin's sends wait for this rank's receives
            self.wire.send(pair(step, READY), self.origin, TAG_REPLY, REPLICA_TIMEOUT_S)
            self.wire.recv_image(slot, nbytes, self.origin, TAG_OFFER)
        except BaseException:
            self.store.abandon(self.origin, slot)
            raise
        t = time.perf_counter()
        ok = self.store.commit(self.origin, slot, step, nbytes, footer)
        self.last = dict(self.wire.last, step=step, commit_seconds=time.perf_counter() - t)
        self.wire.send(pair(step, COMMITTED if ok else DAMAGED), self.origin, TAG_REPLY, REPLICA_TIMEOUT_S)

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _short(e: BaseException) -> str:
    text = str(e).split("This is typically")[0].strip()
    return text[-300:]
