"""The CLI's views of a Checkpointer's directory and store: ls, restore-test, prune, clean.

describe and restore_test take no lock: they only read. prune takes the directory's lock (it is
the Checkpointer's own retention, run now).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import GdsckptError
from gdsckpt.core.storage import stale_temporaries
from gdsckpt.core.units import format_bytes
from .exitcodes import ExitCode
from .output import emit_json
from .paths import CHECKPOINTER_DIR, expect_directory

__all__ = ["describe", "restore_test", "cmd_ls", "cmd_restore_test", "cmd_prune", "cmd_clean"]

LOCATION = f"{CHECKPOINTER_DIR} or an s3://bucket/prefix"  # what ls and restore-test take
WHERE = ("memory", "local", "remote")  # the tiers a step may be in, fastest first


def cmd_clean(args) -> int:
    if args.directory is None:
        if not args.memory:
            print("gdsckpt clean: error: name a directory (or --memory alone: the memory tiers of directories "
                  "that are gone)", file=sys.stderr)
            return ExitCode.USAGE
        return _clean_gone_memory(args)
    d = Path(args.directory)
    if not args.memory:  # with --memory: also a directory removed whole, whose copies are left here
        expect_directory(d, "a checkpoint directory")
    dropped, kept = [], []
    if args.memory:  # the memory tier's copies on this host: a cache of the run's newest steps
        from gdsckpt.manager.memory.folders import drop_copies, kept_replicas
        on_disk = _disk_steps(d) if d.is_dir() else None
        kept = kept_replicas(d, on_disk)
        dropped = drop_copies(d, on_disk=on_disk)
        if not args.json:
            for t in dropped:
                whose = f"rank {t['rank']}" if t["holder"] is None else f"rank {t['rank']} held by rank {t['holder']}"
                print(f"dropped the memory copies of {whose} (steps {t['steps'] or 'none'}, "
                      f"{format_bytes(t['bytes'])}): {t['folder']}")
            for t in kept:
                print(f"kept the replica of rank {t['rank']} held by rank {t['holder']}: {t['why']}: {t['folder']}")
            if not dropped and not kept:
                print(f"no memory copies of {args.directory} on this host")
    # A directory removed with its copies left on this host: those are what --memory cleans.
    stale = [] if args.memory and not d.exists() else stale_temporaries(d)
    for p in stale:
        if not args.json:
            print(("removing " if args.yes else "stale: ") + str(p))
        if args.yes:
            p.unlink(missing_ok=True)
    if args.json:
        emit_json({"directory": args.directory, "stale": [str(p) for p in stale], "removed": bool(args.yes),
                   "memory_dropped": [{k: str(v) if isinstance(v, Path) else v for k, v in t.items()}
                                      for t in dropped],
                   "replicas_kept": [{k: str(v) if isinstance(v, Path) else v for k, v in t.items()} for t in kept]})
    elif stale and not args.yes:
        print("re-run with --yes to remove them")
    elif not stale:
        print(f"no stale gdsckpt temporaries in {args.directory}")
    return ExitCode.OK


def _disk_steps(d: Path) -> set[int]:
    """The steps in directory `d` (files or DCP folders; complete or not: a replica of a step
    whose write is under way is not yet its origin's only other copy to keep)."""
    from gdsckpt.manager.steps import parse_step_name
    return {parsed[0] for parsed in map(parse_step_name, os.listdir(d)) if parsed}


def _clean_gone_memory(args) -> int:
    """`clean --memory` without a directory: this user's memory tiers on this host whose directory
    was moved or removed; --yes removes those no process holds (the others are listed as held)."""
    from gdsckpt.manager.memory.folders import gone_tiers, reclaim_gone
    tiers = gone_tiers()
    removed = {str(t["folder"]) for t in reclaim_gone(beside_parent=False)} if args.yes else set()
    rows = [{**{k: str(v) if isinstance(v, Path) else v for k, v in t.items() if k != "id"},
             "removed": str(t["folder"]) in removed} for t in tiers]
    if args.json:
        emit_json({"directory": None, "removed": bool(args.yes), "memory_gone": rows})
        return ExitCode.OK
    for t in rows:
        what = ("removed" if t["removed"] else "held by a running process, left") if args.yes else "gone"
        whose = f"rank {t['rank']}" if t["holder"] is None else f"rank {t['rank']}'s replica held by rank {t['holder']}"
        print(f"{what}: the memory copies of {t['directory']} ({whose}, steps {t['steps'] or 'none'}, "
              f"{format_bytes(t['bytes'])}): {t['folder']}")
    if not rows:
        print("no memory copies of a moved or removed directory on this host")
    elif not args.yes:
        print("re-run with --yes to remove them")
    return ExitCode.OK


# ---------------------------------------------------------------- the checkpoint manager's directories
# Views of a Checkpointer's directory and store that take no lock: they only read.


# A step's state where a pending rollback gives it up (removed when a manager next opens the directory).
GIVEN_UP = "given up by a pending rollback"


def describe(location: str, *, remote: str | None = None, deep: bool = False) -> list[dict]:
    """Steps in a checkpoint directory and/or under an s3:// prefix, newest last: for each, where
    it lives, its size and whether it is intact (committed and its footer and index valid; deep:
    every chunk checksum verified, which reads every byte). A step a pending rollback gives up (its
    record in the directory) is `GIVEN_UP` there, as restore() counts it: not at all."""
    from ..errors import RemoteStoreError
    from gdsckpt.manager.rollback import RollbackJournal
    from gdsckpt.manager.remote.marker import MARKER, InvalidMarker, load_marker
    from ..stores import is_remote, open_store
    from gdsckpt.manager.steps import parse_step_name
    rows: dict[int, dict] = {}

    def row(step):
        return rows.setdefault(step, {"step": step, "memory": None, "memory_bytes": 0, "memory_state": None,
                                      "replicas": None, "replicas_bytes": 0, "replicas_state": None,
                                      "local": None, "local_bytes": 0, "local_state": None,
                                      "remote": None, "remote_bytes": 0, "remote_state": None,
                                      "remote_files": []})

    pending = None
    if not is_remote(location):
        d = Path(location)
        pending = RollbackJournal(d).read() if d.is_dir() else None  # a damaged record: CheckpointFormatError
        for c in _memory_copies(d):  # this host's memory tier (Checkpointer(memory=True))
            r = row(c["step"])
            r["memory"] = ",".join(filter(None, [r["memory"], f"rank {c['rank']}"]))
            r["memory_bytes"] += c["bytes"]
            state = _memory_state(c, deep)
            r["memory_state"] = state if r["memory_state"] in (None, "ok") else r["memory_state"]
        for c in _memory_copies(d, replicas=True):  # peer replicas held on this host (replicas=k)
            r = row(c["step"])
            r["replicas"] = ",".join(filter(None, [r["replicas"], f"rank {c['rank']} held by rank {c['holder']}"]))
            r["replicas_bytes"] += c["bytes"]
            state = _memory_state(c, deep)
            r["replicas_state"] = state if r["replicas_state"] in (None, "ok") else r["replicas_state"]
        for name in sorted(os.listdir(d)):
            parsed = parse_step_name(name)
            if not parsed:
                continue
            p = d / name
            found = _local_step(p, deep)
            if found is None:
                continue
            r = row(parsed[0])
            r["local"] = str(p)
            r["local_bytes"], r["local_state"] = found
    else:
        remote = location
    if remote:
        store = open_store(remote)
        listing = store.list()
        markers = {}
        for name in listing:
            if name.endswith(MARKER) and parse_step_name(name[:-len(MARKER)]):
                try:
                    markers[name[:-len(MARKER)]] = load_marker(store, name)
                except (RemoteStoreError, InvalidMarker):
                    pass  # gone meanwhile, or not valid: the step does not count
        for name, size in listing.items():
            top = name.split("/", 1)[0]
            parsed = parse_step_name(top)
            if not parsed or name.endswith(MARKER):
                continue
            r = row(parsed[0])
            r["remote"] = store.url(top)
            r["remote_bytes"] += size
        for r in rows.values():
            if r["remote"] is None:
                continue
            top = r["remote"].rsplit("/", 1)[1]
            marker = markers.get(top)
            r["remote_files"] = sorted(marker.files) if marker else []
            if marker is None:
                r["remote_state"] = "incomplete (no verified-upload marker)"
            elif not all(listing.get(f) == n for f, n in marker.sizes().items()):
                r["remote_state"] = "DAMAGED: objects missing or of another size than uploaded"
            elif deep:
                r["remote_state"] = _check_remote(store, top)
            else:
                r["remote_state"] = "ok"
    if pending is not None:
        for r in rows.values():
            for where, to in (("memory", pending.local_to), ("local", pending.local_to), ("remote", pending.store_to)):
                if r[where] is not None and to is not None and r["step"] > to:
                    r[where + "_state"] = f"{GIVEN_UP} to step {to}"
    return [rows[k] for k in sorted(rows)]


def _local_step(p: Path, deep: bool) -> tuple[int, str] | None:
    """(bytes, state) of the local step at `p`, or None if it is gone: this view takes no lock, so
    a running Checkpointer's retention may remove a step between the listing and these reads."""
    from gdsckpt.manager.steps import check_step
    try:
        size = sum(f.stat().st_size for f in p.iterdir() if f.is_file()) if p.is_dir() else p.stat().st_size
    except FileNotFoundError:
        return None
    state = check_step(p, deep)
    return (size, state) if p.exists() else None


def _memory_copies(d: Path, replicas: bool = False) -> list[dict]:
    """This host's memory copies of `d`: the ranks' own, or (replicas) the peer replicas held here."""
    from gdsckpt.manager.memory.folders import list_copies, list_replicas
    return (list_replicas if replicas else list_copies)(d) if d.is_dir() else []


def _memory_state(copy: dict, deep: bool) -> str:
    from gdsckpt.manager.memory.source import check_copy
    if copy.get("damaged"):  # relabelled or altered: not the record sealed for this step's image
        return f"DAMAGED: {copy['damaged']}"
    return check_copy(copy["folder"], copy["record"], deep)


def _check_remote(store, name: str) -> str:
    """"ok" or why not: what restore() checks of the step `name` on the store (the identity of
    its objects against its marker's), and every chunk checksum."""
    from gdsckpt.manager.remote.verify import check_uploaded
    from gdsckpt.manager.remote.marker import MARKER, InvalidMarker, load_marker
    try:
        check_uploaded(store, load_marker(store, name + MARKER))
    except (GdsckptError, OSError, InvalidMarker) as e:
        return f"DAMAGED: {type(e).__name__}: {e}"
    return "ok"


def restore_test(location: str, *, remote: str | None = None, on_step=None) -> tuple[int | None, list[dict]]:
    """Verify steps newest first, every chunk checksum, until one is intact: (that step or None,
    the rows checked). What restore() would do, without loading. on_step(row): after each step."""
    from gdsckpt.manager.steps import check_step
    from ..stores import open_store
    checked = []
    for r in reversed(describe(location, remote=remote)):
        if r["memory"] is not None and r["memory_state"] == "ok":
            copies = [c for c in _memory_copies(Path(location)) if c["step"] == r["step"]]
            states = [_memory_state(c, deep=True) for c in copies]
            r["memory_state"] = next((s for s in states if s != "ok"), "ok")
        if r["local"] is not None and not r["local_state"].startswith(GIVEN_UP):
            r["local_state"] = check_step(Path(r["local"]), deep=True)
        if r["remote"] is not None and r["remote_state"] == "ok":
            root, top = r["remote"].rsplit("/", 1)
            r["remote_state"] = _check_remote(open_store(root), top)
        checked.append(r)
        if on_step is not None:
            on_step(r)
        if "ok" in (r["memory_state"], r["local_state"], r["remote_state"]):
            return r["step"], checked
    return None, checked


def _where(r) -> str:
    return "+".join(w for w in WHERE if r[w] is not None) or "-"


def cmd_ls(args) -> int:
    expect_directory(args.location, LOCATION)
    rows = describe(args.location, remote=args.remote, deep=args.verify)
    if args.json:
        emit_json(rows)
        return ExitCode.OK
    if not rows:
        print(f"no steps in {args.location}" + (f" or {args.remote}" if args.remote else ""))
        return ExitCode.OK
    print(f"{'step':>10}  {'where':<20}{'memory size':>12}{'local size':>12}{'remote size':>13}  state")
    for r in rows:
        states = [f"{w}: {r[w + '_state']}" for w in WHERE if r[w] is not None]
        print(f"{r['step']:>10}  {_where(r):<20}{format_bytes(r['memory_bytes']) if r['memory'] else '-':>12}"
              f"{format_bytes(r['local_bytes']) if r['local'] else '-':>12}"
              f"{format_bytes(r['remote_bytes']) if r['remote'] else '-':>13}  {'; '.join(states)}")
        if r["replicas"]:  # another rank's step, held here for it: not a step this host restores
            print(f"{'':>10}  {'replicas':<20}{format_bytes(r['replicas_bytes']):>12}{'':>25}  "
                  f"{r['replicas']}: {r['replicas_state']}")
    return ExitCode.OK


def cmd_restore_test(args) -> int:
    """0: the newest step is intact; 1: it is not (an older one, or none, would be restored);
    3: there is no step at all."""
    from .output import progress
    expect_directory(args.location, LOCATION)
    bar = progress(None, "restore-test", unit="step")
    try:
        step, checked = restore_test(args.location, remote=args.remote, on_step=lambda r: bar.update(1))
    finally:
        bar.close()
    newest = checked[0]["step"] if checked else None
    code = ExitCode.NOT_FOUND if not checked else ExitCode.OK if step == newest else ExitCode.DAMAGED
    if args.json:
        emit_json({"location": args.location, "remote": args.remote, "step": step, "newest": newest,
                   "checked": checked})
        return code
    for r in checked:
        states = [f"{w}: {r[w + '_state']}" for w in WHERE if r[w] is not None]
        print(f"step {r['step']}: {'; '.join(states)}")
    if not checked:
        print(f"gdsckpt restore-test: no steps in {args.location}" + (f" or {args.remote}" if args.remote else ""),
              file=sys.stderr)
    elif step is None:
        print(f"gdsckpt restore-test: no intact step in {args.location}", file=sys.stderr)
    else:
        print(f"restore() would use step {step}" + ("" if step == newest else f", not the newer step {newest}"))
    return code


def cmd_prune(args) -> int:
    """Without --yes nothing is changed: the directory is opened read-only (no lock taken, no
    temporary removed, a pending rollback only looked at). With --yes, a pending rollback is
    finished first (its steps are among those removed), then the policy applied."""
    from gdsckpt.manager.checkpointer import Checkpointer
    expect_directory(args.directory, CHECKPOINTER_DIR)  # a typo: never create it (the Checkpointer would)
    if args.keep_remote is not None and args.remote is None:
        raise ValueError("--keep-remote applies to the store's steps: name the store with --remote")
    options = {"keep": args.keep, "remote": args.remote, "keep_remote": args.keep_remote, "upload": False}
    ck = Checkpointer(args.directory, read_only=True, **options)
    try:
        abandoned = ck.abandoned()  # a pending rollback's: removed once a writing manager opens the directory
        gone = ck.prune(dry_run=True)
    finally:
        ck.close(wait_uploads=False)
    if args.yes:
        ck = Checkpointer(args.directory, **options)  # finishes the rollback as it opens
        try:
            gone = ck.prune()
        finally:
            ck.close(wait_uploads=False)
    local, remote = sorted(abandoned["local"] + gone["local"]), sorted(abandoned["remote"] + gone["remote"])
    if args.json:
        emit_json({"directory": args.directory, "removed": bool(args.yes), "local": local, "remote": remote,
                   "rollback": abandoned, "damaged": {str(k): v for k, v in gone["damaged"].items()}})
        return ExitCode.OK
    for step, why in gone["damaged"].items():
        print(f"local step {step} is damaged (kept; it does not count toward --keep): {why}")
    if abandoned["local"] or abandoned["remote"]:
        print(f"a pending rollback gives up local steps {abandoned['local'] or 'none'}; "
              f"remote steps {abandoned['remote'] or 'none'}")
    verb = "removed" if args.yes else "would remove"
    print(f"{verb}: local steps {local or 'none'}; remote steps {remote or 'none'}")
    if not args.yes and (local or remote):
        print("re-run with --yes to remove them")
    return ExitCode.OK
