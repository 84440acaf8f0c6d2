"""`gdsckpt`: inspect, verify, convert and clean checkpoints."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from pathlib import Path

from . import api, codecs
from .errors import GdsckptError
from .storage import stale_temporaries


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def cmd_inspect(args) -> int:
    ck = api.open(args.path)
    meta, streams = ck.metadata, ck.streams()
    if args.json:
        json.dump({"metadata": meta, "streams": streams,
                   "tensors": {k: {**ck.info(k), "shape": list(ck.info(k)["shape"])} for k in ck.keys()}},
                  sys.stdout, indent=1)
        print()
        return 0
    w = meta.get("writer") or {}
    print(f"{args.path}: format {meta['format'][0]}.{meta['format'][1]}, {meta.get('library')}, "
          f"nvCOMP {meta.get('nvcomp') or '-'}, written by the {w.get('backend')} backend "
          f"(io {w.get('io_path')}) {meta.get('created')}")
    print(f"\n{'stream':<16}{'codec':<9}{'tensors':>8}{'logical':>12}{'stored':>12}{'saved':>8}{'raw chunks':>12}")
    tot_l = tot_s = 0
    for s in streams:
        tot_l, tot_s = tot_l + s["logical_bytes"], tot_s + s["stored_bytes"]
        print(f"{s['dtype']:<16}{s['codec']:<9}{s['tensors']:>8}{_size(s['logical_bytes']):>12}"
              f"{_size(s['stored_bytes']):>12}{1 - s['ratio']:>8.1%}{s['raw_chunks']:>12}")
    print(f"{'total':<16}{'':<9}{len(ck):>8}{_size(tot_l):>12}{_size(tot_s):>12}"
          f"{(1 - tot_s / tot_l) if tot_l else 0:>8.1%}")
    if not args.summary:
        print(f"\n{'tensor':<60}{'dtype':<16}{'shape':<24}{'device':<7}")
        for k in ck.keys():
            i = ck.info(k)
            print(f"{k:<60}{i['dtype']:<16}{str(list(i['shape'])):<24}{i['device']:<7}")
    return 0


def cmd_verify(args) -> int:
    r = api.open(args.path).verify(deep=args.deep, isolated=args.isolated)
    print(f"{args.path}: OK, {r['chunks']} chunks of {r['tensors']} tensors verified"
          + (" and decoded in an isolated process" if args.isolated else " and decoded" if args.deep
             else " (checksums)"))
    return 0


def cmd_convert(args) -> int:
    state = api.load(args.src)
    stats = api.save(state, args.dst, codec=args.codec)
    print(f"{args.src} -> {args.dst}: codec {args.codec}, {_size(stats.logical_bytes)} logical, "
          f"{_size(stats.stored_bytes)} stored ({1 - stats.ratio:.1%} saved)")
    return 0


def cmd_clean(args) -> int:
    d = Path(args.directory)
    if args.memory:  # the memory tier's copies on this host: a cache of the run's newest steps
        from .memory_tier import drop_copies
        dropped = drop_copies(d)
        for t in dropped:
            print(f"dropped the memory copies of rank {t['rank']} (steps {t['steps'] or 'none'}, "
                  f"{_size(t['bytes'])}): {t['folder']}")
        if not dropped:
            print(f"no memory copies of {args.directory} on this host")
    stale = stale_temporaries(d)
    for p in stale:
        print(("removing " if args.yes else "stale: ") + str(p))
        if args.yes:
            p.unlink(missing_ok=True)
    if stale and not args.yes:
        print("re-run with --yes to remove them")
    if not stale:
        print(f"no stale gdsckpt temporaries in {args.directory}")
    return 0


# ---------------------------------------------------------------- the checkpoint manager's directories
# Views of a Checkpointer's directory and store that take no lock: they only read.


def describe(location: str, *, remote: str | None = None, deep: bool = False) -> list[dict]:
    """Steps in a checkpoint directory and/or under an s3:// prefix, newest last: for each, where
    it lives, its size and whether it is intact (committed and its footer and index valid; deep:
    every chunk checksum verified, which reads every byte)."""
    from .upload_marker import MARKER, read_marker
    from .stores import is_remote, open_store
    from .steps import check_step, parse_step_name
    rows: dict[int, dict] = {}

    def row(step):
        return rows.setdefault(step, {"step": step, "memory": None, "memory_bytes": 0, "memory_state": None,
                                      "local": None, "local_bytes": 0, "local_state": None,
                                      "remote": None, "remote_bytes": 0, "remote_state": None,
                                      "remote_files": []})

    if not is_remote(location):
        d = Path(location)
        for c in _memory_copies(d):  # this host's memory tier (Checkpointer(memory=True))
            r = row(c["step"])
            r["memory"] = ",".join(filter(None, [r["memory"], f"rank {c['rank']}"]))
            r["memory_bytes"] += c["bytes"]
            state = _memory_state(c, deep)
            r["memory_state"] = state if r["memory_state"] in (None, "ok") else r["memory_state"]
        for name in sorted(os.listdir(d)):
            parsed = parse_step_name(name)
            if not parsed:
                continue
            p = d / name
            r = row(parsed[0])
            r["local"] = str(p)
            r["local_bytes"] = sum(f.stat().st_size for f in p.iterdir() if f.is_file()) if p.is_dir() \
                else p.stat().st_size
            r["local_state"] = check_step(p, deep)
    else:
        remote = location
    if remote:
        store = open_store(remote)
        listing = store.list()
        markers = {}
        for name in listing:
            if name.endswith(MARKER) and parse_step_name(name[:-len(MARKER)]):
                marker = read_marker(store, name)
                if marker is not None:
                    markers[name[:-len(MARKER)]] = marker
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
            r["remote_files"] = sorted(marker["files"]) if marker else []
            if marker is None:
                r["remote_state"] = "incomplete (no verified-upload marker)"
            elif not all(listing.get(f) == n for f, n in marker["files"].items()):
                r["remote_state"] = "DAMAGED: objects missing or of another size than uploaded"
            elif deep:
                r["remote_state"] = _check_remote(store, r["remote_files"])
            else:
                r["remote_state"] = "ok"
    return [rows[k] for k in sorted(rows)]


def _memory_copies(d: Path) -> list[dict]:
    from .memory_tier import list_copies
    return list_copies(d) if d.is_dir() else []


def _memory_state(copy: dict, deep: bool) -> str:
    from .memory_source import check_copy
    return check_copy(copy["folder"], copy["record"], deep)


def _check_remote(store, files: list[str]) -> str:
    """"ok" or why not: every chunk checksum of a step's gdsckpt objects."""
    from .steps import SUFFIX
    from .store_verify import verify_object
    try:
        for f in files:
            if f.endswith(SUFFIX):
                verify_object(store, f)
    except (GdsckptError, OSError) as e:
        return f"DAMAGED: {type(e).__name__}: {e}"
    return "ok"


