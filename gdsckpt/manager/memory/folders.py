"""Where a checkpoint directory's memory copies live on this host, and whose they are (the
memory tier's layout and identity: gdsckpt/manager/memory/tier.py's docstring): one folder per directory
and rank under the root, its owner file naming the directory's tier id, commit records checked
against the segments they name; read without the tier's lock by the CLI (`ls`, `clean --memory`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from pathlib import Path

from gdsckpt.format import file as fmt
from gdsckpt.core.dirlock import DirectoryLock
from gdsckpt.core.storage import fsync_dir

ROOT_ENV = "GDSCKPT_MEMORY_ROOT"
DEFAULT_ROOT = "/dev/shm"
ID_NAME = ".gdsckpt-memory-id"  # in the checkpoint directory
OWNER = "owner.json"
COMMIT_NAME = re.compile(r"^step_(\d{8,})\.commit$")
SLOT_NAME = re.compile(r"^slot-(\d+)$")


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
    prefix = _prefix(directory)
    out = {}
    try:
        entries = os.listdir(root or memory_root())
    except FileNotFoundError:
        return {}
    for name in entries:
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            out[int(name[len(prefix):])] = (root or memory_root()) / name
    return dict(sorted(out.items()))


def directory_id(directory: Path, create: bool) -> str | None:
    """The directory's tier id; made now where there is none and `create` (link(): of two
    processes making it at once, the first wins and both read its id)."""
    path = Path(directory) / ID_NAME
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        if not create:
            return None
    tmp = path.with_name(f"{ID_NAME}.{os.getpid()}.{secrets.token_hex(4)}")
    tmp.write_text(secrets.token_hex(16) + "\n")
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
    tmp = path.with_name(f"{ID_NAME}.{os.getpid()}.{secrets.token_hex(4)}")
    with open(tmp, "w") as f:
        f.write(ident + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return ident


def read_record(path: Path) -> dict | None:
    """A commit record, or None where it is not one (torn, foreign)."""
    try:
        rec = json.loads(path.read_text())
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
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return f"its segment {rec['slot']} is gone"
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
    `ls`): [{"rank", "step", "bytes", "folder", "record"}], by rank and step; check them with
    memory_source.check_copy."""
    ident = directory_id(directory, create=False)
    out = []
    for rank, folder in tier_folders(directory, root).items():
        if ident is None or owner_of(folder).get("id") != ident:
            continue  # another run's, under this path: not this directory's
        for name in sorted(os.listdir(folder)):
            m = COMMIT_NAME.match(name)
            rec = read_record(folder / name) if m else None
            if rec is None:
                continue
            out.append({"rank": rank, "step": int(rec["step"]), "bytes": int(rec["bytes"]), "folder": folder,
                        "record": rec})
    return out


def drop_copies(directory: Path, root: Path | None = None) -> list[dict]:
    """Remove every rank's memory tier of `directory` on this host (`gdsckpt clean --memory`):
    [{"rank", "folder", "bytes", "steps"}]. CheckpointLockedError, before anything is removed,
    if a manager holds one of them."""
    folders = tier_folders(directory, root)
    locks = []
    try:
        for folder in folders.values():
            locks.append(DirectoryLock(folder))
        out = []
        for rank, folder in folders.items():
            names = os.listdir(folder)
            steps = sorted(int(m.group(1)) for m in map(COMMIT_NAME.match, names) if m)
            held = sum(_size(folder / n) for n in names if SLOT_NAME.match(n))
            for n in names:  # the lock file too, while it is held: a manager starting now makes a new folder
                (folder / n).unlink(missing_ok=True)
            try:
                folder.rmdir()
            except OSError:
                pass
            out.append({"rank": rank, "folder": str(folder), "bytes": held, "steps": steps})
        return out
    finally:
        for lock in locks:
            lock.release()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def owner_of(folder: Path) -> dict:
    try:
        owner = json.loads((folder / OWNER).read_text())
        return owner if isinstance(owner, dict) else {}
    except (OSError, ValueError):
        return {}
