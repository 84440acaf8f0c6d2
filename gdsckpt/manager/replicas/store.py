"""The holder's side of peer replicas: the copies of other ranks' steps held in this host's
memory (gdsckpt/manager/replicas/wire.py brings them), one memory tier per rank held for.

    gdsckpt-<directory's name>-<hash>-r<origin>.replica-r<holder>/
        owner.json, .gdsckpt-manager.lock, slot-<n>, step_<n>.commit   as a rank's own tier
        replica.json     {"origin", "holder", "world"}: whose copies, kept by whom, in which world

Each is a gdsckpt.manager.memory.tier.MemoryTier in a folder of its own: the same ownership (the
directory's tier id: another run's replicas are removed, never restored), the same permissions
(0o700 folder, 0o600 segments), the same commit (a record written after the last byte, naming the
footer), the same drop order (the newest replica of a step on no disk is never dropped: it may be
the origin's only other copy). A replica is committed only once every chunk's checksum is checked
(reader.Checkpoint.check, on the CPU: a GPU host's GPU is training's) and its footer is the one the origin
named in its offer: bytes damaged on the wire, or a segment reused while a late send read it,
are refused. Replicas count against the rank's memory cap, with its own copies (`outside`).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable, Iterable

from gdsckpt.core.defaults import POOL_ARENA_BYTES
from gdsckpt.format import file as fmt
from gdsckpt.errors import GdsckptError, MemoryTierFullError
from gdsckpt.manager.memory.folders import REPLICA_TAG, SLOT_NAME, memory_root, tier_folder
from gdsckpt.manager.memory.source import MemorySource
from gdsckpt.manager.memory.tier import MemoryTier

log = logging.getLogger("gdsckpt.manager.replicas.wire")

INFO = "replica.json"


def replica_folder(directory: Path, origin: int, holder: int, root: Path | None = None) -> Path:
    """Where rank `holder` keeps rank `origin`'s replicas of `directory` on this host (beside the
    own tiers, never taken for one: tier_folders lists folders ending in a rank number only)."""
    own = tier_folder(directory, origin, root)
    return own.with_name(f"{own.name}{REPLICA_TAG}{holder}")


def headroom(nbytes: int) -> int:
    """The bytes a segment made for a replica of `nbytes` has beyond them: a step's compressed
    size varies a little from step to step, and a segment a few bytes too small for the next step
    would be made anew (its memory taken and page-locked again, for seconds, beside training)
    instead of reused. The file is sparse: the headroom takes no memory. Images smaller than an
    arena get none: a segment for them is quickly made."""
    return nbytes // 32 if nbytes >= POOL_ARENA_BYTES else 0


def folder_bytes(folder: Path) -> int:
    """The segments' file sizes in `folder` (what a tier counts as held), read without its lock."""
    total = 0
    try:
        with os.scandir(folder) as it:
            for e in it:
                if SLOT_NAME.match(e.name):
                    try:
                        total += e.stat().st_size
                    except OSError:
                        pass
    except OSError:
        pass
    return total