def restore_test(location: str, *, remote: str | None = None) -> tuple[int | None, list[dict]]:
    """Verify steps newest first, every chunk checksum, until one is intact: (that step or None,
    the rows checked). What restore() would do, without loading."""
    from .steps import check_step
    from .stores import open_store
    checked = []
    for r in reversed(describe(location, remote=remote)):
        if r["memory"] is not None and r["memory_state"] == "ok":
            copies = [c for c in _memory_copies(Path(location)) if c["step"] == r["step"]]
            states = [_memory_state(c, deep=True) for c in copies]
            r["memory_state"] = next((s for s in states if s != "ok"), "ok")
        if r["local"] is not None:
            r["local_state"] = check_step(Path(r["local"]), deep=True)
        if r["remote"] is not None and r["remote_state"] == "ok":
            r["remote_state"] = _check_remote(open_store(r["remote"].rsplit("/", 1)[0]), r["remote_files"])
        checked.append(r)
        if "ok" in (r["memory_state"], r["local_state"], r["remote_state"]):
            return r["step"], checked
    return None, checked


def _where(r) -> str:
    return "+".join(w for w in ("memory", "local", "remote") if r[w] is not None)


def cmd_ls(args) -> int:
    rows = describe(args.location, remote=args.remote, deep=args.verify)
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    if not rows:
        print(f"no steps in {args.location}" + (f" or {args.remote}" if args.remote else ""))
        return 0
    print(f"{'step':>10}  {'where':<20}{'memory size':>12}{'local size':>12}{'remote size':>13}  state")
    for r in rows:
        states = [f"{w}: {r[w + '_state']}" for w in ("memory", "local", "remote") if r[w] is not None]
        print(f"{r['step']:>10}  {_where(r):<20}{_size(r['memory_bytes']) if r['memory'] else '-':>12}"
              f"{_size(r['local_bytes']) if r['local'] else '-':>12}"
              f"{_size(r['remote_bytes']) if r['remote'] else '-':>13}  {'; '.join(states)}")
    return 0


