"""Whose the memory tier's files are (gdsckpt/manager/memory/tier.py): its folders live in a place every
local user may write (/dev/shm), under names anyone can work out, so nothing there is trusted
for being where it is.

* A folder or file counts only if this user owns it and no one else may write it (no group or
  other write bit), and only as what it is (a folder, a regular file: never a symbolic link). The
  tier's own folder otherwise is refused (MemoryTierTrustError, naming it); a stray file inside
  is removed with a warning and never loaded.
* What identifies a copy (the directory's tier id, owner.json, commit records) is written 0o600,
  the folders 0o700: not readable by other users.
* A commit record is sealed: an HMAC, keyed with the tier id, of the step, the slot, the image's
  length and its footer (which carries the index's checksum). A record relabelled with another
  step, or naming another image, does not match its seal: that copy is damaged, never restored.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from pathlib import Path

from gdsckpt.errors import MemoryTierTrustError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
PRIVATE_FILE = 0o600
PRIVATE_FOLDER = 0o700


def not_mine(st: os.stat_result) -> str | None:
    """None if what `st` describes is this user's and no one else may write it, else why not."""
    me = os.geteuid()
    if st.st_uid != me:
        return f"owned by uid {st.st_uid}, not by this user (uid {me})"
    if st.st_mode & 0o022:
        return f"writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def untrusted_entry(path: Path) -> str | None:
    """None if `path` is a regular file of this user's that no one else may write, else why not
    (lstat: a symbolic link is never followed)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
    return not_mine(st)


def untrusted_fd(fd: int) -> str | None:
    """untrusted_entry of an open file (what was opened, whatever its name holds now)."""
    st = os.fstat(fd)
    return "not a regular file" if not stat.S_ISREG(st.st_mode) else not_mine(st)


def untrusted_folder(folder: Path) -> str | None:
    """None if `folder` is a folder (not a link to one) of this user's that no one else may
    write, else why not."""
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        return "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a folder"
    return not_mine(st)


def own_folder(folder: Path) -> None:
    """Make the tier's folder `folder` (0o700), or take the one there if it is this user's own;
    MemoryTierTrustError, naming it, if it is not (a restore would load whatever it holds). One
    of this user's that others may read is made private (0o700)."""
    try:
        os.mkdir(folder, PRIVATE_FOLDER)
    except FileExistsError:
        pass
    why = untrusted_folder(folder)
    if why is not None:
        raise MemoryTierTrustError(
            f"the memory tier's folder {str(folder)!r} is {why}: refused, since a restore would load the copies "
            "it holds; remove it (as its owner or root) or set GDSCKPT_MEMORY_ROOT to a folder of your own",
            path=folder)
    if os.lstat(folder).st_mode & 0o077:
        os.chmod(folder, PRIVATE_FOLDER)


def make_private(path: Path) -> None:
    """A file of this user's that others may read is made 0o600 (one an earlier version wrote)."""
    st = os.lstat(path)
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
        os.chmod(path, PRIVATE_FILE)


def read_private(path: Path) -> str | None:
    """The text of `path` if it is a regular file of this user's that no one else may write (a
    link is not followed); None if it is missing or not trusted."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError:  # missing, a symbolic link (ELOOP), not ours to read
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not_mine(st) is not None:
            return None
        chunks = []
        while True:
            b = os.read(fd, 1 << 16)
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks).decode(errors="replace")
    finally:
        os.close(fd)


def write_private(path: Path, text: str, durable: bool = False) -> None:
    """`text` into `path`, 0o600, atomically (a temporary file renamed over it); durable: synced
    first."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, PRIVATE_FILE)
    try:
        data = text.encode()
        while data:
            data = data[os.write(fd, data):]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def seal(ident: str, step: int, slot: str, nbytes: int, footer_hex: str) -> str:
    """The commit record's seal: binds the step to the image (slot, length, footer: the index's
    checksum), keyed with the directory's tier id."""
    msg = f"gdsckpt-memory-commit\0{int(step)}\0{slot}\0{int(nbytes)}\0{footer_hex.lower()}".encode()
    return hmac.new(ident.encode(), msg, hashlib.sha256).hexdigest()


def unsealed(rec: dict, name: str, ident: str | None) -> str | None:
    """None if the commit record `rec`, found under the name `name`, is the one sealed for its
    step and image with the tier id `ident`, else why not (the copy is damaged: never restored)."""
    step = int(rec["step"])
    if name != f"step_{step:08d}.commit":
        return f"its record names step {step} under the name {name}: relabelled"
    want = None if ident is None else seal(ident, step, rec["slot"], rec["bytes"], rec["footer"])
    if want is None or not hmac.compare_digest(str(rec.get("seal", "")), want):
        return (f"its record's seal does not match step {step} and the image it names (relabelled, altered, or "
                "written by an earlier version)")
    return None


def index_checksum(footer_hex: str) -> int:
    """The index's checksum in an image's footer (format.py: magic, major, minor, flags, index
    offset, length, checksum, ...)."""
    return int.from_bytes(bytes.fromhex(footer_hex)[32:40], "little")
