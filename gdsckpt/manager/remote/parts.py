"""Uploads from node-local directories: each node sends its part, rank 0 commits the step.

Where each node has a directory of its own (gdsckpt/manager/directory_sharing.py), a DCP step is
spread over them: every node's folder holds its ranks' files, and rank 0's the .metadata too.
The first rank of each directory uploads its folder's files, verified as any upload, then a
part record under the step (`step_.../.part-rN.json`: a Marker of those files). Rank 0 uploads
its own, then waits for every other directory's part record, checks that together they hold
every file the step's .metadata names, and writes the step's marker over all of them, its
commit point on the store (remote/marker.py); the part records go after it. A part that does
not come within PART_WAIT_S fails the attempt (retried, or overtaken by a newer step), and a
step committed nowhere counts nowhere.
"""

from __future__ import annotations

import time
from pathlib import Path

from gdsckpt.errors import CheckpointFormatError, RemoteNotFoundError
from gdsckpt.stores import Store
from .marker import MARKER, Marker, parse_marker
from ..steps import DCP_METADATA, SUFFIX, dcp_files

PART_WAIT_S = 300.0  # how long rank 0 waits for the other directories' parts of a step


def part_name(step_name: str, leader: int) -> str:
    return f"{step_name}/.part-r{leader}.json"


class NodeLocalParts:
    """The uploads of node-local directories, on the first rank of a directory (`rank`, the one
    that uploads it); `leaders`: the first rank of every directory."""

    def __init__(self, rank: int, leaders: list[int]):
        self.rank, self.leaders = rank, sorted(leaders)

    @property
    def commits(self) -> bool:
        """Rank 0 writes the step's marker (and runs the store's retention)."""
        return self.rank == 0

    def files(self, layout, step: int) -> list[tuple[Path, str]]:
        """This directory's files of the step: its ranks' (every gdsckpt file in the folder; rank 0:
        those the .metadata names that are here, then the .metadata)."""
        path, name = layout.path(step), layout.name(step)
        if self.commits:
            here = [part for part in dcp_files(path) if (path / part).is_file()] + [DCP_METADATA]
        else:
            here = sorted(p.name for p in path.iterdir() if p.name.endswith(SUFFIX)) if path.is_dir() else []
        return [(path / part, f"{name}/{part}") for part in here]

    def commit(self, store: Store, layout, step: int, mine: Marker) -> None:
        """After this directory's files are uploaded and verified: its part record, or on rank 0
        the step's marker over every part (then the part records go)."""
        name = layout.name(step)
        if not self.commits:
            store.put_bytes(part_name(name, self.rank), mine.encode())
            return
        files = dict(mine.files)
        deadline = time.monotonic() + PART_WAIT_S
        others = [leader for leader in self.leaders if leader != self.rank]
        for leader in others:
            while True:
                try:
                    part = parse_marker(store.get_bytes(part_name(name, leader)), step, name)
                    break
                except RemoteNotFoundError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"step {step}: the part of rank {leader}'s directory did not reach "
                                           f"{store.url(name)} within {PART_WAIT_S:g} s") from None
                    time.sleep(0.2)
            files.update(part.files)
        missing = sorted({f"{name}/{p}" for p in dcp_files(layout.path(step))} - set(files))
        if missing:
            raise CheckpointFormatError(f"step {step}: no directory's part holds {missing[:3]}, named by its "
                                        f"{DCP_METADATA}", path=store.url(name))
        store.put_bytes(name + MARKER, Marker(step, files, mine.uploaded, mine.host).encode())
        for leader in others:
            store.delete(part_name(name, leader))
