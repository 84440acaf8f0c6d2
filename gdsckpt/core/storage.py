"""Host-side file operations: the temporary's name, positional reads and writes of host bytes,
O_DIRECT with its fallback, fsync, and the atomic commit (`AtomicFile`, `atomic_file`: every
writer of a file goes through them). Chunk bytes move through the backends' files
(gdsckpt/engine/cpu_backend.py, gdsckpt/engine/gpu/io.py); the header, index and footer, which are small and
live in host memory, and the commit go through here."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import socket
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Protocol

from .defaults import TEMP_STALE_AGE_S

TMP_MARK = ".gdsckpt-tmp."
# This host, as temporaries name their writer's: a pid says whether a writer is alive only on
# the host that ran it (a shared file system holds other hosts' temporaries too). The hostname
# and not the machine id: containers on one machine share its id, but each has its own pids.
HOST_ID = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
# `.NAME.gdsckpt-tmp.PID.HOST.NONCE`, and the earlier `.NAME.gdsckpt-tmp.PID.NONCE` (no host)
_TEMP_NAME = re.compile(r"\.(?P<target>.+)\.gdsckpt-tmp\.(?P<pid>[0-9]{1,10})\.(?:(?P<host>[0-9a-f]{8})\.)?[0-9a-f]{8}")


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
    a missing parent, a parent that is not a directory, a symlink loop and a special file (a
    device such as /dev/null, a FIFO, a socket: the rename would replace it), naming `path`."""
    real = Path(os.path.realpath(path))
    if real.is_symlink():  # realpath leaves a symlink loop where it is
        raise OSError(errno.ELOOP, "Too many levels of symbolic links", str(path))
    if real.is_dir():
        raise IsADirectoryError(errno.EISDIR, "Is a directory: a checkpoint path must name a file", str(path))
    if real.exists() and not real.is_file():
        raise OSError(errno.EINVAL, "Not a regular file (a device, FIFO or socket), which a save would replace "
                      "with a checkpoint: name a file", str(path))
    if not real.parent.exists():
        raise FileNotFoundError(errno.ENOENT, f"No such directory {str(real.parent)!r} to save into", str(path))
    if not real.parent.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"{str(real.parent)!r} is not a directory", str(path))
    return real


def export_target(src, dst, op: str) -> Path:
    """save_target of `dst` for a tool that writes another file from the checkpoint `src`: not
    `src` itself (the rename would replace the source by its export), a ValueError naming both."""
    real = save_target(user_path(dst, op))
    if real == Path(os.path.realpath(user_path(src, op))):
        raise ValueError(f"{op}: {str(dst)!r} is the source checkpoint {str(src)!r}; write the export elsewhere")
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
    """A fresh temporary beside `path`, hidden, named so that `stale_temporaries` can tell it from
    any other file and find its writer: `.NAME.gdsckpt-tmp.PID.HOST.NONCE`."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}.{HOST_ID}.{secrets.token_hex(4)}")


def stale_temporaries(directory: Path) -> list[Path]:
    """The temporaries in `directory` that no writer will finish: regular files named exactly as
    temp_path_for names them, written on this host by a process that is gone, or untouched for
    defaults.TEMP_STALE_AGE_S (another host's, whose pid says nothing here, and those of an
    earlier gdsckpt that named no host). Anything else is never listed: a user's
    `notes.gdsckpt-tmp.txt`, a directory, a symlink, another host's file being written."""
    out = []
    now = time.time()
    for p in Path(directory).iterdir():
        m = _TEMP_NAME.fullmatch(p.name)
        if m is None:
            continue
        try:
            st = p.lstat()
        except FileNotFoundError:  # committed or removed meanwhile
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        mine = m["host"] == HOST_ID
        if (mine and not process_alive(int(m["pid"]), started_by=st.st_mtime)) or now - st.st_mtime > TEMP_STALE_AGE_S:
            out.append(p)
    return sorted(out)


def process_alive(pid: int, *, started_by: float | None = None) -> bool:
    """Whether process `pid` runs on this host (another user's counts). started_by (a
    time.time()): only a process that had started by then counts, so a pid the kernel has since
    handed to a newer process does not keep a dead writer's temporary alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    except (OverflowError, ValueError):  # no such pid can exist
        return False
    if started_by is not None:
        start = _start_time(pid)
        if start is not None and start > started_by + 1.0:  # 1 s: /proc/stat's boot time is in whole seconds
            return False
    return True


def _start_time(pid: int) -> float | None:
    """When process `pid` started (time.time() scale), from /proc; None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22, starttime: after "pid (comm)"
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


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


