"""Where a checkpoint directory's memory copies live on this host, and whose they are (the
memory tier's layout and identity: gdsckpt/manager/memory/tier.py's docstring): one folder per directory
and rank under the root, its owner file naming the directory's tier id, commit records checked
against the segments they name; read without the tier's lock by the CLI (`ls`, `clean --memory`).
The peer replicas a rank holds for another (gdsckpt/manager/replicas/store.py) are tiers of the same
shape, in folders named after the origin's own with REPLICA_TAG and the holder's rank.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import socket
from pathlib import Path

from gdsckpt.format import file as fmt
from gdsckpt.core.dirlock import DirectoryLock
from gdsckpt.errors import CheckpointLockedError
from .trust import PRIVATE_FILE, make_private, read_private, unsealed, untrusted_folder, write_private
from gdsckpt.core.storage import fsync_dir

log = logging.getLogger("gdsckpt.memory")

ROOT_ENV = "GDSCKPT_MEMORY_ROOT"
DEFAULT_ROOT = "/dev/shm"
ID_NAME = ".gdsckpt-memory-id"  # in the checkpoint directory
OWNER = "owner.json"
COMMIT_NAME = re.compile(r"^step_(\d{8,})\.commit$")
SLOT_NAME = re.compile(r"^slot-(\d+)$")
REPLICA_TAG = ".replica-r"  # <origin's tier folder>.replica-r<holder>: a peer replica's folder
TIER_NAME = re.compile(r"^gdsckpt-.*-([0-9a-f]{12})-r\d+(?:\.replica-r(\d+))?$")  # _prefix + rank [+ holder]


def memory_root() -> Path:
    return Path(os.environ.get(ROOT_ENV) or DEFAULT_ROOT)


def _prefix(directory: Path) -> str:
    real = os.path.realpath(directory)
    digest = hashlib.sha256(real.encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(real))[:32] or "root"
    return f"gdsckpt-{name}-{digest}-r"


def tier_folder(directory: Path, rank: int, root: Path | None = None) -> Path:
    """Where the copies of `directory`'s rank `rank` live on this host."""
    return (root or memory_root()) / f"{_prefix(directory)}{rank}"


def tier_folders(directory: Path, root: Path | None = None) -> dict[int, Path]:
    """{rank: folder} of every rank of `directory` that has a tier on this host."""
    return dict(sorted((int(rest), folder) for rest, folder in _named_for(directory, root) if rest.isdigit()))


def replica_folders(directory: Path, root: Path | None = None) -> dict[tuple[int, int], Path]:
    """{(origin, holder): folder} of every peer replica tier of `directory` on this host."""
    out = {}
    for rest, folder in _named_for(directory, root):
        origin, tag, holder = rest.partition(REPLICA_TAG)
        if tag and origin.isdigit() and holder.isdigit():
            out[(int(origin), int(holder))] = folder
    return dict(sorted(out.items()))


def _named_for(directory: Path, root: Path | None) -> list[tuple[str, Path]]:
    """(what follows the prefix, folder) of every entry under the root named for `directory`."""
    prefix, root = _prefix(directory), root or memory_root()
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return []
    return [(name[len(prefix):], root / name) for name in entries if name.startswith(prefix)]


