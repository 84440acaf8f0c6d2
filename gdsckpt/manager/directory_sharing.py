"""Which ranks see the same checkpoint directory, found by looking (a collective at open).

Under torch.distributed the Checkpointer's directory is DCP's: every rank writes its files into
the step's folder and rank 0 alone writes the .metadata that names them all, so a step there can
be restored only by ranks that see every rank's files. A directory on each node's own disk (one
path, another disk per node) does not: each node's folder holds its ranks' files only. Nothing in
a path says which it is, so each rank leaves a file of its own in the directory and looks for the
others'. Where the directory is node-local, its steps restore on no rank unless downloaded onto
every node; each directory's first rank uploads its part (remote/parts.py); rank 0's retention
decides, and each other directory follows it (docs/replicas.md).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("gdsckpt.manager.directory_sharing")

_PROBE_PREFIX = ".gdsckpt-probe-"
_PROBE = _PROBE_PREFIX + "{token}-r{rank}"
STALE_PROBE_S = 3600.0


def ranks_sharing(directory: Path) -> list[list[int]] | None:
    """For every rank, the ranks whose files it sees in its `directory` (itself among them); None
    where some rank could not leave its file there (a directory it cannot write: nothing is
    known). A collective on the default group: every rank calls it, on the caller's thread."""
    import torch.distributed as dist
    token = [secrets.token_hex(8) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    rank, world = dist.get_rank(), dist.get_world_size()
    prefix = _PROBE.format(token=token[0], rank="")
    mine = directory / _PROBE.format(token=token[0], rank=rank)
    try:
        mine.touch(exist_ok=False)
        made = True
    except OSError:
        made = False
    dist.barrier()
    # The common case asks one stat of each rank: does it see rank 0's file? Only where some rank
    # does not, each lists the directory for the others'.
    every = [None] * world
    dist.all_gather_object(every, made and (directory / _PROBE.format(token=token[0], rank=0)).exists())
    if all(every):
        every = [list(range(world))] * world
    else:
        seen = None
        if made:
            try:
                seen = sorted(int(e.name[len(prefix):]) for e in os.scandir(directory) if e.name.startswith(prefix))
            except (OSError, ValueError):
                seen = None
        dist.all_gather_object(every, seen)
    dist.barrier()  # every rank has looked: its file may go
    if made:
        mine.unlink(missing_ok=True)
        if rank == min(every[rank] or [rank]):  # one rank of each directory
            _remove_stale_probes(directory)
    return None if any(s is None for s in every) else every


def _remove_stale_probes(directory: Path) -> None:
    """Probe files older than STALE_PROBE_S: left by an open killed between its file and the
    barrier (another job opening the directory now would be a concurrent open, its files new).
    The other ranks' files of this open may be going meanwhile: each looked at on its own."""
    now = time.time()
    try:
        names = [e.name for e in os.scandir(directory) if e.name.startswith(_PROBE_PREFIX)]
    except OSError:
        return
    for name in names:
        path = directory / name
        try:
            if now - path.stat().st_mtime > STALE_PROBE_S:
                log.info("gdsckpt: removing %s, left by an open of %s that was killed", name, directory)
                path.unlink()
        except OSError:  # gone already
            continue


@dataclass(frozen=True)
class DirectorySharing:
    """`groups[r]`: the ranks that see rank r's directory (None: not known, taken as shared)."""

    rank: int
    groups: list[list[int]] | None = None

    @property
    def node_local(self) -> bool:
        """Whether some rank does not see every rank's files."""
        return self.groups is not None and any(len(g) != len(self.groups) for g in self.groups)

    @property
    def leads(self) -> bool:
        """Whether this rank is the first of those that see its directory (shared: rank 0): the
        one that locks, uploads and downloads it."""
        return self.rank == (min(self.groups[self.rank]) if self.node_local else 0)

    @property
    def leaders(self) -> list[int]:
        """The first rank of each directory."""
        return sorted({min(g) for g in self.groups}) if self.node_local else [0]

    def restorable(self, layout, local: set[int]) -> tuple[set[int], dict[int, str]]:
        """A collective where the directory is node-local: of rank 0's steps `local`, those
        committed in every rank's directory (downloaded onto every node), and {step: why} of the
        others, which no rank restores (a save of that number replaces them)."""
        import torch.distributed as dist
        if not self.node_local:
            return local, {}
        every = [None] * len(self.groups)
        dist.all_gather_object(every, set(layout.local_steps()))
        everywhere = set.intersection(*every)
        return local & everywhere, {s: "not in every node's directory" for s in local - everywhere}

    def describe(self) -> str | None:
        """'ranks [0, 1] | [2, 3]': the groups of ranks that share a directory; None where it is shared."""
        if not self.node_local:
            return None
        return "ranks " + " | ".join(str(list(g)) for g in sorted({tuple(g) for g in self.groups}))

    def why_not_restored(self) -> str:
        """What a NoCheckpointError adds where the directory is node-local."""
        return (f" (the ranks do not share the directory: {self.describe()} see the same one, so no rank "
                "restores a step from it)") if self.node_local else ""

    def warn(self, directory: Path, remote: bool) -> None:
        """Rank 0's word, once at open, on what a node-local directory does."""
        if not (self.node_local and self.rank == 0):
            return
        if remote:
            log.info("gdsckpt: the ranks do not share %s (%s see the same one): each node uploads its part of a "
                     "step, rank 0 commits it on the store; a restore takes memory, peers, then the store",
                     directory, self.describe())
        else:
            log.warning("gdsckpt: the ranks do not share %s (%s see the same one): a DCP step written there can "
                        "be restored by no rank, as rank 0's .metadata names files on other nodes, and there is "
                        "no remote tier: steps restore from memory alone (replicas=1 survives a node). Give a "
                        "directory every rank sees, or remote=, for steps that outlive the nodes", directory,
                        self.describe())

    def newest_everywhere(self, layout, deleting: threading.Lock) -> int | None:
        """A collective at open: rank 0's newest step, if every directory has a folder of it (the
        step a restarted run uploads again: a node replaced since has no part of it to send)."""
        import torch.distributed as dist
        found = self.owners_steps(layout, -1, deleting)
        if not found:
            return None
        every = [None] * len(self.groups)
        dist.all_gather_object(every, layout.path(found[-1]).is_dir())
        return found[-1] if all(every) else None

    def owners_steps(self, layout, saving: int, deleting: threading.Lock) -> list[int]:
        """A collective, at the save of step `saving`: rank 0's committed steps, which every rank
        then weighs alike. In each directory rank 0 does not see, its first rank removes the
        folders of the steps rank 0 does not hold (retention or a rollback removed them there),
        but for those between rank 0's newest and `saving`, which may still be being written
        (the memory tier's writes to the directory)."""
        import torch.distributed as dist
        seen = [layout.local_steps() if self.rank == 0 else None]
        dist.broadcast_object_list(seen, src=0)
        found = seen[0]
        newest = found[-1] if found else -1
        if 0 not in self.groups[self.rank] and self.leads:
            with deleting:
                for step in layout.folders():
                    if step not in found and not newest < step < saving:
                        log.info("gdsckpt: removing %s: rank 0 does not hold step %d", layout.path(step), step)
                        layout.delete(step)
        return found
