"""Copies a job's ranks left on a host under other rank numbers: found by their origin at a restore.

A memory copy is named by the rank that saved it (`<prefix>-r<rank>`, a replica
`<prefix>-r<origin>.replica-r<holder>`: gdsckpt/manager/memory/folders.py). A job restarted after
a node loss is not always numbered as it was: torchrun's rendezvous numbers the nodes in the
order of their host names, so a replacement whose name sorts elsewhere moves the survivors' group
ranks (SLURM's node ids follow the same order). Rank r's copies then lie on a host that now runs
other ranks, under folders no rank of the new numbering opens as its own tier or as a replica
it holds: strays. They are still rank r's copies (a rank's state is its shard, whoever runs it),
so a restore takes them by origin: the rank they belong to adopts one on its own host, else a
rank of the host that has it sends it (replicas/restore.py).

After the restore the strays belong to a past numbering: no save of the new one writes them,
and they count against no cap, so the restore removes them (`drop`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from typing import Mapping, Sequence

from gdsckpt.core.dirlock import DirectoryLock
from gdsckpt.errors import CheckpointLockedError
from gdsckpt.manager.memory.folders import (directory_id, empty_folder, list_copies, list_replicas, memory_root,
                                            owner_of, replica_folders, tier_folder, tier_folders, trusted)

from .placement import held_for
from .store import INFO, replica_folder

log = logging.getLogger("gdsckpt.manager.replicas.wire")


def host_key() -> tuple[str, str]:
    """What ranks sharing this process's memory share: the host and the memory root."""
    return socket.gethostname(), os.path.realpath(memory_root())


def in_use(directory: Path, ranks_here: Sequence[int], placement: Mapping[int, Sequence[int]]) -> set[Path]:
    """The folders the ranks `ranks_here` (this host's, in the current numbering) open: their own
    tiers and the replicas the placement gives them."""
    own = {tier_folder(directory, r) for r in ranks_here}
    return own | {replica_folder(directory, o, h) for h in ranks_here for o in held_for(placement, h)}


def stray_copies(directory: Path, ranks_here: Sequence[int], placement: Mapping[int, Sequence[int]],
                 world: int) -> tuple[dict[int, dict[int, tuple[int, str]]], list[int]]:
    """({origin: {step: (bytes, folder)}} of the intact committed copies on this host that no rank
    of the current numbering opens, of origins this world has; the sizes of other worlds whose
    replicas are kept here). A replica kept in a world of another size is another sharding's, and
    left out (its holder's store releases those)."""
    used = in_use(directory, ranks_here, placement)
    out: dict[int, dict[int, tuple[int, str]]] = {}
    others: set[int] = set()
    for rec in list_copies(directory) + list_replicas(directory):
        folder = Path(rec["folder"])
        if "holder" in rec and (w := _world_of(folder)) not in (None, world):
            others.add(w)
            continue
        if folder in used or rec["damaged"] is not None or not 0 <= rec["rank"] < world:
            continue
        out.setdefault(rec["rank"], {}).setdefault(rec["step"], (rec["bytes"], str(folder)))
    return out, sorted(others)


def _world_of(folder: Path) -> int | None:
    try:
        return json.loads((folder / INFO).read_text()).get("world")
    except (OSError, ValueError):
        return None


def stray_folders(directory: Path, ranks_here: Sequence[int], placement: Mapping[int, Sequence[int]]) -> list[Path]:
    """Every folder of `directory` on this host (this user's, this directory's tier id), own tier
    or replica, that no rank of the current numbering opens: with copies or not (a folder's
    segments hold memory either way)."""
    ident = directory_id(directory, create=False)
    folders = [*tier_folders(directory).values(), *replica_folders(directory).values()]
    used = in_use(directory, ranks_here, placement)
    return sorted(f for f in folders if f not in used and ident is not None and trusted(f) is not None
                  and owner_of(f).get("id") == ident)


def drop(folders: Sequence[Path]) -> None:
    """Remove `folders` (strays, after a restore), each once no process holds it."""
    for folder in folders:
        try:
            lock = DirectoryLock(folder)
        except (CheckpointLockedError, FileNotFoundError):
            continue
        try:
            held, steps = empty_folder(folder)
        finally:
            lock.release()
        log.warning("gdsckpt: removed %s (steps %s, %.2f GB): memory copies left under another numbering of the "
                    "job's ranks, which this restore has left behind", folder, steps, held / 1e9)