class WriteHandle(Protocol):
    """An open file to write: a descriptor, and close (a backend's ChunkFile is one)."""

    fd: int

    def close(self) -> None: ...


class PlainFile:
    """A new file opened for writing by os.open: O_EXCL, 0o666 less the umask (as torch.save's)."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


class AtomicFile:
    """One new file that replaces `path` only once complete and durable: written as a temporary
    beside it (temp_path_for), then fsync -> rename over `path` -> fsync of the directory; abort
    removes the temporary. The one commit of every writer of a file (FORMAT.md, "Commit").

    Call order: create(opener) -> adopt_mode() -> the caller writes through `file` -> [sync()]
    -> commit() | abort(). create and adopt_mode leave no temporary behind when they raise; when
    the writing or commit raises, the caller calls abort() (after a rename that happened, it
    removes nothing)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.tmp = temp_path_for(self.path)
        self.file: WriteHandle | None = None
        self._closed = False

    def create(self, opener: Callable[[Path], WriteHandle] = PlainFile) -> WriteHandle:
        """Create the temporary: opener(tmp) must create it anew (O_EXCL) and open it for writing."""
        try:
            self.file = opener(self.tmp)
        except OSError as e:
            if e.errno != errno.EEXIST:  # an existing name is another writer's, never ours to remove
                self.tmp.unlink(missing_ok=True)
            raise
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise
        return self.file

    def adopt_mode(self) -> None:
        """Give the temporary the mode (and owner) of the file it replaces (see adopt_mode)."""
        try:
            adopt_mode(self.file.fd, self.path)
        except BaseException:
            self.abort()
            raise

    @property
    def fd(self) -> int:
        return self.file.fd

    def sync(self) -> None:
        """fsync the temporary and close it (commit does this first if it was not done)."""
        if not self._closed:
            os.fsync(self.file.fd)
            self.close()

    def commit(self) -> None:
        self.sync()
        commit(self.tmp, self.path)

    def abort(self) -> None:
        """Close and remove the temporary (nothing if create never made it, or after the rename)."""
        try:
            self.close()
        finally:
            if self.file is not None:
                self.tmp.unlink(missing_ok=True)

    def close(self) -> None:
        """Close the file (once); the temporary stays until commit or abort."""
        if not self._closed and self.file is not None:
            self._closed = True
            self.file.close()


@contextlib.contextmanager
def atomic_file(path: Path, opener: Callable[[Path], WriteHandle] = PlainFile) -> Iterator[AtomicFile]:
    """`with atomic_file(path) as f: pwrite_all(f.fd, data, 0)`: the file at `path` is replaced,
    durably, when the block ends, and left as it was (no temporary) if the block raises."""
    f = AtomicFile(path)
    f.create(opener)
    f.adopt_mode()
    try:
        yield f
        f.commit()
    except BaseException:
        f.abort()
        raise


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


IOV_MAX = 1024  # Linux's limit on the buffers of one pwritev


def pwritev_all(fd: int, views: list, offset: int) -> None:
    """Write the buffers `views` (memoryviews), in order, at `offset`: os.pwritev until all is written."""
    while views:
        n = os.pwritev(fd, views[:IOV_MAX], offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views = views[1:]
        if n:
            views = [views[0][n:]] + views[1:]


def open_direct(path: Path, flags: int = os.O_WRONLY) -> int:
    """A second descriptor on the file `path` with O_DIRECT (no page-cache copy; for writes,
    nothing left for the fsync), or -1 where this OS or the file system (tmpfs) refuses it at open."""
    if not hasattr(os, "O_DIRECT"):
        return -1
    try:
        return os.open(path, flags | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return -1


def pwrite_direct(dfd: int, data, offset: int) -> bool:
    """Write `data` (one buffer, or a list of buffers for pwritev) at `offset` through the O_DIRECT
    descriptor `dfd`. False where the file system refused the write (EINVAL: an alignment it
    wants, or O_DIRECT accepted at open and refused at write): the caller then writes the same
    bytes through its buffered descriptor. Any other error is raised."""
    try:
        if isinstance(data, list):
            pwritev_all(dfd, data, offset)
        else:
            pwrite_all(dfd, data, offset)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return False
    return True


def pread_exact(fd: int, n: int, offset: int) -> bytes:
    data = os.pread(fd, n, offset)
    while len(data) < n:
        more = os.pread(fd, n - len(data), offset + len(data))
        if not more:
            break
        data += more
    return data
