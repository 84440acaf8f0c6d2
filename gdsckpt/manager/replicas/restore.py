"""Peer replicas of a Checkpointer's memory tier (Checkpointer(memory=True, replicas=k)): each
rank's newest steps also held in the memory of k ranks on other nodes, so that a node lost (its
memory and local disk gone) costs no step: its replacement's ranks receive their images from the
holders and restore them as their own memory copies. docs/replicas.md says what survives what.

The parts: the placement (gdsckpt/manager/replicas/placement.py), the wire and its threads
(gdsckpt/manager/replicas/wire.py), the holder's store (gdsckpt/manager/replicas/store.py). This module ties them to
a rank's memory tier (gdsckpt/manager/memory/steps.py calls it):

* made with the Checkpointer, on every rank (collectives on the default group, on the caller's
  thread): every rank's node gathered, the placement, the replication group;
* submit(step) after a step's memory copy is committed: the sender thread replicates it;
* restorable() at a restore (every rank, on the caller's thread): every rank's own steps and the
  replicas it holds gathered; the steps every rank can get, from its own copy or a holder's;
* fetch(step) then: each rank that lacks its copy receives it from a holder on the replication
  group: on a GPU host straight into device memory (image(step)), from where the memory tier's
  restore checks and decodes it; else checked chunk by chunk and committed into its own tier,
  from where the restore reads it (Restored.source "peer" on that rank, either way);
* copies left under another numbering of the ranks (a restarted job numbered otherwise:
  replicas/strays.py) count by their origin too: a rank adopts one on its own host into its
  tier, or a rank of the host that has it sends it; restored() then removes them.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Mapping

import torch

from gdsckpt.core.defaults import READ_ONCE_GPU_FRACTION
from gdsckpt.engine.backend import make_backend
from gdsckpt.manager.memory.source import MemorySource
from gdsckpt.manager.memory.tier import MemoryTier
from gdsckpt.reading.sources import DeviceImage

from .placement import gather_nodes, held_for, place, same_host
from . import strays
from .store import ReplicaStore, check_image
from .wire import TAG_RESTORE, ChannelClosed, Groups, Receiver, Sender, host_bytes, pieces

log = logging.getLogger("gdsckpt.manager.replicas.wire")


class PeerReplicas:
    """Rank `tier.rank`'s replication: its own tier `tier` (memory_tier.MemoryTier), `replicas`
    holders each. node: this rank's node (None: replica_placement.local_node); placement:
    {rank: [holder ranks]} (None: the ring)."""

    def __init__(self, tier, *, replicas: int, node=None, placement: Mapping | None = None, keep: int,
                 on_disk):
        import torch.distributed as dist
        self.tier, self.rank, self.world = tier, tier.rank, dist.get_world_size()
        self._other_worlds: list[int] = []  # said already: replicas of jobs of other sizes on the hosts
        self.nodes, hosts = gather_nodes(node)
        self.placement = place(self.nodes, replicas, placement)  # the same on every rank: refused alike
        shared = same_host(self.placement, hosts)
        if shared and self.rank == 0:
            log.warning("gdsckpt: replicas held on their rank's own host (rank, holder: %s, on %s): they outlive a "
                        "process, not the host (the nodes differ by node= or memory root alone)", shared[:4],
                        hosts[shared[0][0]])
        self.holders = self.placement[self.rank]
        self.origins = held_for(self.placement, self.rank)
        self.groups = Groups()
        self.store = ReplicaStore(tier.directory, rank=self.rank, origins=self.origins, world=self.world,
                                  cap_bytes=tier.cap_bytes, keep=keep, on_disk=on_disk, own_folder=tier.folder)
        self._plans: dict[int, dict[int, tuple]] = {}  # step -> {origin: (server, bytes, folder)}: plan()
        self.from_peer: dict[int, int] = {}  # step -> the holder this rank's copy came from
        self._images: dict[int, DeviceImage] = {}  # step -> its image received into device memory
        self._held_by: dict[int, set[int]] = {}  # holder -> the steps of this rank it held at restorable()
        self.ranks_here: list[int] = []  # the ranks sharing this host's memory (restorable() finds them)
        self.fetched: dict = {}  # the last image received at a restore: its wire's timings
        self.receivers = [Receiver(self.groups.wire(o, self.rank), self.store, o) for o in self.origins]
        self.sender = Sender({h: self.groups.wire(self.rank, h) for h in self.holders}, tier, self.rank)

    def held_bytes(self) -> int:
        """Bytes of the replicas held here (they count against the rank's memory cap)."""
        return self.store.held_bytes()

    def submit(self, step: int) -> None:
        self.sender.submit(step)

    def wait(self, timeout: float | None = None) -> bool:
        """Until the step being replicated is done (acknowledged, refused or failed)."""
        return self.sender.wait(timeout)

    # ------------------------------------------------------------ restoring
    def restorable(self, mine: list[int]) -> list[int]:
        """Steps every rank can get from memory: its own copy (`mine`), a holder's replica, or a
        copy of its own left on some host under another numbering of the ranks (strays.py);
        collectives on the default group."""
        import torch.distributed as dist
        own = {s: self.tier.copy(s).nbytes for s in mine if _has(self.tier, s)}
        keys = [None] * self.world
        dist.all_gather_object(keys, strays.host_key())
        self.ranks_here = [r for r in range(self.world) if keys[r] == keys[self.rank]]
        # one rank of each host reports the host's strays (every rank there sees the same folders)
        first = self.rank == self.ranks_here[0]
        found, worlds = (strays.stray_copies(self.tier.directory, self.ranks_here, self.placement, self.world)
                         if first else ({}, []))
        every = [None] * self.world
        dist.all_gather_object(every, (sorted(own), self.store.inventory(), found, worlds))
        self._plans = plan([e[:3] for e in every], [keys.index(k) for k in keys])
        self._held_by = {h: set(every[h][1].get(self.rank, {})) for h in self.holders}
        others = sorted({w for e in every for w in e[3]})
        if others and self.rank == 0 and others != self._other_worlds:  # (at open, and again at a restore)
            self._other_worlds = others
            log.warning("gdsckpt: memory copies of %s were kept for a job of %s ranks, and this one has %d: they are "
                        "another sharding's, which no rank restores from memory; a step that every rank cannot get "
                        "from memory comes from the directory or the store, where DCP reshards it",
                        self.tier.directory, " or ".join(map(str, others)), self.world)
        return sorted(self._plans)

    def needs_fetch(self, step: int) -> bool:
        return bool(self._plans.get(step))

    def fetch(self, step: int) -> None:
        """Every transfer `step` needs (restorable() planned them), on every rank: as a holder,
        the replica sent to its origin (a thread of its own); as an origin, the image received
        into the own tier, checked chunk by chunk, committed. Raises ChannelClosed or
        CheckpointFormatError-like errors (a restore falls back from them, all ranks together)."""
        transfers = self._plans.get(step, {})
        sends = []
        errors: list[BaseException] = []
        for origin, (server, _, folder) in sorted(transfers.items()):
            if server == self.rank and origin != self.rank:
                t = threading.Thread(target=self._serve, args=(origin, step, errors, folder), daemon=True,
                                     name=f"gdsckpt-replicas-serve-{origin}")
                t.start()
                sends.append(t)
        try:
            if self.rank in transfers:
                server, nbytes, folder = transfers[self.rank]
                if server == self.rank:
                    self._adopt(step, nbytes, folder)
                else:
                    self._receive(step, server, nbytes)
        finally:
            for t in sends:
                t.join()
        if errors:
            raise errors[0]

    def _stray(self, origin: int, folder: str) -> MemoryTier:
        """The tier in `folder`, a stray copy of rank `origin`'s (strays.py), held for reading."""
        return MemoryTier(self.tier.directory, rank=origin, cap_bytes=self.tier.cap_bytes, folder=Path(folder))

    def _adopt(self, step: int, nbytes: int, folder: str) -> None:
        """This rank's image of `step` from a stray copy on its own host: copied into its tier,
        checked chunk by chunk, committed (on the CPU: no CUDA call, so nothing waits for the
        device while other ranks' exchanges run)."""
        stray = self._stray(self.rank, folder)
        try:
            copy = stray.hold(step)
            try:
                def fill(slot):  # write() takes the arenas first: a full /dev/shm is an error
                    for lo, hi in pieces(nbytes):
                        slot.write(host_bytes(copy.slot, lo, hi).numpy(), lo)
                self._into_tier(step, nbytes, f"rank {self.rank}'s copy of step {step} left in {folder}", fill)
            finally:
                stray.release(step)
        finally:
            stray.close()
        log.info("gdsckpt: rank %d took its step %d from %s (%d bytes)", self.rank, step, folder, nbytes)

    def _serve(self, origin: int, step: int, errors: list, folder: str | None = None) -> None:
        """Send rank `origin` its image of `step`: from the replica held for it, or from a stray
        copy in `folder` (strays.py)."""
        try:
            tier = self.store.tiers[origin] if folder is None else self._stray(origin, folder)
        except BaseException as e:  # noqa: BLE001 - told to the caller's thread
            errors.append(e)
            return
        try:
            self._send(tier, origin, step, errors)
        finally:
            if folder is not None:
                tier.close()

    def _send(self, tier, origin: int, step: int, errors: list) -> None:
        try:
            copy = tier.hold(step)
        except KeyError:
            errors.append(ChannelClosed(f"rank {self.rank}'s replica of rank {origin}'s step {step} was dropped"))
            return
        try:
            wire = self.groups.wire(origin, self.rank)
            wire.bind()
            if wire.device is None:
                wire.send_image(copy.slot, copy.nbytes, origin, TAG_RESTORE)
            else:  # read as the memory tier's restore reads a segment: page-locking it in this new process is slower
                with make_backend("gpu", io=MemorySource.io, io_threads=MemorySource.io_threads) as be:
                    segment = MemorySource(copy.slot, copy.nbytes, f"rank {origin}'s replica").open_chunks(be)
                    try:
                        wire.send_image(copy.slot, copy.nbytes, origin, TAG_RESTORE, segment=segment)
                    finally:
                        segment.close()
        except BaseException as e:  # noqa: BLE001 - told to the caller's thread
            errors.append(e)
        finally:
            tier.release(step)

    def _receive(self, step: int, holder: int, nbytes: int) -> None:
        """This rank's image of `step` from `holder`: on a GPU host with room, straight into
        device memory (image(step); the restore checks and decodes it there); else into the
        rank's own tier, checked chunk by chunk and committed."""
        wire = self.groups.wire(self.rank, holder)
        wire.bind()
        label = f"rank {holder}'s replica of rank {self.rank}'s step {step}"
        if wire.device is not None and nbytes <= READ_ONCE_GPU_FRACTION * torch.cuda.mem_get_info(wire.device)[0]:
            image = torch.empty(nbytes, dtype=torch.uint8, device=wire.device)
            wire.recv_to_device(image, holder, TAG_RESTORE)
            self._images[step] = DeviceImage(image, label)
        else:
            def fill(slot):
                wire.prepare(slot, nbytes)  # before the holder's sends can be waiting for this rank
                wire.recv_image(slot, nbytes, holder, TAG_RESTORE)
            self._into_tier(step, nbytes, label, fill)
        self.from_peer[step] = holder
        self.fetched = dict(wire.last, step=step, holder=holder, device=step in self._images)
        log.info("gdsckpt: rank %d received its step %d from rank %d's replica (%d bytes)", self.rank, step, holder,
                 nbytes)

    def _into_tier(self, step: int, nbytes: int, label: str, fill) -> None:
        """`step`'s image of `nbytes` into a slot of the rank's own tier (fill(slot) writes it),
        every chunk checked, then committed; the slot given back on any failure."""
        from gdsckpt.errors import CheckpointFormatError
        slot, _ = self.tier.reserve(step, nbytes)
        try:
            fill(slot)
            why = check_image(slot, nbytes, None, label)
            if why is not None:
                raise CheckpointFormatError(f"{label} is damaged: {why}", path=label)
        except BaseException:
            self.tier.abandon(slot)
            raise
        self.tier.commit(slot, step, nbytes)

    def drop_strays(self) -> None:
        """After a restore (whatever it took): the strays on this host (strays.py) removed, by
        the first rank of the host; every rank's transfers of the restore are over by then."""
        if self.ranks_here and self.ranks_here[0] == self.rank:
            strays.drop(strays.stray_folders(self.tier.directory, self.ranks_here, self.placement))

    def image(self, step: int) -> DeviceImage | None:
        """This rank's image of `step` received into device memory at this restore (checked by
        the restore as it reads it), or None: its copy is in the rank's tier."""
        return self._images.get(step)

    def forget_images(self) -> None:
        """Free the device memory of the images received (the restore is over)."""
        self._images.clear()

    def replicate_again(self, step: int) -> None:
        """After every rank restored `step`: sent again, in the background as after a save, to
        the holders that lack this rank's replica of it (their node was lost, and its replacement
        holds nothing yet): the step is on another node again before the next save."""
        lacking = [h for h in self.holders if step not in self._held_by.get(h, ())]
        self.sender.held_already(step, [h for h in self.holders if h not in lacking])
        if lacking and _has(self.tier, step):
            log.info("gdsckpt: rank %d sends its step %d again to rank(s) %s, which lost their replica of it",
                     self.rank, step, lacking)
            self.sender.submit(step, lacking)

    # ------------------------------------------------------------ reporting, closing
    def status(self, steps: list[int]) -> dict:
        """Each own step's holders and what became of its replication, the channels closed,
        the replicas held here."""
        sent = self.sender.status()
        return {"holders": self.holders, "held_for": self.origins, "node": self.nodes[self.rank],
                "steps": {s: {"replicated_on": self.sender.replicated(s), "holders": sent["steps"].get(s, {})}
                          for s in steps},
                "closed": sent["closed"], "last": sent["last"], "from_peer": dict(self.from_peer),
                "fetched": dict(self.fetched),
                "receivers_ended": {r.origin: r.ended for r in self.receivers if r.ended},
                "received": {r.origin: r.last for r in self.receivers if r.last},
                **self.store.status()}

    def close(self, timeout: float = 60.0) -> None:
        """Finish the step on the wire, tell the holders replication ends, let the receivers end
        (their origins tell them), then unmap the replicas (they stay for the next run)."""
        try:
            self.sender.close(timeout)
            for r in self.receivers:
                if not r.join(timeout):
                    log.warning("gdsckpt: rank %d's replica receiver for rank %d did not end in %.0f s", self.rank,
                                r.origin, timeout)
        finally:
            self.store.close()


def plan(every: list, firsts: list[int]) -> dict[int, dict[int, tuple[int, int, str | None]]]:
    """{step: {origin: (server, bytes, folder)}} of the steps every rank can get, and how the
    ranks whose own copy is gone get theirs: a stray copy on the rank's own host (server: the
    rank itself, adopting `folder`), else the lowest-ranked holder of its replica (folder None),
    else a stray on another host (server: the first rank of that host). `every`: each rank's (own
    steps, {origin: {step: bytes}} of the replicas it holds, {origin: {step: (bytes, folder)}} of
    the strays on its host, from the first rank of each host only); firsts[r]: the first rank
    on rank r's host."""
    world = len(every)
    steps = set()
    for own, held, found in every:
        steps.update(own)
        for copies in (*held.values(), *found.values()):
            steps.update(copies)
    out = {}
    for step in steps:
        transfers = {}
        for origin in range(world):
            if step in every[origin][0]:
                continue
            here = every[firsts[origin]][2].get(origin, {}).get(step)
            holders = [h for h in range(world) if step in every[h][1].get(origin, {})]
            elsewhere = [h for h in range(world) if step in every[h][2].get(origin, {})]
            if here is not None:
                transfers[origin] = (origin, *here)
            elif holders:
                transfers[origin] = (holders[0], every[holders[0]][1][origin][step], None)
            elif elsewhere:
                transfers[origin] = (elsewhere[0], *every[elsewhere[0]][2][origin][step])
            else:
                break
        else:
            out[step] = transfers
    return out


def _has(tier, step: int) -> bool:
    try:
        tier.copy(step)
        return True
    except KeyError:
        return False
