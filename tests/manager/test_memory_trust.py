"""Whose the memory tier's copies are (gdsckpt/manager/memory/trust.py) and what becomes of those whose
directory is gone (memory_folders.gone_tiers): a folder another local user made under the tier's
predictable name, or a file planted in it, is never restored from; what identifies a copy is
private; a commit record relabelled with another step is a damaged copy; the copies of a moved or
removed directory are found and reclaimed, never those a live process holds.

The second user is a real one: a forked child that drops to uid 65534 (the tests run as root;
they are skipped otherwise)."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

import gdsckpt
from gdsckpt import Checkpointer, MemoryTierTrustError
from gdsckpt.format import file as fmt
from gdsckpt.manager.memory.folders import ID_NAME, OWNER, directory_id, gone_tiers, tier_folder
from gdsckpt.manager.memory.tier import MemoryTier
from conftest import assert_same
from test_memory_tier import OPTS, state_for

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to act as a second user (uid 65534)")


def as_other_user(fn) -> None:
    """Run fn() in a forked child as uid/gid 65534 (a second local user); its failure is raised here."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn()
            code = 0
        except BaseException as e:  # noqa: BLE001 - reported through the exit status
            os.write(2, f"as uid {NOBODY}: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the second user's part failed (see stderr)"


def planted_image(tmp_path: Path) -> bytes:
    """A valid checkpoint image whose every weight is 7.0: what the other user wants restored."""
    state = state_for(20)
    state["model"] = {k: torch.full_like(v, 7.0) for k, v in state["model"].items()}
    path = tmp_path / "planted.gdsckpt"
    gdsckpt.save(state, path, **OPTS)
    return path.read_bytes()


def plant(folder: Path, image: bytes, step: int, slot: str, ident: str | None) -> None:
    """A segment holding `image` and an (unsealed) commit record of `step` naming it, in `folder`."""
    (folder / slot).write_bytes(image)
    rec = {"step": step, "slot": slot, "bytes": len(image), "footer": image[-fmt.FOOTER_SIZE:].hex()}
    (folder / f"step_{step:08d}.commit").write_text(json.dumps(rec))
    if ident is not None:
        (folder / OWNER).write_text(json.dumps({"directory": "x", "id": ident, "rank": 0}))


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# ---------------------------------------------------------------- another local user


@as_root
def test_a_folder_another_user_made_under_the_tiers_name_is_refused(tmp_path, shm):
    os.chmod(shm, 0o1777)  # as /dev/shm is: every user may make folders in it
    d = tmp_path / "run"
    with Checkpointer(d, memory=True, every_local=100, save_options=OPTS) as ck:
        ck.save(1, state_for(1))
        ck.release_memory()  # the tier is empty: its folder goes at close (as after a reboot)
    folder = tier_folder(d, 0)
    assert not folder.exists()
    ident, image = directory_id(d, create=False), planted_image(tmp_path)

    def attack():  # the strongest attacker: it even knows the directory's tier id
        os.mkdir(folder, 0o777)
        os.chmod(folder, 0o777)
        plant(folder, image, 20, "slot-0", ident)
    as_other_user(attack)
    assert os.lstat(folder).st_uid == NOBODY

    with pytest.raises(MemoryTierTrustError, match=rf"{folder}.* owned by uid {NOBODY}, not by this user") as e:
        Checkpointer(d, memory=True, save_options=OPTS)
    assert e.value.path == folder and isinstance(e.value, PermissionError)
    # a folder of this user's that others may write is refused as well
    shutil.rmtree(folder)
    folder.mkdir(mode=0o700)
    os.chmod(folder, 0o773)
    with pytest.raises(MemoryTierTrustError, match="writable by other users"):
        MemoryTier(d)
    # a link in its place, to a folder of this user's, is not followed
    folder.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    folder.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(MemoryTierTrustError, match="a symbolic link"):
        MemoryTier(d)
    folder.unlink()
    with Checkpointer(d, memory=True, save_options=OPTS) as ck:
        r = ck.restore()
        assert (r.step, r.source) == (1, "local")
        assert_same(r.state, state_for(1))


@as_root
def test_files_another_user_put_in_the_tiers_folder_are_never_restored(tmp_path, shm):
    d = tmp_path / "run"
    with Checkpointer(d, memory=True, every_local=100, save_options=OPTS) as ck:
        ck.save(1, state_for(1))
        ck.save(2, state_for(2))
        folder = ck.memory.tier.folder
    ident, image = directory_id(d, create=False), planted_image(tmp_path)
    # what a second user could leave had the folder once been open to it: its own segment and record,
    # and a record of this user's that others may write
    plant(folder, image, 20, "slot-7", None)
    for name in ("slot-7", "step_00000020.commit"):
        os.chown(folder / name, NOBODY, NOBODY)
    (folder / "slot-8").write_bytes(image)
    rec = {"step": 21, "slot": "slot-8", "bytes": len(image), "footer": image[-fmt.FOOTER_SIZE:].hex()}
    (folder / "step_00000021.commit").write_text(json.dumps(rec))
    os.chmod(folder / "step_00000021.commit", 0o666)
    (folder / "slot-9").symlink_to(folder / "slot-8")
    with Checkpointer(d, memory=True, save_options=OPTS) as ck:
        why = {r["name"]: r["why"] for r in ck.memory.tier.reclaimed}
        assert f"owned by uid {NOBODY}" in why["slot-7"] and f"owned by uid {NOBODY}" in why["step_00000020.commit"]
        assert "writable by other users" in why["step_00000021.commit"] and "symbolic link" in why["slot-9"]
        assert ck.memory.steps() == [1, 2] and ck.steps() == [1, 2]
        assert not {"slot-7", "slot-9", "step_00000020.commit", "step_00000021.commit"} & set(os.listdir(folder))
        r = ck.restore()
        assert (r.step, r.source) == (2, "memory")
        assert_same(r.state, state_for(2))
    assert ident == directory_id(d, create=False)


def test_what_identifies_a_copy_is_private(tmp_path, shm):
    d = tmp_path / "run"
    with Checkpointer(d, memory=True, every_local=100, save_options=OPTS) as ck:
        ck.save(1, state_for(1))
        ck.save(2, state_for(2))
        folder = ck.memory.tier.folder
        assert mode(folder) == 0o700 and mode(d / ID_NAME) == 0o600
        for name in os.listdir(folder):
            assert mode(folder / name) & 0o077 == 0, name
    # an earlier version's: the id and records readable by others, the folder too
    os.chmod(d / ID_NAME, 0o644)
    os.chmod(folder, 0o755)
    os.chmod(folder / OWNER, 0o644)
    os.chmod(folder / "step_00000002.commit", 0o644)
    with Checkpointer(d, memory=True, save_options=OPTS) as ck:
        assert ck.memory.steps() == [1, 2]  # still this run's
        assert mode(folder) == 0o700 and mode(d / ID_NAME) == 0o600
        assert mode(folder / OWNER) == 0o600 and mode(folder / "step_00000002.commit") == 0o600


# ---------------------------------------------------------------- a record bound to its step's image


def test_a_relabelled_commit_record_is_a_damaged_copy(tmp_path, shm, caplog, capsys):
    d = tmp_path / "run"
    with Checkpointer(d, memory=True, every_local=100, keep_memory=5, save_options=OPTS) as ck:
        for s in (1, 2, 3, 4, 5):
            ck.save(s, state_for(s))
        folder = ck.memory.tier.folder
        rec = json.loads((folder / "step_00000005.commit").read_text())
    # step 5's record relabelled as step 9 (its name and its step); step 4's renamed as step 8
    rec["step"] = 9
    (folder / "step_00000009.commit").write_text(json.dumps(rec))
    (folder / "step_00000005.commit").unlink()
    os.rename(folder / "step_00000004.commit", folder / "step_00000008.commit")
    from gdsckpt.cli import main
    capsys.readouterr()
    assert main(["ls", str(d), "--json"]) == 0  # the CLI's view, without the tier's lock, says so too
    states = {r["step"]: r["memory_state"] for r in json.loads(capsys.readouterr().out)}
    assert states[9].startswith("DAMAGED: its record's seal does not match step 9") and states[4].startswith(
        "DAMAGED: its record names step 4") and states[3] == "ok"
    with Checkpointer(d, memory=True, keep_memory=5, save_options=OPTS) as ck:
        r = ck.restore()  # step 5 is on disk (close() wrote it): never step 5's contents as step 9
        assert (r.step, r.source) == (5, "local")
        assert_same(r.state, state_for(5))
        why = {r["name"]: r["why"] for r in ck.memory.tier.reclaimed}
        assert "seal does not match step 9" in why["step_00000009.commit"]
        assert "names step 4 under the name step_00000008.commit" in why["step_00000008.commit"]
        assert "step_00000009.commit is damaged" in caplog.text
        assert ck.memory.steps() == [1, 2, 3] and 9 not in ck.steps() and 8 not in ck.steps()
        with pytest.raises(gdsckpt.NoCheckpointError):
            ck.restore(step=9)
    # the record names the image's identity: its index's checksum, as the image's footer has it
    image = (d / "step_00000005.gdsckpt").read_bytes()
    index_checksum = fmt.read_footer(lambda n, off: image[off:off + n], len(image), "step 5")[2]
    assert rec["index_checksum"] == index_checksum and rec["footer"] == image[-fmt.FOOTER_SIZE:].hex()


def test_a_slot_overwritten_with_another_steps_image_falls_back(tmp_path, shm):
    d = tmp_path / "run"
    with Checkpointer(d, memory=True, every_local=2, keep_memory=5, save_options=OPTS) as ck:
        for s in (1, 2, 3, 4):
            ck.save(s, state_for(s))
        c3, c4 = ck.memory.tier.copy(3), ck.memory.tier.copy(4)
        assert c3.nbytes == c4.nbytes  # the same state's shape: images of one size
        with open(c4.slot.path, "r+b") as f:  # step 3's valid image, every checksum right, in step 4's slot
            f.write(c3.slot.read(c3.nbytes, 0))
        with pytest.warns(UserWarning, match=r"restored step 3 \(memory\), not the newer step 4 \(memory\)"):
            r = ck.restore()
        assert (r.step, r.source) == (3, "memory") and r.skipped[0][:2] == (4, "memory")
        assert "no longer ends in the footer committed with step 4" in r.skipped[0][2]
        assert_same(r.state, state_for(3))
        assert ck.memory.steps() == [1, 2, 3]


# ---------------------------------------------------------------- copies of a directory that is gone


def test_copies_of_a_moved_directory_are_found_and_reclaimed(tmp_path, shm, capsys):
    from gdsckpt.cli import main
    run, moved = tmp_path / "run", tmp_path / "run-moved"
    with Checkpointer(run, memory=True, every_local=100, save_options=OPTS) as ck:
        ck.save(1, state_for(1))
        ck.save(2, state_for(2))
        old = ck.memory.tier.folder
    os.rename(run, moved)
    capsys.readouterr()
    assert main(["clean", "--memory"]) == 0
    out = capsys.readouterr().out
    assert f"gone: the memory copies of {run} (rank 0, steps [1, 2]" in out and "--yes" in out and old.exists()
    assert main(["clean", "--memory", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["memory_gone"]
    assert [(r["directory"], r["steps"], r["folder"], r["removed"]) for r in rows] == \
        [(str(run), [1, 2], str(old), False)]
    # the moved directory's own clean finds them: they carry its tier id
    assert main(["clean", str(moved), "--memory"]) == 0
    assert f"dropped the memory copies of rank 0 (steps [1, 2]" in capsys.readouterr().out
    assert not old.exists()
    # --yes removes them; one a live process holds stays
    live_dir = tmp_path / "live"
    live = MemoryTier(live_dir)
    try:
        with Checkpointer(moved, memory=True, every_local=100, save_options=OPTS) as ck:
            ck.save(3, state_for(3))
        os.rename(moved, run)
        shutil.rmtree(live_dir)
        assert main(["clean", "--memory", "--yes"]) == 0
        out = capsys.readouterr().out
        assert f"removed: the memory copies of {moved} (rank 0, steps [3]" in out
        assert f"held by a running process, left: the memory copies of {live_dir}" in out
        assert live.folder.exists() and [t["directory"] for t in gone_tiers()] == [str(live_dir)]
    finally:
        live.close()
    assert gone_tiers() == []
    with Checkpointer(run, memory=True, save_options=OPTS) as ck:
        r = ck.restore()
        assert (r.step, r.source) == (3, "local")


def test_the_next_manager_reclaims_the_copies_of_directories_that_are_gone(tmp_path, shm):
    gone, moved, elsewhere = tmp_path / "gone", tmp_path / "deep" / "run", tmp_path / "other"
    for d in (gone, moved):
        with Checkpointer(d, memory=True, every_local=100, save_options=OPTS) as ck:
            ck.save(1, state_for(1))
            ck.save(2, state_for(2))
    folders = {d: tier_folder(d, 0) for d in (gone, moved)}
    live_dir = tmp_path / "live"
    live = MemoryTier(live_dir)  # a running job whose directory was removed under it: never touched
    try:
        shutil.rmtree(gone)
        shutil.rmtree(tmp_path / "deep")  # its parent too: maybe a file system not mounted now, left alone
        shutil.rmtree(live_dir)
        with Checkpointer(elsewhere, memory=True, save_options=OPTS) as ck:
            why = {r["name"]: r["why"] for r in ck.memory.tier.reclaimed}
            assert why == {str(folders[gone]): f"the copies of {gone}, which is gone"}
        assert not folders[gone].exists() and folders[moved].exists() and live.folder.exists()
        assert live.steps() == []
    finally:
        live.close()
    assert sorted(t["directory"] for t in gone_tiers()) == [str(moved)]


@as_root
def test_another_users_tier_of_a_gone_directory_is_left_alone(tmp_path, shm):
    d = tmp_path / "run"
    with Checkpointer(d, memory=True, every_local=100, save_options=OPTS) as ck:
        ck.save(1, state_for(1))
        ck.save(2, state_for(2))
        folder = ck.memory.tier.folder
    shutil.rmtree(d)
    before = sorted(os.listdir(folder))
    for p in [folder, *folder.iterdir()]:
        os.chown(p, NOBODY, NOBODY)
    assert gone_tiers() == []
    with Checkpointer(tmp_path / "other", memory=True, save_options=OPTS) as ck:
        assert ck.memory.tier.reclaimed == []
    assert sorted(os.listdir(folder)) == before and "step_00000002.commit" in before  # untouched
