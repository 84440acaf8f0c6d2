"""Peer replicas in one process: the placement (ring, a mapping, refusals), the restore's plan,
and the holder's store (every chunk checked before a replica counts; one cap shared with the
rank's own copies; the newest replica of a step on no disk never dropped)."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path

import pytest
import torch

import gdsckpt
from gdsckpt.format import file as fmt
from gdsckpt.errors import ReplicaPlacementError
from gdsckpt.manager.memory.tier import MemoryTier
from gdsckpt.manager.replicas.restore import plan
from gdsckpt.manager.replicas.placement import checked, held_for, place, ring
from gdsckpt.manager.replicas.store import ReplicaStore, replica_folder


# ------------------------------------------------------------------ placement
def test_ring_over_nodes_same_local_index():
    # two nodes of two ranks: rank r's replica goes to the rank of the same local index on the other node
    assert ring(["a", "a", "b", "b"], 1) == {0: [2], 1: [3], 2: [0], 3: [1]}
    # four nodes, one rank each, two replicas: the next two nodes
    assert ring(["n0", "n1", "n2", "n3"], 2) == {0: [1, 2], 1: [2, 3], 2: [3, 0], 3: [0, 1]}
    # nodes in the order of their first rank, ranks interleaved
    p = ring(["x", "y", "x", "y", "z", "z"], 1)
    assert p == {0: [1], 2: [3], 1: [4], 3: [5], 4: [0], 5: [2]}
    assert held_for(p, 4) == [1]


def test_a_node_is_torchruns_node_and_its_memory_root(monkeypatch, tmp_path):
    from gdsckpt.manager.replicas.placement import local_node
    monkeypatch.setenv("GDSCKPT_MEMORY_ROOT", str(tmp_path))
    monkeypatch.setenv("GROUP_RANK", "3")
    assert local_node() == f"group-3:{os.path.realpath(tmp_path)}"
    monkeypatch.delenv("GROUP_RANK")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "17")
    assert local_node() == f"group-2:{os.path.realpath(tmp_path)}"


def test_one_node_is_refused():
    with pytest.raises(ReplicaPlacementError, match=r"replicas=1 needs 2 nodes .*on 1 \('host-a'\)"):
        ring(["host-a"] * 4, 1)
    with pytest.raises(ReplicaPlacementError, match="replicas=2 needs 3 nodes"):
        ring(["a", "b"], 2)


def test_a_mapping_is_checked():
    nodes = ["a", "a", "b", "b"]
    assert place(nodes, 1, {0: [3], 1: [2], 2: [1], 3: [0]}) == {0: [3], 1: [2], 2: [1], 3: [0]}
    with pytest.raises(ReplicaPlacementError, match=r"puts rank 0's replica on rank 1, on the same node \('a'\)"):
        checked({0: [1], 1: [2], 2: [0], 3: [0]}, nodes, 1)
    with pytest.raises(ReplicaPlacementError, match="names no holder for rank 3"):
        checked({0: [2], 1: [2], 2: [0]}, nodes, 1)
    with pytest.raises(ReplicaPlacementError, match="holder rank 7, not a rank of the world of 4"):
        checked({0: [7], 1: [2], 2: [0], 3: [0]}, nodes, 1)
    with pytest.raises(ReplicaPlacementError, match=r"gives rank 0 holders \[2, 3\]: replicas=1"):
        checked({0: [2, 3], 1: [2], 2: [0], 3: [0]}, nodes, 1)


def test_replicas_need_the_memory_tier_and_torch_distributed(tmp_path):
    with pytest.raises(ValueError, match="replicas= configure the memory tier"):
        gdsckpt.Checkpointer(tmp_path / "a", replicas=1)
    with pytest.raises(ValueError, match="replicas= keeps copies on other nodes' ranks: it needs torch.distributed"):
        gdsckpt.Checkpointer(tmp_path / "b", memory=True, replicas=1, distributed=False)


def test_plan_takes_steps_every_rank_can_get():
    every = [([4, 5], {2: {4: 10, 5: 11}}, {}),  # rank 0: its own 4 and 5; rank 2's replicas
             ([], {0: {4: 12, 5: 13}}, {}),       # rank 1: a replacement; holds rank 0's replicas
             ([4, 5], {}, {})]                    # rank 2
    apart = [0, 1, 2]  # each rank on a host of its own
    # rank 1's own copies are nowhere: no memory step
    assert plan(every, apart) == {}
    every[2] = ([4, 5], {1: {4: 20}}, {})  # rank 2 holds rank 1's step 4 only
    assert plan(every, apart) == {4: {1: (2, 20, None)}}


def test_plan_finds_copies_left_under_another_numbering():
    """Strays (copies in folders no rank of this numbering opens), reported by the first rank of
    their host: one on the origin's own host is adopted (the origin serves itself), before a
    replica held elsewhere; one on another host is sent by that host's first rank."""
    every = [([], {}, {1: {5: (30, "/m/a-r1")}}),       # rank 0 (host A, with rank 1): rank 1's copy left here
             ([], {}, {}),                              # rank 1 (host A)
             ([5], {1: {5: 40}}, {0: {5: (50, "/m/b-r0")}}),  # rank 2 (host B): rank 1's replica; rank 0's stray
             ([5], {}, {})]                             # rank 3 (host B)
    hosts = [0, 0, 2, 2]
    assert plan(every, hosts) == {5: {0: (2, 50, "/m/b-r0"), 1: (1, 30, "/m/a-r1")}}
    every[0] = ([], {}, {})  # no stray of rank 1 on its host: its replica's holder sends it
    assert plan(every, hosts) == {5: {0: (2, 50, "/m/b-r0"), 1: (2, 40, None)}}


