"""A Checkpointer's memory tier: Checkpointer(directory, memory=True, every_local=N).

* every save lands in shared memory (gdsckpt/manager/memory/tier.py, memory_snapshot.py): save_async's
  compressed snapshot, taken into a slot of the tier instead of the pinned pool, committed there
  when the snapshot ends; the step then counts, for a restore on this host;
* the 1st, (1 + N)th, (1 + 2N)th ... step saved is also written to the directory from its memory
  copy (gdsckpt/manager/memory/local_writes.py: one write at a time, the newest waiting one only: a disk that
  cannot keep up has its writes coalesced, not queued); steps in memory only are not on disk.
  The manager's uploads follow the steps written to the directory;
* a step that finds no room in memory (larger than the cap, or the newest copy is the only copy
  and there is no room beside it) is saved to the directory as without the tier, and status()
  says so;
* restore reads the newest copy through memory_source.MemorySource, every chunk verified, and
  falls back to the directory and the store as for a damaged file (the damaged copy is dropped).

Under torch.distributed (a DcpSteps layout) each rank holds its own shards in its own tier
(gdsckpt/manager/memory/ranks.py); a step due in the directory is a DCP checkpoint, saved as without the
tier and not also held in memory (one snapshot per step); a memory step is restored only when
every rank holds it and can read it into its shards (the ranks agree, and fall back together),
and a copy some rank lacks (a rank killed while saving the step) is dropped where it is, at open
and at every restore, so that it counts as committed on no rank;
a rank without room for a step keeps none of it (a warning; no rank saves to the directory
alone), and close() writes no memory-only step (no rank can make a DCP checkpoint of it alone).
With replicas=k each memory step is also sent to k ranks on other nodes (gdsckpt/manager/replicas/restore.py),
and a restore takes a step every rank can get from its own copy or a holder's.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from concurrent.futures import Future
from typing import Callable, Iterator

from gdsckpt.errors import CheckpointFormatError, MemoryTierFullError, StateMismatchError
from .local_writes import LocalWrites
from gdsckpt.format.file import HEADER_SIZE
from .snapshot import INDEX_ALLOWANCE, INDEX_PER_ENTRY, MemoryTarget
from .source import MemorySource
from gdsckpt.reading.sources import DeviceImage
from .tier import MemoryTier
from gdsckpt.writing.snapshot.overlap import may_fence
from gdsckpt.manager.steps import DAMAGE, StepLayout, agreed, async_options

log = logging.getLogger("gdsckpt.manager.checkpointer")

# A save's room in memory estimated from its tensors (before the plan exists): their bytes, a
# 4 KiB record boundary and two index entries each, the header and the index's allowance
# (memory_snapshot.slot_bytes for one chunk per tensor, the most a plan takes).
_PER_TENSOR = 4096 + 2 * INDEX_PER_ENTRY


class MemorySteps:
    """The memory tier of a Checkpointer's `layout` (its directory, this rank).
    on_local_commit(step): a step is committed in the directory (the manager's uploads and
    retention follow). replicas, node, placement: peer replicas (peer_replicas.PeerReplicas)."""

    def __init__(self, layout: StepLayout, *, rank: int, every_local: int, cap_bytes: int | None, keep: int,
                 save_options: dict, on_local_commit: Callable[[int], None], replicas: int = 0, node=None,
                 placement=None):
        self.layout = layout
        self.distributed = layout.distributed
        self.every_local = every_local
        self.save_options = save_options
        self._on_local_commit = on_local_commit
        if replicas and not self.distributed:
            raise ValueError("replicas= keeps copies on other nodes' ranks: it needs torch.distributed")
        self.peers = None
        self.tier = MemoryTier(layout.directory, rank=rank, cap_bytes=cap_bytes, keep=keep,
                               on_disk=layout.local_steps,
                               outside=lambda: self.peers.held_bytes() if self.peers is not None else 0)
        if replicas:
            from gdsckpt.manager.replicas.restore import PeerReplicas
            try:
                self.peers = PeerReplicas(self.tier, replicas=replicas, node=node, placement=placement, keep=keep,
                                          on_disk=layout.local_steps)
            except BaseException:
                self.tier.close()
                raise
        self.writes = LocalWrites(self.tier, layout.path, self._written)
        self._saves = 0
        self._need: int | None = None  # the last step's room in memory
        self.fallbacks: deque = deque(maxlen=100)  # the last steps not held in memory, and why

    def steps(self) -> list[int]:
        return self.tier.steps()

    # ------------------------------------------------------------ saving
    def save_async(self, step: int, state, optimizer) -> Future:
        """`step` into memory (its future: committed there), written to the directory if due;
        or, with no room in memory, to the directory as without the tier (its future: committed
        there)."""
        from gdsckpt.writing.async_save import save_async
        local = self.next_is_local()
        self._saves += 1
        if self.distributed and local:  # a DCP checkpoint, every rank's
            return _then(self.layout.save_async(step, state, optimizer), lambda: self._written(step))
        # The overlap and device modes' snapshot reserves its room on a thread of its own, where no
        # fall-back to the directory can run: their room is checked against this very state.
        options = async_options(self.save_options, optimizer)
        threaded = options.get("snapshot", "host") != "host" or (  # or an overlap save_async infers
            optimizer is None and "snapshot" not in options and may_fence(state))
        if self.peers is not None:  # the rank's own step before the replicas it holds (they share the cap)
            shards = memory_dcp().snapshot(state)  # the tensors saved (the state holds modules, optimizers)
            self.peers.store.give_room(lambda: self._no_room(shards) is None, self.layout.local_steps())
        why = None if self.distributed else self._no_room(state, every_time=threaded)
        if why is None:
            try:
                what = memory_dcp().snapshot(state) if self.distributed else state
                fut = save_async(what, self.layout.path(step), memory=MemoryTarget(self.tier, step),
                                 **async_options(self.save_options, optimizer))
            except MemoryTierFullError as e:  # found when the plan was known: nothing was taken
                why = str(e)
            else:
                return _then(fut, lambda: self._committed(step, local))
        if self.distributed:  # this rank alone cannot save to the directory: the step is not kept here
            self.fallbacks.append({"step": step, "why": f"not kept on this rank: {why}"})
            log.warning("gdsckpt: step %d is not kept in rank %d's memory tier: %s", step, self.tier.rank, why)
            from gdsckpt.writing.async_save import SaveFuture
            out = SaveFuture()
            out.set_exception(MemoryTierFullError(why, step=step))
            out.observed = True  # said here; a restore from memory of this step falls back on every rank
            return out
        self.fallbacks.append({"step": step, "why": why})
        (log.warning if len(self.fallbacks) == 1 else log.info)(  # said once; status() keeps saying it
            "gdsckpt: step %d is saved to %s, not held in memory: %s", step, self.layout.directory, why)
        return _then(self.layout.save_async(step, state, optimizer), lambda: self._written(step))

    def reserve(self, state, wait: bool) -> Future:
        """The next steps' room made ahead of need (Checkpointer.reserve): the tier's slots and
        those of the replicas it holds for its peers, made and page-locked on a background thread
        (reserve.reserve_memory), so that neither is made beside training; where the tier has no
        room for the state (its steps go to the directory as without the tier), save_async's pool."""
        from .snapshot import slot_bytes
        from gdsckpt.writing.reserve import in_background, plan_for, reserve_memory, reserve_planned
        what = memory_dcp().snapshot(state) if self.distributed else state
        planned = plan_for(what, self.save_options)
        if not self.distributed and self.tier.room_for(slot_bytes(planned.plan)) is not None:
            return reserve_planned(planned, None, wait)  # planned once: `what` is `state` here
        replicas = tuple(self.peers.store.tiers.values()) if self.peers is not None else ()
        return in_background(lambda stop: reserve_memory(self.tier, planned, stop, replicas), planned.device, wait)

    def next_is_local(self) -> bool:
        """Whether the next save is also written to the directory: the 1st, (1 + every_local)th, ..."""
        return self._saves % self.every_local == 0

    def _no_room(self, state, every_time: bool = False) -> str | None:
        """Why the tier has no room for a snapshot of `state`, or None: by the last step's slot
        (a state grows: AdamW's moments come with its first step), and by an estimate from the
        tensors on the first save or `every_time`."""
        need = self._need
        if need is None or every_time:
            from gdsckpt.format.tree import flatten
            try:
                _, leaves = flatten(state)
            except Exception:  # noqa: BLE001 - save_async says what is wrong with the state
                return None
            estimate = HEADER_SIZE + INDEX_ALLOWANCE + sum(leaf.tensor.nbytes + _PER_TENSOR for leaf in leaves)
            need = max(need or 0, estimate)
        return self.tier.room_for(need)

    def _committed(self, step: int, local: bool) -> None:
        try:
            self._need = self.tier.copy(step).slot.mapped
        except KeyError:
            pass
        if local:
            self.writes.submit(step)
        if self.peers is not None:
            self.peers.submit(step)

    def _written(self, step: int) -> None:
        self.tier.trim()  # its copy is on disk now: it may go if beyond keep_memory
        self._on_local_commit(step)

    def when_written(self, step: int) -> Future:
        """A Future of `step`'s write to the directory (local_writes.LocalWrites.when_written)."""
        return self.writes.when_written(step)

    def wait_local(self, timeout: float | None = None) -> bool:
        """Until every local write due has ended."""
        return self.writes.wait(timeout)

    # ------------------------------------------------------------ restoring
    def restorable(self) -> list[int]:
        """Steps a restore may take from memory: this process's copies; under torch.distributed,
        those every rank holds (agree(): the others' copies are dropped)."""
        return self.agree() if self.distributed else self.tier.steps()

    def agree(self) -> list[int]:
        """Under torch.distributed, a collective (at open and at every restore): the steps every
        rank holds a copy of. This rank's copies of other steps are dropped, as no rank restores
        them from memory (a rank killed while saving the step, a rank without room for it): a
        step the ranks agreed not to restore counts as committed on none of them, so that the
        next save of its number runs on every rank (kept, it was refused as already committed on
        the rank that held it alone, while the others went on into the save's collectives)."""
        import torch.distributed as dist
        mine = self.tier.steps()
        every = [None] * dist.get_world_size()
        if self.peers is not None:  # from its own copy or a peer's replica
            return self.peers.restorable(mine)
        dist.all_gather_object(every, mine)
        common = set.intersection(*(set(s) for s in every))
        for step in mine:
            if step not in common:
                why = f"rank(s) {[r for r, s in enumerate(every) if step not in s]} hold no copy of it, " \
                      "so no rank restores it from memory"
                if self.tier.drop(step, why):
                    log.warning("gdsckpt: rank %d's memory copy of step %d is dropped: %s", self.tier.rank, step, why)
        return sorted(common)

    def load(self, step: int, state, device, strict: bool) -> tuple[object, str, object]:
        """(state, label, stats) of `step` restored from memory; DAMAGE where it cannot be (under
        torch.distributed: on every rank, when any rank cannot). Under torch.distributed every
        rank first checks its copy (every chunk's checksum, Checkpoint.check) and all agree before
        any rank's state is written: a copy damaged on one rank leaves every rank's state as it was."""
        if not self.distributed:
            with self.reading(step) as source:
                out, stats = self.layout.load(source, state, device, strict)
                return out, source.label, stats
        label = f"memory copy of step {step}"
        try:
            if self.peers is not None and self.peers.needs_fetch(step):  # ranks whose copy is gone get it first
                with agreed(label, f"step {step} from a peer's replica",
                            damage=(*DAMAGE, KeyError, MemoryTierFullError)):
                    self.peers.fetch(step)
            return self._load_agreed(step, state, strict, label)
        finally:
            if self.peers is not None:
                self.peers.forget_images()

    def _load_agreed(self, step: int, state, strict: bool, label: str) -> tuple[object, str, object]:
        from gdsckpt import api
        stats = None
        with agreed(label, f"step {step} from memory", damage=(*DAMAGE, StateMismatchError, KeyError)) as mine:
            with self.reading(step) as source:
                label = mine.label = source.label
                with api.open(source) as ck:
                    ck.check()  # at the read's rate: the GPU's checksum kernel where the load runs there
        # every rank's copy is intact: a failure now (the state does not match) may leave the
        # state of the ranks that did not fail filled with this step
        with agreed(label, f"step {step} from memory", damage=(*DAMAGE, StateMismatchError, KeyError),
                    filled=f"; the state of rank(s) {{filled}} holds step {step} now") as mine:
            with self.reading(step) as source:
                stats = memory_dcp().load_rank(source, state, strict)
        return state, label, stats

    @contextlib.contextmanager
    def reading(self, step: int) -> Iterator[MemorySource | DeviceImage]:
        """`step`'s copy as a reader's source, not dropped meanwhile (an image received from a
        peer into device memory at this restore, where there is one)."""
        image = self.peers.image(step) if self.peers is not None else None
        if image is not None:
            yield image
            return
        copy = self.tier.hold(step)
        try:
            label = f"memory copy of step {step} ({copy.slot.path})"
            why = copy.changed()  # the image committed with this step, not another one put in its slot
            if why is not None:
                raise CheckpointFormatError(why, path=label)
            yield MemorySource(copy.slot, copy.nbytes, label)
        finally:
            self.tier.release(step)

    def restored(self, step: int) -> None:
        """Under torch.distributed, after every rank restored `step` as the newest it could get (-1:
        none, the run starts afresh): copies of later steps (some rank could not get them: its
        node was lost, say), and the replicas held of them, belong to a past the run leaves;
        dropped, so that the steps saved next under their numbers never meet them (nor a restore
        mix the two). `step` itself goes again to the holders that lost their replica of it."""
        if not self.distributed:
            return
        tiers = [self.tier] + (list(self.peers.store.tiers.values()) if self.peers is not None else [])
        for tier in tiers:
            for s in tier.steps():
                if s > step:
                    tier.drop(s, f"newer than step {step}, which every rank restored (not every rank could get it)")
        if self.peers is not None:  # copies left under another numbering of the ranks: a past too
            self.peers.drop_strays()
            if step >= 0:  # the holders on a replacement node hold nothing yet
                self.peers.replicate_again(step)

    def source_of(self, step: int) -> str:
        """Where this rank's copy of a step restored from memory came from: "peer" (received from
        a holder of its replica at this restore) or "memory"."""
        return "peer" if self.peers is not None and step in self.peers.from_peer else "memory"

    def wait_replicas(self, timeout: float | None = None) -> bool:
        """Until the step being replicated is acknowledged, refused or failed (True without replicas)."""
        return self.peers.wait(timeout) if self.peers is not None else True

    def damaged(self, step: int, why: str) -> None:
        self.tier.drop(step, f"damaged: {why}")

    # ------------------------------------------------------------ letting go
    def drop_newer_than(self, step: int) -> list[int]:
        """A rollback: the copies of steps after `step` go (after the local writes in progress)."""
        self.writes.wait()
        gone = [s for s in self.tier.steps() if s > step]
        for s in gone:
            self.tier.drop(s, f"rollback to step {step}")
        if self.peers is not None:  # every rank rolls back: the replicas it holds of later steps go too
            self.peers.wait()
            for tier in self.peers.store.tiers.values():
                for s in tier.steps():
                    if s > step:
                        tier.drop(s, f"rollback to step {step}")
        return gone

    def release(self) -> int:
        """Free every memory copy (after the local writes in progress); the bytes freed."""
        self.writes.wait()
        only = sorted(set(self.tier.steps()) - set(self.layout.local_steps()))
        if only:
            log.warning("gdsckpt: releasing the memory tier drops step(s) %s, which are in memory only", only)
        return self.tier.release_all()

    def close(self, flush: bool = True) -> None:
        """Finish the local writes; flush: the newest step too, if only memory holds it and it is
        newer than the directory's newest (its write's error raised). Then unmap (the copies stay
        for the next manager)."""
        try:
            self.writes.wait()
            if flush and not self.distributed:
                copies, local = self.tier.steps(), self.layout.local_steps()
                if copies and copies[-1] > max(local, default=-1):
                    written = self.writes.when_written(copies[-1])
                    self.writes.submit(copies[-1])
                    self.writes.wait()
                    written.result()  # a failed write raised (its copy stays for the next manager)
        finally:
            try:
                if self.peers is not None:
                    self.peers.close()
            finally:
                self.tier.close()

    def status(self) -> dict:
        st = self.tier.status()
        writes = self.writes.status()
        st.update(every_local=self.every_local, local_writes=writes, coalesced=writes["coalesced"],
                  fallbacks=list(self.fallbacks))
        if self.peers is not None:
            st["replicas"] = self.peers.status(st["steps"])
        return st


def _then(fut: Future, after) -> Future:
    """A SaveFuture with `fut`'s outcome, completed once after() has run (after a success): a
    caller that waits for it finds the step's local write submitted. `fut`'s failure is the new
    future's to report (async_save does not raise it again as unseen)."""
    from gdsckpt.writing.async_save import SaveFuture
    out = SaveFuture()
    out.set_running_or_notify_cancel()

    def relay(f):
        err = Future.exception(f)
        if err is not None:
            f.observed = True
            out.set_exception(err)
            return
        try:
            after()
        except Exception as e:  # noqa: BLE001 - the step is committed: its local write is what failed
            log.warning("gdsckpt: after committing step: %s: %s", type(e).__name__, e)
        out.set_result(Future.result(f))
    fut.add_done_callback(relay)
    return out


def memory_dcp():
    """gdsckpt.manager.memory.ranks, imported when torch.distributed is in use (it imports its checkpoint
    package)."""
    from . import ranks as module
    return module
