"""The memory tier: a Checkpointer's newest steps held in shared memory on this host, where they
outlive the training process (a NCCL error, an OOM kill, a job preempted on a node that stays),
so that the next process on the same node restores them without reading the disk.

One folder per (checkpoint directory, rank), under /dev/shm (GDSCKPT_MEMORY_ROOT moves it):

    gdsckpt-<directory's name>-<hash of its real path>-r<rank>/
        owner.json                the directory, its tier id and the rank
        .gdsckpt-manager.lock     flock (gdsckpt/core/dirlock.py): one manager per directory and rank
        slot-<n>                  a segment (gdsckpt/manager/memory/slot.py): one step's checkpoint image,
                                  byte for byte the file it becomes
        step_00001000.commit      the step's commit record, written last

Trust (gdsckpt/manager/memory/trust.py): the folder is this user's own and no one else may write it, or
the tier refuses it (MemoryTierTrustError); a file in it that is not is removed, never read;
identity files are 0o600, and each commit record is sealed with the step and its image's footer.
A folder whose directory was moved or removed is reclaimed by the next manager of any directory
(memory_folders.reclaim_gone), unless a process holds it.

Commit: a copy counts only with its commit record, written (renamed into place) after the last
byte of the image, and only while the slot it names still holds, at the recorded length, the
footer the record carries; a restore then verifies every chunk. A slot is uncommitted (its
record removed) before a byte of another step goes into it, so a process killed while writing
leaves a slot that no record names: never restored, and removed by the next manager of the
directory and rank, which also removes records whose slot is gone or no longer matches.

Identity: the directory's tier id (DIR/.gdsckpt-memory-id, random, made by the first manager
with a memory tier) ties the copies to the directory, not to its path: a directory removed and
made again under the same path gets a new id, and the earlier run's copies are removed, never
restored into the new run. It is also the copies' lineage: a manager that writes steps without
seeing them (no memory tier, or an empty one: another host, a restart after a reboot) or rolls
back without a memory tier gives the directory a new id first (`renew_directory_id`), so that
copies of steps its own replace or abandon are another run's from then on, wherever they are.

Bounded: the tier holds at most `cap_bytes` (the slots' file sizes, an upper bound of the memory
they take; defaults.MEMORY_*), and keeps the copies its retention policy keeps where it may
(`keep`: an int n, the newest n, or a RetentionPolicy; those it lets go leave oldest first, and
where one of them is being read the oldest copy that may go leaves in its stead: the tier holds
no more copies than the policy keeps). When a new step needs room under the cap, copies go in this order: the oldest
copy whose step is also on disk, then the oldest other copy; never the newest copy while it is
the newest intact step and on no disk (the only copy), never a copy being read (`hold`: a local
write in progress). A step that finds no room
waits for such reads to end; a step larger than the cap, or one that would need the protected
copy's room, is a MemoryTierFullError (the manager then saves it to disk the ordinary way).

Ahead of need (Checkpointer.reserve): `make_spares` makes the slots the next steps will take,
as many as the tier holds without reads in progress (`keep`, counting the slots already there
that fit), within the cap beside everything held and dropping nothing; the caller takes and
page-locks their memory outside the lock and hands each back with `spare_done`, after which it
is a free slot like any other. A step that finds no free slot while one is being made waits for
it. A spare holds nothing that counts and has no commit record: close() removes it, and so does
the next manager where the process died first.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from gdsckpt.format import file as fmt
from gdsckpt.core.defaults import MEMORY_HOST_FRACTION, MEMORY_KEEP, MEMORY_SHM_FRACTION
from gdsckpt.core.dirlock import DirectoryLock
from gdsckpt.errors import MemoryTierFullError
from .folders import (
    COMMIT_NAME, OWNER, ROOT_ENV, SLOT_NAME, check_record, directory_id, memory_root, owner_of, read_record,
    reclaim_gone, renew_directory_id, tier_folder,
)
from .slot import Slot
from .trust import index_checksum, make_private, own_folder, seal, unsealed, untrusted_entry, write_private
from gdsckpt.manager.policy import RetentionPolicy, as_policy, kept

# A retention policy's spare slots (make_spares): how many of this many consecutive steps it keeps.
SPARE_PROBE = 256

log = logging.getLogger("gdsckpt.memory")

def default_cap(root: Path | None = None) -> int:
    """defaults.MEMORY_HOST_FRACTION of the host's memory, shared by this host's ranks
    (LOCAL_WORLD_SIZE, as torchrun sets it), and at most defaults.MEMORY_SHM_FRACTION of the
    shared-memory file system's size (what a container's /dev/shm allows), likewise shared."""
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    cap = None
    try:
        cap = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * MEMORY_HOST_FRACTION)
    except (ValueError, OSError, AttributeError):
        pass
    try:
        st = os.statvfs(root or memory_root())
        shm = int(st.f_blocks * st.f_frsize * MEMORY_SHM_FRACTION)
        cap = shm if cap is None else min(cap, shm)
    except OSError:
        pass
    return max(1, (cap or 0) // ranks)


@dataclass
class Copy:
    """A committed copy: `step`'s image, `nbytes` long, in `slot`, ending in `footer` (its commit
    record's, sealed with the step)."""

    step: int
    slot: Slot
    nbytes: int
    footer: bytes

    def changed(self) -> str | None:
        """None if the slot still ends in the footer committed with this step, else why not (the
        slot was overwritten or cut since: the copy is damaged)."""
        try:
            now = self.slot.read(fmt.FOOTER_SIZE, self.nbytes - fmt.FOOTER_SIZE)
        except (OSError, ValueError) as e:
            return f"its segment cannot be read ({type(e).__name__}: {e})"
        if now != self.footer:
            return f"its segment no longer ends in the footer committed with step {self.step}"
        return None