# ------------------------------------------------------------------ the holder's store
@pytest.fixture
def root(shm_tmp):
    return shm_tmp


def _image(tmp_path: Path, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    path = tmp_path / f"img{seed}.gdsckpt"
    gdsckpt.save({"w": torch.randn(64, 64, generator=g)}, path, chunk_bytes=4096)
    return path.read_bytes()


def _offer(store: ReplicaStore, origin: int, step: int, image: bytes, footer: bytes | None = None,
           damage_at: int | None = None) -> bool:
    slot = store.reserve(origin, step, len(image))
    if slot is None:
        return False
    data = bytearray(image)
    if damage_at is not None:
        data[damage_at] ^= 0x10
    slot.write(bytes(data), 0)
    return store.commit(origin, slot, step, len(image), footer if footer is not None else image[-fmt.FOOTER_SIZE:])


@contextlib.contextmanager
def holder(d: Path, root: Path, world: int = 2):
    """Rank 0's own tier and its ReplicaStore of rank 1's replicas, in a world of `world`."""
    own = MemoryTier(d, rank=0, cap_bytes=1 << 30, root=root)
    store = ReplicaStore(d, rank=0, origins=[1], world=world, cap_bytes=1 << 30, keep=2, on_disk=tuple,
                         own_folder=own.folder, root=root)
    try:
        yield own, store
    finally:
        store.close()
        own.close()


def test_replica_checked_before_it_counts(tmp_path, root):
    d = tmp_path / "ck"
    with holder(d, root) as (own, store):
        img = _image(tmp_path, 1)
        assert _offer(store, 1, 1, img)
        assert not _offer(store, 1, 2, img, damage_at=fmt.HEADER_SIZE + 7)  # a chunk's byte
        assert not _offer(store, 1, 3, img, footer=b"\0" * fmt.FOOTER_SIZE)  # not the footer offered
        assert store.inventory() == {1: {1: len(img)}}
        whys = [r["why"] for r in store.status()["refused"]]
        assert "ChecksumError" in whys[0] and "chunk" in whys[0], whys
        assert whys[1] == "damaged: its footer is not the one its origin sent"
        folder = replica_folder(d, 1, 0, root)
        assert folder.name.endswith("-r1.replica-r0") and stat.S_IMODE(folder.stat().st_mode) == 0o700
        slots = [p for p in folder.iterdir() if p.name.startswith("slot-")]
        assert slots and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in slots)
        assert json.loads((folder / "replica.json").read_text()) == {"origin": 1, "holder": 0, "world": 2}
        # the CLI's listing of a directory's own copies does not take replicas for a rank's own
        assert gdsckpt.manager.memory.folders.tier_folders(d, root) == {0: own.folder}
    # the committed replica outlives the process's store: the next one finds it
    with holder(d, root) as (_, store):
        assert store.inventory() == {1: {1: len(img)}}
    # a world of another size: its replicas are another sharding's, released
    with holder(d, root, world=3) as (_, store):
        assert store.inventory() == {1: {}}


def test_replicas_count_against_the_cap(tmp_path, root):
    d = tmp_path / "ck"
    img = _image(tmp_path, 2)
    n = len(img)
    disk: list[int] = []
    store = None
    own = MemoryTier(d, rank=0, cap_bytes=3 * n, keep=2, on_disk=lambda: disk, root=root,
                     outside=lambda: store.held_bytes() if store is not None else 0)
    store = ReplicaStore(d, rank=0, origins=[1], world=2, cap_bytes=3 * n, keep=2, on_disk=lambda: disk,
                         own_folder=own.folder, root=root)
    try:
        slot, _ = own.reserve(1, n)
        slot.write(img, 0)
        own.commit(slot, 1, n)
        assert _offer(store, 1, 1, img) and _offer(store, 1, 2, img)  # 3 n held: the cap
        assert own.held_bytes() + store.held_bytes() == 3 * n
        # the own tier counts the replicas: no room beside its protected newest copy and them
        why = own.room_for(n)
        assert why is not None and f"the peer replicas held here ({2 * n} bytes)" in why, why
        # a third replica: the older one goes, never the newest (on no disk: maybe the origin's only other copy)
        assert _offer(store, 1, 3, img)
        assert store.inventory() == {1: {2: n, 3: n}} and own.held_bytes() + store.held_bytes() == 3 * n
        # the rank's own next step comes first: replicas that may go make room for it (the older one)
        assert store.give_room(lambda: own.room_for(n) is None, disk) == [(1, 2)]
        slot, _ = own.reserve(2, n)
        slot.write(img, 0)
        own.commit(slot, 2, n)
        assert own.steps() == [1, 2] and store.inventory() == {1: {3: n}}
        # no room for replica 4 beside the own copies, and replica 3 (the newest, on no disk) stays: refused
        assert store.give_room(lambda: False, disk) == []
        assert not _offer(store, 1, 4, img)
        assert store.inventory() == {1: {3: n}}
        assert "no room" in store.status()["refused"][-1]["why"]
        disk.append(3)  # step 3 reached the disk: its replica may go now
        assert _offer(store, 1, 4, img)
        assert store.inventory() == {1: {4: n}}
        assert own.held_bytes() + store.held_bytes() <= 3 * n
    finally:
        store.close()
        own.close()
    assert os.listdir(root)  # the committed copies and replicas stay for the next manager