class ReplicaStore:
    """The replicas rank `rank` holds of `directory`, for ranks `origins`, in a world of `world`
    ranks. cap_bytes, keep, on_disk as the rank's own tier's; own_folder: the rank's own tier's
    folder (its bytes count against the same cap)."""

    def __init__(self, directory: Path, *, rank: int, origins: Iterable[int], world: int, cap_bytes: int,
                 keep: int, on_disk: Callable[[], Iterable[int]], own_folder: Path, root: Path | None = None):
        self.directory, self.rank, self.world = Path(directory), rank, world
        self.own_folder = own_folder
        self.refused: list[dict] = []  # offers refused or replicas found damaged, and why
        self.tiers: dict[int, MemoryTier] = {}
        root = root or memory_root()
        try:
            for origin in origins:
                folder = replica_folder(self.directory, origin, rank, root)
                tier = MemoryTier(self.directory, rank=origin, cap_bytes=cap_bytes, keep=keep, on_disk=on_disk,
                                  root=root, folder=folder, outside=lambda o=origin: self.bytes_outside(o))
                self.tiers[origin] = tier
                self._claim(tier, origin)
        except BaseException:
            self.close()
            raise

    def _claim(self, tier: MemoryTier, origin: int) -> None:
        """Write the folder's replica.json; replicas kept in a world of another size are another
        sharding's: released (the ranks restore from the directory, where DCP reshards)."""
        path = tier.folder / INFO
        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError):
            info = {}
        if info.get("world") not in (None, self.world) and tier.steps():
            log.warning("gdsckpt: the replicas of rank %d held here were saved by a world of %s ranks, and this one "
                        "has %d: they are released (a restore reads the directory, where DCP reshards)", origin,
                        info.get("world"), self.world)
            tier.release_all()
        tmp = tier.folder / f".{INFO}.{os.getpid()}"
        tmp.write_text(json.dumps({"origin": origin, "holder": self.rank, "world": self.world}))
        os.replace(tmp, path)

    def bytes_outside(self, origin: int | None) -> int:
        """Bytes under the rank's cap held outside `origin`'s replica tier (None: outside all of
        them, i.e. the replicas as seen from the rank's own tier)."""
        folders = [t.folder for o, t in self.tiers.items() if o != origin]
        if origin is not None:
            folders.append(self.own_folder)
        return sum(folder_bytes(f) for f in folders)

    def held_bytes(self) -> int:
        return self.bytes_outside(None)

    # ------------------------------------------------------------ taking a replica
    def reserve(self, origin: int, step: int, nbytes: int):
        """A slot for `origin`'s `step` (`nbytes`), or None where the cap has no room (recorded)."""
        tier = self.tiers.get(origin)
        if tier is None:
            raise GdsckptError(f"rank {self.rank} holds no replicas for rank {origin}")
        why = tier.room_for(nbytes + headroom(nbytes))
        if why is None:
            try:
                return tier.reserve(step, nbytes, headroom(nbytes))[0]
            except MemoryTierFullError as e:
                why = str(e)
        self._refuse(origin, step, f"no room: {why}")
        return None

    def abandon(self, origin: int, slot) -> None:
        self.tiers[origin].abandon(slot)

    def commit(self, origin: int, slot, step: int, nbytes: int, footer: bytes) -> bool:
        """The received image checked (every chunk, and the footer the offer named), then
        committed; whether it was (a damaged one is refused, its slot reused)."""
        tier = self.tiers[origin]
        why = check_image(slot, nbytes, footer, f"rank {origin}'s step {step} received by rank {self.rank}")
        if why is not None:
            tier.abandon(slot)
            self._refuse(origin, step, f"damaged: {why}")
            return False
        tier.commit(slot, step, nbytes)
        return True

    def _refuse(self, origin: int, step: int, why: str) -> None:
        self.refused.append({"origin": origin, "step": step, "why": why})
        del self.refused[:-100]
        log.warning("gdsckpt: rank %d does not keep rank %d's replica of step %d: %s", self.rank, origin, step, why)

    def give_room(self, fits: Callable[[], bool], on_disk: Iterable[int]) -> list[tuple[int, int]]:
        """Drop replicas until fits() (the rank's own next step has room: its own copies come
        first), those of steps on disk first, each group oldest first; never a tier's newest
        replica of a step newer than the disk's newest (maybe its origin's only other copy), nor
        one being read. The (origin, step) dropped."""
        disk = set(on_disk)
        order = []
        for origin, tier in self.tiers.items():
            steps = tier.steps()
            if steps and steps[-1] not in disk and steps[-1] > max(disk, default=-1):
                steps = steps[:-1]
            order += [(s not in disk, s, origin) for s in steps]
        dropped = []
        for _, s, origin in sorted(order):
            if fits():
                break
            if self.tiers[origin].drop(s, "room for the rank's own step"):
                self.tiers[origin].free_spares()
                dropped.append((origin, s))
        return dropped

    # ------------------------------------------------------------ what it holds
    def inventory(self) -> dict[int, dict[int, int]]:
        """{origin: {step: bytes}} of the committed replicas."""
        out = {}
        for origin, tier in self.tiers.items():
            out[origin] = {s: tier.copy(s).nbytes for s in tier.steps()}
        return out

    def status(self) -> dict:
        return {"held": {o: t.steps() for o, t in self.tiers.items()}, "held_bytes": self.held_bytes(),
                "refused": list(self.refused[-16:]),
                "dropped": [dict(d, origin=o) for o, t in self.tiers.items() for d in list(t.dropped)[-8:]]}

    def close(self) -> None:
        for tier in self.tiers.values():
            tier.close()


def check_image(slot, nbytes: int, footer: bytes | None, label: str) -> str | None:
    """None if the image of `nbytes` in `slot` ends in `footer` (None: any) and every chunk's
    checksum holds, else why not."""
    from gdsckpt import api
    if nbytes < fmt.HEADER_SIZE + fmt.FOOTER_SIZE:
        return f"{nbytes} bytes cannot hold a checkpoint"
    if footer is not None and slot.read(fmt.FOOTER_SIZE, nbytes - fmt.FOOTER_SIZE) != footer:
        return "its footer is not the one its origin sent"
    try:  # on the CPU's threads, where the image lies: the GPU is training's
        with api.open(MemorySource(slot, nbytes, label), backend="cpu") as ck:
            ck.check()
    except (GdsckptError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    return None
