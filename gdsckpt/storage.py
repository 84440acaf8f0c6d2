"""Host-side file operations: the temporary's name, positional reads and writes of host bytes,
fsync, and the atomic commit. Chunk bytes move through the backends' files
(gdsckpt/cpu_backend.py, gdsckpt/gpu/io.py); the header, index and footer, which are small and
live in host memory, and the commit go through here."""

from __future__ import annotations

import errno
import os
import secrets
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TMP_MARK = ".gdsckpt-tmp."


def user_path(path, op: str) -> Path:
    """`path` as a Path, or a TypeError that says what was wrong (None, a number, a file object)."""
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{op}: path must be a str or os.PathLike naming a checkpoint file, not "
                        f"{type(path).__name__} {path!r}"[:300])
    return Path(path)


def save_target(path: Path) -> Path:
    """The file a save to `path` replaces, checked before anything is written: `path` with its
    symlinks resolved (a save writes through a link, as torch.save does: the temporary goes beside
    the link's target and the rename replaces the target, so the link stays). Refuses a directory,
    a missing parent, a parent that is not a directory and a symlink loop, naming `path`."""
    real = Path(os.path.realpath(path))
    if real.is_symlink():  # realpath leaves a symlink loop where it is
        raise OSError(errno.ELOOP, "Too many levels of symbolic links", str(path))
    if real.is_dir():
        raise IsADirectoryError(errno.EISDIR, "Is a directory: a checkpoint path must name a file", str(path))
    if not real.parent.exists():
        raise FileNotFoundError(errno.ENOENT, f"No such directory {str(real.parent)!r} to save into", str(path))
    if not real.parent.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"{str(real.parent)!r} is not a directory", str(path))
    return real


def adopt_mode(fd: int, target: Path) -> None:
    """Give the temporary (open as `fd`, created with 0o666 less the umask, as torch.save's files
    are) the mode of the checkpoint it replaces, and its owner where we may (root): a replaced
    0600 file stays 0600. A new file keeps the umask's mode."""
    try:
        st = os.stat(target)
    except FileNotFoundError:
        return
    os.fchmod(fd, stat.S_IMODE(st.st_mode))
    mine = os.fstat(fd)
    if (mine.st_uid, mine.st_gid) != (st.st_uid, st.st_gid):
        try:
            os.fchown(fd, st.st_uid, st.st_gid)
        except OSError:  # not root: the new file is ours, as any file we create
            pass


def temp_path_for(path: Path) -> Path:
    """A fresh temporary beside `path`, named so that `gdsckpt clean` can find it and its writer's pid."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}.{secrets.token_hex(4)}")


# Lets go of replaced checkpoints off the caller's thread (see commit).
_releaser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gdsckpt-release")


def commit(tmp: Path, path: Path) -> None:
    """Atomic replace, then make the rename itself durable.

    A checkpoint being replaced is held open across the rename and closed on a background thread
    afterwards, so that freeing its blocks happens after the save returns, not inside it: on the
    H100 host's disk, replacing a 3.6 GB checkpoint cost ~1 s in the directory fsync against
    8 ms for a fresh name (bench/results/2026-11-22-h100-i/save-overhead.json). The name points
    at a complete checkpoint, old or new, throughout."""
    try:
        old = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:  # nothing there yet (or nothing we may open): nothing to defer
        old = None
    try:
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if old is not None:
            _releaser.submit(os.close, old)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def pread_exact(fd: int, n: int, offset: int) -> bytes:
    data = os.pread(fd, n, offset)
    while len(data) < n:
        more = os.pread(fd, n - len(data), offset + len(data))
        if not more:
            break
        data += more
    return data