def directory_id(directory: Path, create: bool) -> str | None:
    """The directory's tier id; made now where there is none and `create` (link(): of two
    processes making it at once, the first wins and both read its id). Readable by this user
    only (0o600: an earlier version's readable by others is made so when `create`)."""
    path = Path(directory) / ID_NAME
    try:
        ident = path.read_text().strip() or None
        if create:
            make_private(path)
        return ident
    except FileNotFoundError:
        if not create:
            return None
    except PermissionError:  # another user's directory: its copies are not this user's either
        if not create:
            return None
        raise
    tmp = path.with_name(f"{ID_NAME}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), PRIVATE_FILE)
    try:
        os.write(fd, (secrets.token_hex(16) + "\n").encode())
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text().strip()


def renew_directory_id(directory: Path) -> str | None:
    """A new tier id for `directory`, where it has one (None where it has none): every memory
    copy of it, on any host, is another run's from now on (removed by the next manager of its
    folder, never restored). Durable before the caller writes or removes a step."""
    path = Path(directory) / ID_NAME
    if not path.exists():
        return None
    ident = secrets.token_hex(16)
    write_private(path, ident + "\n", durable=True)
    fsync_dir(path.parent)
    return ident


def read_record(path: Path) -> dict | None:
    """A commit record, or None where it is not one (torn, not this user's own: memory_trust)."""
    try:
        rec = json.loads(read_private(path) or "")
        int(rec["step"]), str(rec["slot"]), int(rec["bytes"]), bytes.fromhex(rec["footer"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return rec


def check_record(folder: Path, rec: dict) -> str | None:
    """None if the slot the record names holds its image's end as committed, else why not."""
    path = folder / rec["slot"]
    if not SLOT_NAME.match(rec["slot"]):
        return f"names {rec['slot']!r}, not a slot"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return f"its segment {rec['slot']} is gone"
    except OSError as e:  # a symbolic link (ELOOP), not ours to read
        return f"its segment {rec['slot']} cannot be opened ({e.strerror})"
    try:
        size = os.fstat(fd).st_size
        n = int(rec["bytes"])
        if n < fmt.HEADER_SIZE + fmt.FOOTER_SIZE or size < n:
            return f"its segment {rec['slot']} holds {size} bytes, not the {n} committed"
        if os.pread(fd, fmt.FOOTER_SIZE, n - fmt.FOOTER_SIZE) != bytes.fromhex(rec["footer"]):
            return f"its segment {rec['slot']} no longer ends in the committed footer"
    finally:
        os.close(fd)
    return None


def list_copies(directory: Path, root: Path | None = None) -> list[dict]:
    """Every rank's commit records of `directory` on this host, read without a lock (the CLI's
    `ls`): [{"rank", "step", "bytes", "folder", "record", "damaged"}], by rank and step; check
    them with memory_source.check_copy ("damaged": why a record is not the one sealed for its
    step and image, or None). Folders and records not this user's own are left out."""
    return _records(directory, tier_folders(directory, root).items())


def list_replicas(directory: Path, root: Path | None = None) -> list[dict]:
    """The peer replicas of `directory` held on this host, as list_copies lists a rank's own
    copies, each also naming its "holder" ("rank" is the origin, whose copy it is). A replica's
    commit record is written only once every chunk was checked on arrival (replicas/store.py)."""
    folders = replica_folders(directory, root)
    rows = _records(directory, [(origin, f) for (origin, _), f in folders.items()])
    holder = {f: h for (_, h), f in folders.items()}
    return [{**r, "holder": holder[r["folder"]]} for r in rows]


def _records(directory: Path, folders) -> list[dict]:
    ident = directory_id(directory, create=False)
    out = []
    for rank, folder in folders:
        if ident is None or trusted(folder) is None or owner_of(folder).get("id") != ident:
            continue  # another run's, under this path (or another user's): not this directory's
        for name in sorted(os.listdir(folder)):
            m = COMMIT_NAME.match(name)
            rec = read_record(folder / name) if m else None
            if rec is None:
                continue
            out.append({"rank": rank, "step": int(rec["step"]), "bytes": int(rec["bytes"]), "folder": folder,
                        "record": rec, "damaged": unsealed(rec, name, ident)})
    return out


def trusted(folder: Path) -> Path | None:
    """`folder` if it is this user's own and no one else may write it, else None (logged)."""
    try:
        why = untrusted_folder(folder)
    except FileNotFoundError:
        return None
    if why is not None:
        log.warning("gdsckpt: %s is %s: not this user's memory tier, left alone", folder, why)
        return None
    return folder


def drop_copies(directory: Path, root: Path | None = None, on_disk: set[int] | None = None) -> list[dict]:
    """Remove every rank's memory tier of `directory` on this host (`gdsckpt clean --memory`),
    the peer replicas held here (but kept_replicas'), and those it left under the path it had
    before it was moved (its tier id is theirs, their directory is gone): [{"rank", "holder",
    "folder", "bytes", "steps"}] ("holder": None for a rank's own). on_disk: the directory's steps
    (None: it is gone). CheckpointLockedError, before anything is removed, if a manager holds one
    of them. Folders not this user's own are left alone (a warning names them)."""
    folders = [(rank, None, f) for rank, f in tier_folders(directory, root).items() if trusted(f) is not None]
    kept = {k["folder"] for k in kept_replicas(directory, on_disk, root)}
    folders += [(origin, holder, f) for (origin, holder), f in replica_folders(directory, root).items()
                if f not in kept and trusted(f) is not None]
    ident = directory_id(directory, create=False)
    if ident is not None:
        folders += [(t["rank"], t["holder"], t["folder"]) for t in gone_tiers(root) if t["id"] == ident]
    locks = []
    try:
        for _, _, folder in folders:
            locks.append(DirectoryLock(folder))
        out = []
        for rank, holder, folder in folders:
            held, steps = empty_folder(folder)
            out.append({"rank": rank, "holder": holder, "folder": str(folder), "bytes": held, "steps": steps})
        return out
    finally:
        for lock in locks:
            lock.release()


def kept_replicas(directory: Path, on_disk: set[int] | None, root: Path | None = None) -> list[dict]:
    """The replica folders of `directory` that `clean --memory` keeps: those whose newest step is
    on no disk (`on_disk`, the directory's steps), which may be their origin's only other copy of
    it, while the origin's manager, on another node, may be alive (the rule a holder's own tier
    keeps: replicas/store.py). None where the directory is gone: a replica is found by its
    directory's path and tier id, which no restore can name any more, so it is kept for no one.
    [{"rank" (the origin), "holder", "folder", "step", "why"}]."""
    if on_disk is None:
        return []
    ident, out = directory_id(directory, create=False), []
    for (origin, holder), folder in replica_folders(directory, root).items():
        if ident is None or owner_of(folder).get("id") != ident:
            continue  # another run's: nothing of this directory's
        steps = [int(m.group(1)) for m in map(COMMIT_NAME.match, _names(folder)) if m]
        if steps and max(steps) not in on_disk:
            out.append({"rank": origin, "holder": holder, "folder": folder, "step": max(steps),
                        "why": f"rank {origin}'s step {max(steps)} is on no disk: this replica may be its only "
                               "other copy while its manager, on another node, may be alive"})
    return out


def _names(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def empty_folder(folder: Path) -> tuple[int, list[int]]:
    """Remove a tier folder whose lock the caller holds, and everything in it (the lock file
    too, while it is held: a manager starting now makes a new folder): (bytes its segments
    held, the steps it had committed)."""
    names = os.listdir(folder)
    steps = sorted(int(m.group(1)) for m in map(COMMIT_NAME.match, names) if m)
    held = sum(_size(folder / n) for n in names if SLOT_NAME.match(n))
    for n in names:
        (folder / n).unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:
        pass
    return held, steps


# ---------------------------------------------------------------- folders whose directory is gone
# A directory moved or removed leaves its tier folders under a name no manager of another path
# looks for: found by their owner files (this user's, this host's), removed once no process holds
# their lock.


def gone_tiers(root: Path | None = None) -> list[dict]:
    """This user's tier folders made on this host whose directory is gone (moved or removed),
    read without a lock: [{"folder", "directory", "rank", "holder", "id", "bytes", "steps"}]
    ("holder": the rank holding a peer replica's folder, None for a rank's own). A replica
    goes as its own tier does, once its holder's manager is gone (its lock free): restores look
    a replica up by its directory's path and tier id, and no restore can name a gone one's."""
    root = root or memory_root()
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    host, out = socket.gethostname(), []
    for name in names:
        m = TIER_NAME.match(name)
        folder = root / name
        try:
            if m is None or untrusted_folder(folder) is not None:
                continue  # not a tier, or another user's: not this user's to judge
        except OSError:
            continue
        owner = owner_of(folder)
        directory = owner.get("directory")
        # Only the folder of this very path (its name's hash), made on this host (a container with
        # another hostname sharing /dev/shm may see directories this one does not).
        if (not isinstance(directory, str) or owner.get("host") != host or m.group(1) != hashlib.sha256(
                directory.encode()).hexdigest()[:12] or not is_gone(directory)):
            continue
        try:
            entries = os.listdir(folder)
        except OSError:
            continue
        out.append({"folder": folder, "directory": directory, "rank": owner.get("rank"),
                    "holder": int(m.group(2)) if m.group(2) else None, "id": owner.get("id"),
                    "bytes": sum(_size(folder / n) for n in entries if SLOT_NAME.match(n)),
                    "steps": sorted(int(c.group(1)) for c in map(COMMIT_NAME.match, entries) if c)})
    return out


def is_gone(path: str) -> bool:
    """Whether nothing is at `path` (not: cannot be looked at, say a folder above it not ours)."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False
    return False


def reclaim_gone(root: Path | None = None, *, beside_parent: bool) -> list[dict]:
    """Remove this user's tier folders whose directory is gone (gone_tiers) and that no process
    holds (their lock is free): what went, as gone_tiers lists it. beside_parent: only those whose
    directory's parent folder is still there (a whole tree missing may be a file system not
    mounted now; the CLI's `clean --memory --yes` removes those too)."""
    out = []
    for t in gone_tiers(root):
        if beside_parent and is_gone(os.path.dirname(t["directory"])):
            continue
        try:
            lock = DirectoryLock(t["folder"])
        except (CheckpointLockedError, OSError):
            continue  # a live manager holds it (or it went meanwhile)
        try:
            if is_gone(t["directory"]) and owner_of(t["folder"]).get("id") == t["id"]:
                t["bytes"], t["steps"] = empty_folder(t["folder"])
                out.append(t)
        finally:
            lock.release()
    return out


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def owner_of(folder: Path) -> dict:
    """The folder's owner file ({} where there is none, or it is not this user's own)."""
    try:
        owner = json.loads(read_private(folder / OWNER) or "")
        return owner if isinstance(owner, dict) else {}
    except ValueError:
        return {}