class MemoryTier:
    """The memory tier of `directory`'s rank `rank` on this host, held by this manager (a lock,
    as the directory's) until close(); what close() leaves is found by the next one.

    cap_bytes: None for default_cap(). keep: copies kept where the drop order allows (an int
    >= 1, or a RetentionPolicy; `self.keep` is then the slots made ahead of need: how many of
    SPARE_PROBE consecutive steps it keeps).
    on_disk(): the steps committed in the directory (the drop order asks it). folder: where the
    copies live (default tier_folder: the rank's own; a peer's replicas live elsewhere,
    gdsckpt/manager/replicas/store.py). outside(): bytes held under the same cap by other tiers (a rank's
    own copies and the replicas it holds share one cap)."""

    def __init__(self, directory: Path, *, rank: int = 0, cap_bytes: int | None = None,
                 keep: int | RetentionPolicy = MEMORY_KEEP,
                 on_disk: Callable[[], Iterable[int]] = tuple, root: Path | None = None, folder: Path | None = None,
                 outside: Callable[[], int] = lambda: 0):
        self.directory = Path(directory)
        self.rank = rank
        self.retention = as_policy(keep)
        self.keep = keep if isinstance(keep, int) else max(1, len(kept(keep, range(1, SPARE_PROBE + 1))))
        self._beyond = (f"more than keep_memory={keep} copies" if isinstance(keep, int)
                        else f"not kept by keep_memory={keep!r}")
        self.on_disk = on_disk
        self.outside = outside
        root = root or memory_root()
        if not root.is_dir():
            raise FileNotFoundError(f"the memory tier's root {str(root)!r} is not a directory (set {ROOT_ENV})")
        self.cap_bytes = cap_bytes if cap_bytes is not None else default_cap(root)
        self.directory.mkdir(parents=True, exist_ok=True)  # as the Checkpointer does: it holds the tier id
        self.folder = folder or tier_folder(self.directory, rank, root)
        own_folder(self.folder)  # MemoryTierTrustError where another user's, or others may write it
        self._lock = DirectoryLock(self.folder)
        self._cond = threading.Condition()
        self._copies: dict[int, Copy] = {}
        self._free: list[Slot] = []  # mapped, holding nothing that counts: reused before new ones are made
        self._writing: dict[str, tuple[int, Slot]] = {}  # slot name -> (step, slot) being written
        self._making: dict[str, Slot] = {}  # slot name -> spare slot being made ahead of need (make_spares)
        self._stopping = False  # close() or release_all() in progress: spares being made stop
        self._held: Counter = Counter()  # step -> readers (a local write): not dropped meanwhile
        self._next_slot = 0
        self.reclaimed: list[dict] = []  # what opening removed, and why
        self._ident = ""  # the directory's tier id: the key of the commit records' seals
        self.dropped: deque = deque(maxlen=100)  # the last copies dropped (room, keep_memory, release), and why
        try:
            self._open(directory_id(self.directory, create=True))
        except BaseException:
            self._lock.release()
            raise
        self._reclaim_gone(root)

    # ------------------------------------------------------------ opening: reclaim what does not count
    def _open(self, ident: str) -> None:
        self._ident = ident
        self._refuse_strays()
        owner = owner_of(self.folder)
        if owner.get("id") != ident:
            for name in os.listdir(self.folder):
                if name != self._lock.path.name:
                    if SLOT_NAME.match(name) or COMMIT_NAME.match(name):
                        self.reclaimed.append({"name": name, "why": "another run's (the directory was made anew, "
                                                                    "or its steps went on without these copies)"})
                    (self.folder / name).unlink(missing_ok=True)
            self._write_owner(ident)
        names = os.listdir(self.folder)
        named: set[str] = set()
        for name in sorted(names):
            if not COMMIT_NAME.match(name):
                continue
            rec = read_record(self.folder / name)
            why = "not a commit record" if rec is None else check_record(self.folder, rec)
            if why is None and rec["slot"] in named:
                why = f"its segment {rec['slot']} is named by another record"
            if why is None:
                why = unsealed(rec, name, ident)
                if why is not None:  # damaged as a flipped byte is: never restored, and said so
                    log.warning("gdsckpt: memory tier %s: the copy %s is damaged: %s; it is removed, not restored",
                                self.folder, name, why)
            if why is not None:
                self.reclaimed.append({"name": name, "why": why})
                (self.folder / name).unlink(missing_ok=True)
                continue
            named.add(rec["slot"])
            self._copies[int(rec["step"])] = Copy(int(rec["step"]), Slot(self.folder / rec["slot"]), int(rec["bytes"]),
                                                  bytes.fromhex(rec["footer"]))
        for name in names:
            m = SLOT_NAME.match(name)
            if m:
                self._next_slot = max(self._next_slot, int(m.group(1)) + 1)
                if name not in named:  # written by a process that died before its commit record
                    self.reclaimed.append({"name": name, "why": "torn: no commit record (its writer died)"})
                    (self.folder / name).unlink(missing_ok=True)
            elif name.startswith("."):
                if name != self._lock.path.name:
                    (self.folder / name).unlink(missing_ok=True)  # a record or owner file never renamed
        for r in self.reclaimed:
            log.info("gdsckpt: memory tier %s: removed %s (%s)", self.folder, r["name"], r["why"])

    def _refuse_strays(self) -> None:
        """Whatever in the folder is not a regular file of this user's that no one else may write
        (a file planted while the folder was open to others, a link) is removed, never read; this
        user's files that others may read are made private (an earlier version's)."""
        for name in os.listdir(self.folder):
            path = self.folder / name
            why = untrusted_entry(path)
            if why is None:
                make_private(path)
                continue
            log.warning("gdsckpt: memory tier %s: %s is %s: removed, never restored", self.folder, name, why)
            self.reclaimed.append({"name": name, "why": f"not this user's own: {why}"})
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError:  # a folder: it stays, and nothing reads it
                pass

    def _reclaim_gone(self, root: Path) -> None:
        """This user's tier folders whose directory is gone, held by no process: removed (a
        directory moved or removed would otherwise keep its copies in memory until a reboot)."""
        try:
            gone = reclaim_gone(root, beside_parent=True)
        except Exception as e:  # noqa: BLE001 - never a reason for this tier not to open
            log.warning("gdsckpt: looking for memory tiers of directories that are gone: %s: %s", type(e).__name__, e)
            return
        for t in gone:
            log.warning("gdsckpt: removed the memory copies of %s (rank %s, steps %s, %d bytes): that directory is "
                        "gone (moved or removed)", t["directory"], t["rank"], t["steps"] or "none", t["bytes"])
            self.reclaimed.append({"name": str(t["folder"]), "why": f"the copies of {t['directory']}, which is gone"})

    def _write_owner(self, ident: str) -> None:
        write_private(self.folder / OWNER, json.dumps({"directory": os.path.realpath(self.directory), "id": ident,
                                                        "rank": self.rank, "host": socket.gethostname()}))

    def renew_id(self) -> None:
        """The directory's new tier id (renew_directory_id), taken by this tier: an empty tier's
        manager writes steps that copies elsewhere of this directory never saw."""
        with self._cond:
            if self._copies:
                raise RuntimeError("a tier that holds copies continues their lineage; it does not renew it")
            self._ident = renew_directory_id(self.directory) or directory_id(self.directory, create=True)
            self._write_owner(self._ident)

    # ------------------------------------------------------------ what it holds
    def steps(self) -> list[int]:
        """Steps with a committed copy, oldest first."""
        with self._cond:
            return sorted(self._copies)

    def copy(self, step: int) -> Copy:
        with self._cond:
            return self._copies[step]

    def held_bytes(self) -> int:
        with self._cond:
            return self._held_bytes()

    def _held_bytes(self) -> int:
        return sum(s.size() for s in self._slots())

    def status(self) -> dict:
        with self._cond:
            return {"folder": str(self.folder), "cap_bytes": self.cap_bytes, "held_bytes": self._held_bytes(),
                    "keep": self.keep, "steps": sorted(self._copies),
                    "pinned_bytes": sum(s.pinned_bytes for s in self._slots()),
                    "reclaimed": list(self.reclaimed), "dropped": list(self.dropped)}

    def _slots(self) -> list[Slot]:
        return ([c.slot for c in self._copies.values()] + self._free + [s for _, s in self._writing.values()]
                + list(self._making.values()))

    # ------------------------------------------------------------ reads in progress
    def hold(self, step: int) -> Copy:
        """Keep `step`'s copy from being dropped until release(step) (KeyError: no such copy)."""
        with self._cond:
            copy = self._copies[step]
            self._held[step] += 1
            return copy

    def release(self, step: int) -> None:
        with self._cond:
            self._held[step] -= 1
            if self._held[step] <= 0:
                del self._held[step]
            self._cond.notify_all()

    # ------------------------------------------------------------ writing a step
    def reserve(self, step: int, need: int, headroom: int = 0) -> tuple[Slot, float]:
        """A slot of at least `need` bytes for `step`, uncommitted: (slot, seconds waited for room).
        Makes room in the drop order; waits while only copies being read stand in the way. A slot
        made anew has `headroom` bytes more (it may then be reused by a step a little larger).
        MemoryTierFullError where no room can be made."""
        if need > self.cap_bytes:
            raise MemoryTierFullError(f"step {step} needs {need} bytes of memory, more than the memory tier's cap "
                                      f"of {self.cap_bytes} bytes ({self.folder}): raise memory_bytes=",
                                      step=step, need=need, cap=self.cap_bytes)
        waited = 0.0
        with self._cond:
            if step in self._copies:  # the same step saved again: its copy goes first
                self._drop(step, "replaced by a new save of the same step")
            while True:
                slot = self._make_room(step, need, headroom)
                if slot is not None:
                    break
                if not self._held and not self._making:
                    newest = max(self._copies) if self._copies else None
                    raise MemoryTierFullError(
                        f"no room for step {step} ({need} bytes) in the memory tier ({self.cap_bytes} byte cap, "
                        f"{self._held_bytes()} held): step {newest}'s copy is the only copy of the newest step "
                        "and is not dropped; the cap should hold two steps", step=step, need=need, cap=self.cap_bytes)
                t = time.perf_counter()
                self._cond.wait(1.0)
                waited += time.perf_counter() - t
            self._writing[slot.name] = (step, slot)
        return slot, waited

    def room_for(self, need: int) -> str | None:
        """None if a step of `need` bytes can be given room (at once, or once the reads in progress
        end), else why not (what MemoryTierFullError would say)."""
        if need > self.cap_bytes:
            return f"{need} bytes are more than the memory tier's cap of {self.cap_bytes} bytes: raise memory_bytes="
        with self._cond:
            kept = set(self._copies) - set(self._drop_order(for_room=True)) - set(self._held)
            fixed, outside = sum(self._copies[s].slot.size() for s in kept), self.outside()
            if fixed + outside + need > self.cap_bytes:
                beside = [f"step {max(kept)}'s copy ({fixed} bytes), the only copy of the newest step"] if kept else []
                beside += [f"the peer replicas held here ({outside} bytes)"] if outside else []
                return (f"the memory tier's cap of {self.cap_bytes} bytes cannot hold {need} bytes beside "
                        f"{' and '.join(beside)}: the cap should hold two steps"
                        + (" of its own and the replicas" if outside else ""))
        return None

    def _make_room(self, step: int, need: int, headroom: int = 0) -> Slot | None:
        order = self._drop_order(for_room=False)
        self._let_go(order, incoming=step)
        order = self._drop_order(for_room=True)
        fitting = min((s for s in self._free if s.mapped >= need), key=lambda s: s.mapped, default=None)
        if fitting is None and self._making:
            return None  # slots are being made ahead of need: wait for them rather than make another
        while self._held_bytes() + self.outside() + (0 if fitting else need + headroom) > self.cap_bytes:
            spare = [s for s in self._free if s is not fitting]
            if spare:
                self._free.remove(spare[0])
                spare[0].delete()
                continue
            if not order:
                return None
            victim = order.pop(0)
            slot = self._copies[victim].slot
            self._drop(victim, f"room for step {step} under the {self.cap_bytes} byte cap")
            if fitting is None and slot.mapped >= need:
                fitting = slot
        if fitting is not None:
            self._free.remove(fitting)
            return fitting
        for spare in self._free:  # too small for this step, as for the next ones (a state keeps its size)
            spare.delete()
        self._free.clear()
        return self._new_slot(need + headroom)

    def _new_slot(self, need: int) -> Slot:
        name = f"slot-{self._next_slot}"
        self._next_slot += 1
        return Slot(self.folder / name, need)

    def _drop_order(self, for_room: bool) -> list[int]:
        """Copies that may go, in the order they go: for room, those on disk first, each group
        oldest first; beyond keep_memory, oldest first. Never the only copy of the newest
        intact step, nor a copy being read."""
        if not self._copies:
            return []
        disk = set(self.on_disk())
        newest = max(self._copies)
        protected = {newest} if newest not in disk and newest > max(disk, default=-1) else set()
        free = [s for s in sorted(self._copies) if s not in protected and s not in self._held]
        if not for_room:
            return free
        return [s for s in free if s in disk] + [s for s in free if s not in disk]

    def commit(self, slot: Slot, step: int, nbytes: int) -> None:
        """The image in `slot` (`nbytes` long) is complete: write its commit record; it counts."""
        footer = slot.read(fmt.FOOTER_SIZE, nbytes - fmt.FOOTER_SIZE)
        rec = {"step": step, "slot": slot.name, "bytes": nbytes, "footer": footer.hex(),
               "index_checksum": index_checksum(footer.hex()), "pid": os.getpid(), "host": socket.gethostname(),
               "time": time.time()}
        with self._cond:
            ident = self._ident
        rec["seal"] = seal(ident, step, slot.name, nbytes, footer.hex())
        write_private(self.folder / _record_name(step), json.dumps(rec))
        with self._cond:
            self._writing.pop(slot.name, None)
            self._copies[step] = Copy(step, slot, nbytes, footer)
            self._cond.notify_all()
        self.trim()

    def abandon(self, slot: Slot) -> None:
        """A write into `slot` failed: it holds nothing that counts, and is reused."""
        with self._cond:
            self._writing.pop(slot.name, None)
            self._free.append(slot)
            self._cond.notify_all()

    # ------------------------------------------------------------ slots ahead of need
    def make_spares(self, need: int) -> list[Slot]:
        """Slots of `need` bytes for the next steps, made now (their files) and the caller's
        until spare_done(): as many as bring the slots that fit `need` (copies, free ones, those
        being written or made) to `keep`, each only where the cap holds it beside everything
        held; none where enough are there. Drops nothing."""
        made = []
        with self._cond:
            while (not self._stopping and sum(s.mapped >= need for s in self._slots()) < self.keep
                   and self._held_bytes() + self.outside() + need <= self.cap_bytes):
                slot = self._new_slot(need)
                self._making[slot.name] = slot
                made.append(slot)
        return made

    def spare_done(self, slot: Slot, ready: bool) -> None:
        """A slot from make_spares is made (ready: its memory taken and page-locked): a free slot
        from now on; not ready (failed, or stopped short), or the tier closing: removed."""
        with self._cond:
            del self._making[slot.name]
            if ready and not self._stopping:
                self._free.append(slot)
            else:
                slot.delete()
            self._cond.notify_all()

    def stopping(self) -> bool:
        """Whether slots being made should stop (close() or release_all() waits for them)."""
        return self._stopping

    def _stop_making(self) -> None:
        """Under the lock: stop the spares being made and wait until none is left."""
        self._stopping = True
        while self._making:
            self._cond.wait(1.0)

    # ------------------------------------------------------------ letting copies go
    def trim(self) -> list[int]:
        """Drop copies beyond `keep`, in the drop order, where they may go (after a commit, or once
        a step reached the disk); the steps dropped."""
        with self._cond:
            return self._let_go(self._drop_order(for_room=False))

    def _let_go(self, order: list[int], incoming: int | None = None) -> list[int]:
        """Under the lock: while the copies (and the step `incoming`, about to be one) are more than
        the retention policy keeps (the newest always counted kept), drop the first of `order` (the
        copies that may go) it lets go, or, where none of those may go, the first of `order`."""
        out = []
        while order:
            steps = sorted(set(self._copies) | ({incoming} if incoming is not None else set()))
            keeping = kept(self.retention, steps) | {steps[-1]}
            if len(steps) <= len(keeping):
                break
            s = next((s for s in order if s not in keeping), order[0])
            order.remove(s)
            self._drop(s, self._beyond)
            out.append(s)
        return out

    def drop(self, step: int, why: str) -> bool:
        """Drop `step`'s copy now (a damaged one, say), unless it is being read; whether it went."""
        with self._cond:
            if step not in self._copies or step in self._held:
                return False
            self._drop(step, why)
            return True

    def _drop(self, step: int, why: str) -> None:
        copy = self._copies.pop(step)
        (self.folder / _record_name(step)).unlink(missing_ok=True)  # uncommitted before anything else
        self._free.append(copy.slot)
        self.dropped.append({"step": step, "why": why, "time": time.time()})
        log.info("gdsckpt: memory copy of step %d dropped (%s)", step, why)

    def free_spares(self) -> int:
        """Remove the slots that hold nothing (kept for reuse): their memory goes back to the
        system, for another tier under the same cap; the bytes freed."""
        with self._cond:
            freed = sum(slot.size() for slot in self._free)
            for slot in self._free:
                slot.delete()
            self._free.clear()
            return freed

    def release_all(self) -> int:
        """Free every copy and slot (waiting for reads in progress); the bytes freed."""
        with self._cond:
            try:
                self._stop_making()
                while self._held:
                    self._cond.wait(1.0)
                freed = 0
                for step in sorted(self._copies):
                    self._drop(step, "released")
                for slot in self._free:
                    freed += slot.size()
                    slot.delete()
                self._free.clear()
                return freed
            finally:
                self._stopping = False

    def close(self) -> None:
        """Unmap everything and release the lock; the committed copies stay for the next manager,
        slots holding nothing are removed, and so is the folder if no copy is left."""
        with self._cond:
            self._stop_making()
            for slot in self._free:
                slot.delete()
            self._free.clear()
            for _, slot in list(self._writing.values()):
                slot.delete()  # never committed: a save still writing when the manager closed
            self._writing.clear()
            for copy in self._copies.values():
                copy.slot.close()
            empty = not self._copies
            self._copies.clear()
        if empty:  # nothing for a next manager: no folder left behind (the lock file last, while held)
            for name in os.listdir(self.folder):
                if name != self._lock.path.name:
                    (self.folder / name).unlink(missing_ok=True)
            self._lock.path.unlink(missing_ok=True)
            try:
                self.folder.rmdir()
            except OSError:  # a manager started meanwhile made its lock file: the folder is its
                pass
        self._lock.release()


def _record_name(step: int) -> str:
    return f"step_{step:08d}.commit"
