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
both back ends; only the buffer differs (Wire.outgoing / Wire.incoming): on gloo the segment's
own mapping, on NCCL a device staging buffer of one piece (host -> device before a send, device
-> host after a receive). THE NCCL PATH IS NOT EXERCISED BY THE CPU TESTS: it needs 2 GPUs.

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
        nccl = dist.get_backend() == "nccl" and torch.cuda.is_available()
        self.control = [dist.new_group(backend="gloo", timeout=_IDLE) for _ in range(2)]
        self.data = [dist.new_group(backend="nccl", timeout=_IDLE) for _ in range(2)] if nccl else self.control
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else None

    def wire(self, origin: int, holder: int) -> "Wire":
        """A Wire (its own staging buffer: one per thread) for the exchanges of `origin`'s
        replicas held by `holder`, in either direction."""
        d = int(origin < holder)
        return Wire(self.control[d], self.data[d], self.device)


class Wire:
    """Point-to-point on the replication groups: messages on `control` (gloo), images on `data`
    (the same group, or NCCL: then `device` is the CUDA device whose staging buffer NCCL sends
    from and receives into; one Wire per thread)."""

    def __init__(self, control, data, device: torch.device | None = None):
        self.control, self.data, self.device = control, data, device
        self._staging: torch.Tensor | None = None

    def bind(self) -> None:
        """On the thread that uses this Wire: NCCL's device is this rank's (not device 0)."""
        if self.device is not None:
            torch.cuda.set_device(self.device)

    # ------------------------------------------------------------ messages
    def send(self, tensor: torch.Tensor, dst: int, tag: int, timeout: float | None, group=None) -> None:
        """A message (or, group=self.data, a piece of an image) to `dst`, waited for at most `timeout`."""
        import torch.distributed as dist
        try:
            self._wait(dist.isend(tensor, dst=dst, group=self.control if group is None else group, tag=tag), timeout)
        except RuntimeError as e:
            raise ChannelClosed(f"sending to rank {dst}: {_short(e)}") from None

    def recv(self, tensor: torch.Tensor, src: int, tag: int, timeout: float | None, group=None) -> torch.Tensor:
        import torch.distributed as dist
        try:
            self._wait(dist.irecv(tensor, src=src, group=self.control if group is None else group, tag=tag), timeout)
        except RuntimeError as e:
            raise ChannelClosed(f"receiving from rank {src}: {_short(e)}") from None
        return tensor

    @staticmethod
    def _wait(work, timeout: float | None) -> None:
        if timeout is None:
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=timeout))

    # ------------------------------------------------------------ images, in pieces
    def send_image(self, slot, nbytes: int, dst: int, tag: int) -> None:
        """The first `nbytes` of `slot` to `dst`, piece by piece (each wait bounded)."""
        for lo in range(0, nbytes, REPLICA_PIECE_BYTES):
            hi = min(nbytes, lo + REPLICA_PIECE_BYTES)
            self.send(self.outgoing(slot, lo, hi), dst, tag, bound(hi - lo), self.data)

    def recv_image(self, slot, nbytes: int, src: int, tag: int) -> None:
        """`nbytes` from `src` into `slot` from offset 0 (its mapping holds them: made for them)."""
        for lo in range(0, nbytes, REPLICA_PIECE_BYTES):
            hi = min(nbytes, lo + REPLICA_PIECE_BYTES)
            buf = self.recv(self.incoming(slot, lo, hi), src, tag, bound(hi - lo), self.data)
            if self.device is not None:  # NCCL: device staging -> the segment (page-locked pieces)
                pieces, _ = slot.host(lo, hi, pin=True)
                pos = 0
                for p in pieces:
                    p.copy_(buf[pos:pos + p.numel()])
                    pos += p.numel()
                torch.cuda.current_stream(self.device).synchronize()

    def outgoing(self, slot, lo: int, hi: int) -> torch.Tensor:
        """Bytes [lo, hi) of `slot` as the buffer sent: gloo, the mapping itself (or a copy where
        an index outgrew it); NCCL, the device staging buffer filled from it."""
        host = slot.tensor[lo:hi] if hi <= slot.mapped else torch.frombuffer(bytearray(slot.read(hi - lo, lo)),
                                                                            dtype=torch.uint8)
        if self.device is None:
            return host
        buf = self._stage(hi - lo)
        buf.copy_(host, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return buf

    def incoming(self, slot, lo: int, hi: int) -> torch.Tensor:
        """The buffer bytes [lo, hi) of `slot` are received into: gloo, the mapping (its arenas
        taken first: a full /dev/shm is an error, not a SIGBUS); NCCL, the staging buffer."""
        if self.device is None:
            slot.host(lo, hi, pin=False)
            return slot.tensor[lo:hi]
        return self._stage(hi - lo)

    def _stage(self, n: int) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.empty(REPLICA_PIECE_BYTES, dtype=torch.uint8, device=self.device)
        return self._staging[:n]


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
        self._busy = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="gdsckpt-replicas-send", daemon=True)
        self._thread.start()

    def submit(self, step: int) -> None:
        """`step` is committed in the rank's tier: replicate it (a step waiting is replaced)."""
        with self._cond:
            if self._next is not None and self._next != step:
                self.results.setdefault(self._next, {h: "coalesced: a newer step was committed before it was sent"
                                                     for h in self.holders})
            self._next = step
            self._cond.notify_all()

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
                step, self._next, self._busy = self._next, None, True
            try:
                self._replicate(step)
            except Exception as e:  # noqa: BLE001 - the step is simply not replicated
                log.warning("gdsckpt: replicating step %d: %s: %s", step, type(e).__name__, e)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _replicate(self, step: int) -> None:
        t = time.perf_counter()
        out = self.results.setdefault(step, {})
        try:
            copy = self.tier.hold(step)
        except KeyError:
            out.update({h: "dropped before it was sent" for h in self.holders})
            return
        try:
            footer = copy.slot.read(fmt.FOOTER_SIZE, copy.nbytes - fmt.FOOTER_SIZE)
            for h in self.holders:
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
        self.seconds.append({"step": step, "seconds": time.perf_counter() - t, "bytes": copy.nbytes})

    def _offer(self, h: int, step: int, copy, footer: bytes) -> str:
        w, b = self.wires[h], bound(copy.nbytes)
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
            self.wire.send(pair(step, READY), self.origin, TAG_REPLY, REPLICA_TIMEOUT_S)
            self.wire.recv_image(slot, nbytes, self.origin, TAG_OFFER)
        except BaseException:
            self.store.abandon(self.origin, slot)
            raise
        ok = self.store.commit(self.origin, slot, step, nbytes, footer)
        self.wire.send(pair(step, COMMITTED if ok else DAMAGED), self.origin, TAG_REPLY, REPLICA_TIMEOUT_S)

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _short(e: BaseException) -> str:
    text = str(e).split("This is typically")[0].strip()
    return text[-300:]
