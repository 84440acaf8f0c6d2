"""`gdsckpt ls` and `gdsckpt clean --memory` with peer replicas held on this host (Checkpointer(
replicas=k)): real replica tiers made by the holder's store (every chunk checked on arrival),
listed as another rank's steps held here, and reclaimed as the tier's own folders are, but never
the newest replica of a step on no disk (it may be its origin's only other copy)."""

from __future__ import annotations

import json
import os

import torch

import gdsckpt
from gdsckpt.cli import main
from gdsckpt.format import file as fmt
from gdsckpt.manager.memory.tier import MemoryTier
from gdsckpt.manager.replicas.store import ReplicaStore, replica_folder


def _image(tmp_path, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    path = tmp_path / f"img{seed}.gdsckpt"
    gdsckpt.save({"w": torch.randn(64, 64, generator=g)}, path, chunk_bytes=4096)
    return path.read_bytes()


def _holder(tmp_path, d, root, steps=(1, 2)):
    """Rank 0's own tier of `d` and its store of rank 1's replicas, holding `steps` (open: the caller closes)."""
    own = MemoryTier(d, rank=0, cap_bytes=1 << 30, root=root)
    store = ReplicaStore(d, rank=0, origins=[1], world=2, cap_bytes=1 << 30, keep=2, on_disk=tuple,
                         own_folder=own.folder, root=root)
    for step in steps:
        img = _image(tmp_path, step)
        slot = store.reserve(1, step, len(img))
        slot.write(img, 0)
        assert store.commit(1, slot, step, len(img), img[-fmt.FOOTER_SIZE:])
    return own, store


def _held(tmp_path, d, root, steps=(1, 2)):
    own, store = _holder(tmp_path, d, root, steps)
    store.close()
    own.close()
    return replica_folder(d, 1, 0, root)


def test_ls_lists_the_replicas_held_here(tmp_path, shm, capsys):
    d = tmp_path / "run"
    folder = _held(tmp_path, d, shm)
    capsys.readouterr()
    assert main(["ls", str(d), "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert sorted(rows) == [1, 2]
    for r in rows.values():
        assert r["replicas"] == "rank 1 held by rank 0" and r["replicas_state"] == "ok" and r["replicas_bytes"] > 0
        assert r["memory"] is None and r["local"] is None  # another rank's step: not one this host restores
    assert main(["ls", str(d)]) == 0
    out = capsys.readouterr().out
    assert out.count("rank 1 held by rank 0: ok") == 2 and "replicas" in out
    # a replica's segment damaged after it was committed: --verify reads every chunk and says so
    slot = next(p for p in sorted(folder.iterdir()) if p.name.startswith("slot-"))
    with open(slot, "r+b") as f:
        f.seek(fmt.HEADER_SIZE + 9)
        b = f.read(1)
        f.seek(fmt.HEADER_SIZE + 9)
        f.write(bytes([b[0] ^ 0x40]))
    assert main(["ls", str(d), "--verify", "--json"]) == 0
    states = [r["replicas_state"] for r in json.loads(capsys.readouterr().out)]
    assert sum(s.startswith("DAMAGED") for s in states) == 1 and states.count("ok") == 1, states


def test_clean_keeps_the_newest_replica_of_a_step_on_no_disk(tmp_path, shm, capsys):
    d = tmp_path / "run"
    folder = _held(tmp_path, d, shm)
    capsys.readouterr()
    assert main(["clean", str(d), "--memory", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(k["rank"], k["holder"], k["step"], k["folder"]) for k in out["replicas_kept"]] == \
        [(1, 0, 2, str(folder))]
    assert "may be its only other copy" in out["replicas_kept"][0]["why"]
    assert out["memory_dropped"] == []
    assert folder.exists() and sorted(p.name for p in folder.glob("step_*.commit")) == \
        ["step_00000001.commit", "step_00000002.commit"]
    # step 2 on disk: the replica is no one's only copy any more, and goes
    with gdsckpt.Checkpointer(d) as ck:
        ck.save(2, {"w": torch.zeros(3)})
    assert main(["clean", str(d), "--memory"]) == 0
    out = capsys.readouterr().out
    assert f"dropped the memory copies of rank 1 held by rank 0 (steps [1, 2]" in out and not folder.exists()


def test_clean_refuses_a_replica_its_holder_holds(tmp_path, shm, capsys):
    d = tmp_path / "run"
    own, store = _holder(tmp_path, d, shm, steps=(1,))
    own.close()  # the holder's store alone is open
    try:
        with gdsckpt.Checkpointer(d) as ck:
            ck.save(1, {"w": torch.zeros(3)})
        assert main(["clean", str(d), "--memory"]) != 0
        err = capsys.readouterr().err
        assert f"{replica_folder(d, 1, 0, shm)}' is in use by another Checkpointer" in err, err
        assert list(store.inventory()[1]) == [1]  # nothing removed
    finally:
        store.close()


def test_replicas_of_a_moved_directory_are_reclaimed_once_their_holder_is_gone(tmp_path, shm, capsys):
    run, moved = tmp_path / "run", tmp_path / "run-moved"
    own, store = _holder(tmp_path, run, shm)
    folder = replica_folder(run, 1, 0, shm)
    os.rename(run, moved)
    try:
        capsys.readouterr()
        assert main(["clean", "--memory"]) == 0
        out = capsys.readouterr().out
        assert f"gone: the memory copies of {run} (rank 1's replica held by rank 0, steps [1, 2]" in out
        assert main(["clean", "--memory", "--yes", "--json"]) == 0  # its holder's manager is alive: left
        rows = {r["folder"]: r for r in json.loads(capsys.readouterr().out)["memory_gone"]}
        assert rows[str(folder)]["holder"] == 0 and rows[str(folder)]["removed"] is False and folder.exists()
    finally:
        store.close()
        own.close()
    assert main(["clean", "--memory", "--yes"]) == 0
    out = capsys.readouterr().out
    assert f"removed: the memory copies of {run} (rank 1's replica held by rank 0" in out and not folder.exists()
    assert os.listdir(shm) == []