def cmd_restore_test(args) -> int:
    step, checked = restore_test(args.location, remote=args.remote)
    for r in checked:
        states = [f"{w}: {r[w + '_state']}" for w in ("memory", "local", "remote") if r[w] is not None]
        print(f"step {r['step']}: {'; '.join(states)}")
    if step is None:
        print(f"gdsckpt restore-test: no intact step in {args.location}", file=sys.stderr)
        return 2
    newest = checked[0]["step"]
    print(f"restore() would use step {step}" + ("" if step == newest else f", not the newer step {newest}"))
    return 0 if step == newest else 1


def cmd_prune(args) -> int:
    from .manager import Checkpointer
    if not Path(args.directory).is_dir():  # a typo: never create it (the Checkpointer would)
        raise FileNotFoundError(errno.ENOENT, "No such checkpoint directory", args.directory)
    ck = Checkpointer(args.directory, keep=args.keep, remote=args.remote, keep_remote=args.keep_remote,
                      upload=False)
    try:
        gone = ck.prune(dry_run=not args.yes)
    finally:
        ck.close(wait_uploads=False)
    for step, why in gone["damaged"].items():
        print(f"local step {step} is damaged (kept; it does not count toward --keep): {why}")
    verb = "removed" if args.yes else "would remove"
    print(f"{verb}: local steps {gone['local'] or 'none'}; remote steps {gone['remote'] or 'none'}")
    if not args.yes and (gone["local"] or gone["remote"]):
        print("re-run with --yes to remove them")
    return 0


def _add_manager_commands(sub) -> None:
    p = sub.add_parser("ls", help="steps of a Checkpointer directory or s3:// prefix: where, size, intact")
    p.add_argument("location", help="a checkpoint directory or s3://bucket/prefix")
    p.add_argument("--remote", help="also list this s3://bucket/prefix")
    p.add_argument("--verify", action="store_true", help="check every chunk checksum (reads every byte)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_ls)
    p = sub.add_parser("restore-test", help="verify the newest step (newest first until one is intact); "
                       "exit 0: the newest is intact, 1: an older one would be restored, 2: none")
    p.add_argument("location", help="a checkpoint directory or s3://bucket/prefix")
    p.add_argument("--remote", help="the directory's s3://bucket/prefix")
    p.set_defaults(fn=cmd_restore_test)
    p = sub.add_parser("prune", help="apply the Checkpointer's retention now (never a step's only copy); "
                       "takes the directory's lock")
    p.add_argument("directory")
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--remote", help="the directory's s3://bucket/prefix")
    p.add_argument("--keep-remote", type=int, default=None)
    p.add_argument("--yes", action="store_true", help="remove (without it: list what would go)")
    p.set_defaults(fn=cmd_prune)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gdsckpt", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("inspect", help="tensors, dtypes, shapes, and codec and ratio per stream")
    p.add_argument("path")
    p.add_argument("--summary", action="store_true", help="streams only, no tensor list")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("verify", help="check every chunk's checksum (no GPU needed)")
    p.add_argument("path")
    p.add_argument("--deep", action="store_true", help="also decode every chunk")
    p.add_argument("--isolated", action="store_true",
                   help="decode every chunk in a child process, none in this one (files from elsewhere: a "
                        "forged chunk that faults a GPU decoder takes down only the child)")
    p.set_defaults(fn=cmd_verify)
    p = sub.add_parser("convert", help="rewrite with another codec (zstd: readable on any CPU)")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--codec", default="zstd", choices=[*codecs.ALL_CODECS, "auto"])
    p.set_defaults(fn=cmd_convert)
    p = sub.add_parser("clean", help="list (and with --yes remove) temporaries left by killed saves and restores")
    p.add_argument("directory")
    p.add_argument("--yes", action="store_true")
    p.add_argument("--memory", action="store_true",
                   help="also drop the directory's memory-tier copies on this host (refused while a manager holds them)")
    p.set_defaults(fn=cmd_clean)
    _add_manager_commands(sub)
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except (GdsckptError, OSError, KeyError) as e:  # OSError: missing, unreadable, a directory...
        print(f"gdsckpt {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
