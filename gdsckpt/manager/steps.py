"""How a Checkpointer's steps lie in its directory, behind one Protocol (StepLayout):

* FileSteps: one gdsckpt file per step, DIR/step_00001000.gdsckpt, for a single process;
  committed once the file is renamed into place (gdsckpt.save is atomic and durable);
* DcpSteps: under torch.distributed, one DCP directory per step, DIR/step_00001000/
  (gdsckpt.dcp.GdsckptWriter: a file per rank and DCP's .metadata; DCP's plans cached between
  saves), the same calls on every rank; committed once its .metadata is written.

Temporaries of killed saves never count."""

from __future__ import annotations

import contextlib
import inspect
import os
import re
from concurrent.futures import CancelledError, Future
from pathlib import Path
from typing import Iterator

from gdsckpt import api
from gdsckpt.writing.snapshot import modes as snapshot_modes
from gdsckpt.writing.async_save import SaveFuture, save_async
from gdsckpt.errors import CheckpointFormatError, GdsckptError, StateMismatchError, VersionError
from gdsckpt.dcp.rank_values import check_alike
from gdsckpt.writing.save import check_save_options
from gdsckpt.format.stateful import dcp_view, dcp_write_back
from .interfaces import StepLayout
from .step_listing import StepListing
from .step_removal import remove_step_path
from gdsckpt.core.storage import fsync_dir, stale_temporaries, temp_path_for

SUFFIX = ".gdsckpt"
DCP_METADATA = ".metadata"
_STEP = re.compile(r"^step_(\d{8,})(\.gdsckpt)?$")
# Where a restore puts a step from the store: a file step, named with the restoring pid
# (FileSteps.fetched), and a DCP step's directory, renamed into place once complete (DcpSteps.fetched).
_DCP_DOWNLOAD = re.compile(r"\.step_\d{8,}\.download")
# What restore falls back from: a step that is damaged, incomplete or unreadable. A state that
# does not match the checkpoint, or a codec this machine lacks, is the caller's to fix: raised.
DAMAGE = (CheckpointFormatError, OSError)


@contextlib.contextmanager
def agreed(label, what: str, *, damage: tuple = DAMAGE, filled: str = "") -> Iterator:
    """Under torch.distributed: every rank runs the block (restoring `what`: "step 5 from memory",
    say), then all learn whether any failed. A `damage` failure on any rank: CheckpointFormatError
    on every rank naming the failed ranks, the first failure and `filled` (formatted with the ranks
    that did not fail), so that every rank falls back alike. Any other failure (a load_state_dict's
    own error, say) is raised as it is on its rank, and as a GdsckptError naming that rank on the
    others. Every rank joins the gather: none is left in a collective the others never reach.
    The block may set `.label` on what it is given (names the source in the error)."""
    import types
    import torch.distributed as dist
    mine = types.SimpleNamespace(label=label)
    why, unexpected = None, None
    try:
        yield mine
    except damage as e:
        why = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - told to every rank, then raised as it is here
        why, unexpected = f"{type(e).__name__}: {e}", e
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (why, unexpected is not None))
    if unexpected is not None:
        raise unexpected
    failed = {r: w for r, (w, _) in enumerate(every) if w is not None}
    ok = [r for r in range(len(every)) if r not in failed]
    filled = filled.format(filled=ok) if ok else ""
    odd = [r for r, (_, u) in enumerate(every) if u]
    if odd:
        raise GdsckptError(f"rank(s) {odd} failed restoring {what}: {every[odd[0]][0]}{filled}")
    if failed:
        raise CheckpointFormatError(f"rank(s) {sorted(failed)} could not restore {what}: "
                                    f"{next(iter(failed.values()))}{filled}", path=mine.label)


def step_name(step: int, distributed: bool) -> str:
    return f"step_{step:08d}" if distributed else f"step_{step:08d}{SUFFIX}"


def parse_step_name(name: str) -> tuple[int, bool] | None:
    """(step, distributed) of a step's file or directory name; None for any other name."""
    m = _STEP.match(name)
    return (int(m.group(1)), not m.group(2)) if m else None


def check_step(path: Path, deep: bool) -> str:
    """"ok" or why not (step_damage)."""
    return step_damage(path, deep) or "ok"


def step_damage(path: Path, deep: bool) -> str | None:
    """Why the step at `path`, a file or a DCP directory, is not intact, or None: the footer and
    index of each of its gdsckpt files checked against their checksums, and a DCP step's
    .metadata read (deep: every chunk checksum too, which reads every byte)."""
    files = [path]
    if path.is_dir():
        if not (path / DCP_METADATA).is_file():
            return "incomplete (no .metadata)"
        try:
            names = dcp_files(path)
        except VersionError:
            raise
        except DAMAGE as e:
            return f"DAMAGED: {type(e).__name__}: {e}"
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            return f"DAMAGED: {', '.join(missing)}, named by its {DCP_METADATA}, missing"
        files = [path / n for n in names]
    try:
        for f in files:
            with api.open(f) as ck:
                if deep:
                    ck.verify()
    except (GdsckptError, OSError) as e:
        return f"DAMAGED: {type(e).__name__}: {e}"
    return None


def dcp_files(path: Path) -> list[str]:
    """The rank files the DCP step directory `path` is made of, as its .metadata's storage_data
    names them (sorted): a step lacking one is incomplete, whichever files the directory holds.
    CheckpointFormatError naming the .metadata if it cannot be read or names something other
    than a gdsckpt file in the directory; VersionError raised as it is."""
    from gdsckpt.dcp.metadata import read_metadata
    meta = path / DCP_METADATA
    try:
        metadata = read_metadata(meta)
    except FileNotFoundError as e:
        raise CheckpointFormatError(f"incomplete: {type(e).__name__}: {e}", path=meta) from None
    names = set()
    for v in (metadata.storage_data or {}).values():
        name = v.get("file") if isinstance(v, dict) else None
        if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
            raise CheckpointFormatError(f"an item's storage data names no gdsckpt file in the step ({v!r})", path=meta)
        names.add(name)
    return sorted(names)


def metadata_damage(path: Path) -> str | None:
    """Why a DCP step directory's .metadata cannot be read, or None. VersionError is raised: a
    newer format is not damage."""
    from gdsckpt.dcp import GdsckptReader
    try:
        GdsckptReader(path).read_metadata()
    except VersionError:
        raise
    except DAMAGE as e:  # damaged, truncated, empty, a planted payload (dcp.metadata refuses it), unreadable
        return f"{type(e).__name__}: {e}"
    return None


def _identity(path: Path) -> tuple:
    """What changes when a step's files are replaced or written to."""
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    out = []
    for f in files:
        st = f.stat()
        out.append((f.name, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def save_failure(e: BaseException, step: int, path: Path) -> GdsckptError:
    """DCP's CheckpointException of a failed save (a BaseException, which `except Exception`
    misses) as a GdsckptError naming the step, its directory, the ranks that failed and the
    first one's error; the CheckpointException is its cause."""
    failures = dict(sorted(getattr(e, "failures", {}).items()))
    rank, (first, _) = next(iter(failures.items()), (None, (e, None)))
    err = GdsckptError(f"saving step {step} to {str(path)!r} failed on rank(s) {sorted(failures)}: "
                       f"rank {rank}: {type(first).__name__}: {first}")
    err.__cause__ = e
    return err


def relayed(fut: Future, convert=None) -> Future:
    """A SaveFuture (which knows whether its outcome was looked at) with `fut`'s outcome (an
    error through `convert`, if given)."""
    out = SaveFuture()
    out.set_running_or_notify_cancel()

    def relay(f):
        if f.cancelled():
            out.set_exception(CancelledError())
            return
        err = f.exception()
        if err is None:
            out.set_result(f.result())
        else:
            out.set_exception(convert(err) if convert is not None else err)
    fut.add_done_callback(relay)
    return out


def async_options(save_options: dict, optimizer) -> dict:
    """save_async's keywords for a step of the Checkpointer's save_options: with optimizer=, the
    overlapped snapshot where they name none (or "host", the default); a snapshot taken in the
    call ("device") stays, and no step waits for it."""
    if optimizer is None:
        return save_options
    mode = save_options.get("snapshot", "host")
    return {**save_options, "optimizer": optimizer, "snapshot": snapshot_modes.with_optimizer(mode)}


class _Steps:
    distributed: bool

    def __init__(self, directory: Path, save_options: dict):
        self.directory = directory
        self.save_options = save_options
        # a synchronous save takes no snapshot: save_options' snapshot= is the background save's alone
        self.sync_options = {k: v for k, v in save_options.items() if k != "snapshot"}
        self._checked: dict[int, tuple[tuple, bool, str | None]] = {}  # step: (identity, deep, why)
        self._damaged: dict[int, str] = {}  # the steps of _checked found damaged: {step: why}
        self._listing = StepListing(directory, self._parse, self.committed, records=self.records_own_changes())

    def records_own_changes(self) -> bool:
        """Whether the listing records this process's own changes (step_listing.StepListing)."""
        return True

    def _parse(self, name: str) -> int | None:
        parsed = parse_step_name(name)
        return parsed[0] if parsed and parsed[1] == self.distributed else None

    def damage(self, step: int, deep: bool = False) -> str | None:
        path = self.path(step)
        try:
            ident = _identity(path)
        except OSError as e:  # removed meanwhile, or unreadable
            self._checked.pop(step, None)
            self._damaged[step] = why = f"DAMAGED: {type(e).__name__}: {e}"
            return why
        known = self._checked.get(step)
        if known is not None and known[0] == ident and (known[1] or not deep):
            return known[2]
        why = step_damage(path, deep)
        self._checked[step] = (ident, deep or why is not None, why)  # damaged footer or index: damaged, deep too
        if why is None:
            self._damaged.pop(step, None)
        else:
            self._damaged[step] = why
        return why

    def unchecked(self, steps: list[int]) -> list[int]:
        return list(set(steps).difference(self._checked, self._damaged))

    def known_damage(self) -> dict[int, str]:
        if not self._damaged:
            return {}
        local = set(self.local_steps())
        return {s: why for s, why in sorted(self._damaged.items()) if s in local}

    def _forget(self, step: int) -> None:
        self._checked.pop(step, None)
        self._damaged.pop(step, None)

    def noted(self, step: int) -> None:
        """This process has just committed or removed `step` in the directory."""
        self._listing.noted(self.name(step))

    def name(self, step: int) -> str:
        return step_name(step, self.distributed)

    def barrier(self) -> None:
        pass

    def path(self, step: int) -> Path:
        return self.directory / self.name(step)

    def local_steps(self) -> list[int]:
        return self._listing.steps()  # kept between calls; the directory listed again once it changed


class FileSteps(_Steps):
    """One gdsckpt file per step. scratch: where a step from the store is downloaded (None: the
    directory)."""

    distributed = False
    loads_in_place = False

    def __init__(self, directory: Path, save_options: dict, scratch: Path | None = None):
        super().__init__(directory, save_options)
        self.scratch = scratch if scratch is not None else directory

    @staticmethod
    def check_options(save_options: dict) -> None:
        """A ValueError for an option gdsckpt.save and save_async do not both take (snapshot=:
        save_async's alone), or a bad value."""
        check_save_options(save_options, {"snapshot"}, snapshot_modes.names(snapshot_modes.SAVE_ASYNC))

    def committed(self, path: Path) -> bool:
        return path.is_file()

    def save(self, step: int, state) -> object:
        return api.save(state, self.path(step), **self.sync_options)

    def save_async(self, step: int, state, optimizer) -> Future:
        return save_async(state, self.path(step), **async_options(self.save_options, optimizer))

    def reserve(self, state, wait: bool) -> Future:
        from gdsckpt.writing.reserve import reserve
        return reserve(state, wait=wait, **self.save_options)

    def load(self, path: Path, state, device, strict: bool) -> tuple[object, object]:
        if state is not None:  # atomic: a damaged step leaves `state` as it was, for the fall-back
            return state, api.load_into(path, state, strict=strict, atomic=True)
        with api.open(path) as ck:
            out = ck.load(device)
            return out, ck.last_stats

    def delete(self, step: int) -> None:
        self._forget(step)
        remove_step_path(self.path(step))  # a linked step: the link alone
        self.noted(step)

    def files(self, step: int) -> list[tuple[Path, str]]:
        return [(self.path(step), self.name(step))]

    def leftovers(self) -> list[Path]:
        return stale_temporaries(self.directory)  # killed saves' and restores' (downloads) alike

    @contextlib.contextmanager
    def fetched(self, step: int, store) -> Iterator[tuple[Path, str]]:
        # downloaded into a temporary copy (named as every temporary: clean and the next manager
        # know it), removed after
        name = self.name(step)
        tmp = temp_path_for(self.scratch / name)
        try:
            store.download(name, tmp)
            yield tmp, store.url(name)
        finally:
            tmp.unlink(missing_ok=True)


class DcpSteps(_Steps):
    """One DCP directory per step, written and read by every rank (gdsckpt.dcp). group: the
    process group of save_async's collectives, which run on DCP's thread (process_groups.own_group;
    None: the default group, which the caller's own collectives must then not use meanwhile)."""

    distributed = True
    loads_in_place = True

    def __init__(self, directory: Path, save_options: dict, rank: int, group=None, downloads: bool | None = None):
        self.rank = rank
        self.group = group
        self.downloads = rank == 0 if downloads is None else downloads  # node-local directories: each one's first rank
        super().__init__(directory, save_options)

    def records_own_changes(self) -> bool:
        return self.rank == 0  # rank 0 removes steps: the other ranks list the directory after any change

    @staticmethod
    def check_options(save_options: dict) -> None:
        """A ValueError for an option GdsckptWriter does not take (optimizer= is save_async's
        argument), or a bad value."""
        from gdsckpt.dcp.writer import GdsckptWriter
        check_save_options(save_options, set(inspect.signature(GdsckptWriter).parameters) - {"path", "optimizer"},
                           snapshot_modes.names(snapshot_modes.DCP))

    def committed(self, path: Path) -> bool:
        return path.is_dir() and (path / DCP_METADATA).is_file()

    def barrier(self) -> None:
        import torch.distributed as dist
        dist.barrier()

    def save(self, step: int, state) -> object:
        import torch.distributed.checkpoint as dcp
        from gdsckpt.dcp import CachedSavePlanner, GdsckptWriter
        from torch.distributed.checkpoint.api import CheckpointException
        check_alike(state, self.group)  # refused on every rank where one would be given another's value
        try:
            dcp.save(dcp_view(state), storage_writer=GdsckptWriter(self.path(step), **self.sync_options),
                     planner=CachedSavePlanner())
        except CheckpointException as e:  # raised on every rank alike
            raise save_failure(e, step, self.path(step)) from e
        return None

    def save_async(self, step: int, state, optimizer) -> Future:
        from gdsckpt.dcp import async_save  # the writer, CachedSavePlanner, dcp_view, and the state's own optimizer
        check_alike(state, self.group)  # on the caller's thread: no save of this Checkpointer's is in flight
        fut = async_save(state, self.path(step), process_group=self.group,
                         **async_options(self.save_options, optimizer))
        from torch.distributed.checkpoint.api import CheckpointException
        fut = getattr(fut, "upload_completion", fut)  # an AsyncSaveResponse when staging is overlapped
        path = self.path(step)
        return relayed(fut, lambda e: save_failure(e, step, path) if isinstance(e, CheckpointException) else e)

    def reserve(self, state, wait: bool) -> Future:
        from gdsckpt.dcp import reserve  # the pool GdsckptWriter's compressed staging takes
        return reserve(dcp_view(state), wait=wait, **self.save_options)

    def load(self, path: Path, state, device, strict: bool) -> tuple[object, object]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from gdsckpt.dcp import GdsckptReader, RankStateLoadPlanner
        self._check_metadata(path)
        # Agreed: the objects' load_state_dict and the write-back run on each rank alone, after
        # DCP's collectives; one rank's failure there must not send it alone to an older step.
        with agreed(path, path.name):
            try:
                view = dcp_view(state, strict=strict)  # stateful objects at any depth; a fresh optimizer too
                dcp.load(view, storage_reader=GdsckptReader(path), planner=RankStateLoadPlanner(view, strict))
                dcp_write_back(state, view)
            except CheckpointException as e:  # raised on every rank alike, so every rank falls back alike
                errs = [exc for exc, _ in e.failures.values()]
                if errs and all(isinstance(x, StateMismatchError) for x in errs):
                    raise errs[0] from None  # the state does not match: on every rank, as load_into's
                if errs and all(isinstance(x, DAMAGE) and not isinstance(x, VersionError) for x in errs):
                    first = errs[0]
                    raise CheckpointFormatError(f"rank(s) {sorted(e.failures)} could not read the step: "
                                                f"{type(first).__name__}: {first}", path=path) from None
                raise
        return state, None

    @staticmethod
    def _check_metadata(path: Path) -> None:
        """Every rank reads the step's .metadata first, and all agree: DCP itself turns a damaged
        one (a flipped byte, truncated, empty) into an AssertionError that names no file, after
        logging a traceback per rank. CheckpointFormatError on every rank if one could not read
        it (VersionError if one found a newer format), so every rank falls back alike."""
        import torch.distributed as dist
        try:
            why = metadata_damage(path)
            mine = None if why is None else ("damage", why)
        except VersionError as e:
            mine = ("version", str(e))
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, mine)
        failed = {rank: err for rank, err in enumerate(seen) if err is not None}
        if not failed:
            return
        kind, first = next(iter(failed.values()))
        what = f"rank(s) {sorted(failed)} could not read the step's {DCP_METADATA}: {first}"
        if any(k == "version" for k, _ in failed.values()):
            raise VersionError(what, path=path / DCP_METADATA)
        raise CheckpointFormatError(what, path=path / DCP_METADATA)

    def delete(self, step: int) -> None:
        self._forget(step)
        # uncommitted first: a kill mid-removal leaves an uncommitted directory; a linked step
        # (a shared base checkpoint linked in): the link alone, never what it points to
        remove_step_path(self.path(step), commit_point=DCP_METADATA)
        self.noted(step)

    def files(self, step: int) -> list[tuple[Path, str]]:
        """The rank files its .metadata names, then the .metadata (DCP's commit point); a step
        lacking one of them is CheckpointFormatError naming it (never uploaded incomplete)."""
        p, name = self.path(step), self.name(step)
        parts = dcp_files(p)
        for part in parts:
            if not (p / part).is_file():
                raise CheckpointFormatError(f"step {step} is incomplete: {part}, named by its {DCP_METADATA}, "
                                            "is missing", path=p / part)
        return [(p / part, f"{name}/{part}") for part in parts + [DCP_METADATA]]

    def folders(self) -> list[int]:
        """The steps that have a folder here, committed or not (a directory of this node's alone
        holds its ranks' files and no .metadata)."""
        return sorted(s for e in os.scandir(self.directory) if (s := self._parse(e.name)) is not None)

    def leftovers(self) -> list[Path]:
        # only the rank that downloads holds the lock: a download directory not its own is a dead one's
        return sorted(Path(e.path) for e in os.scandir(self.directory)
                      if _DCP_DOWNLOAD.fullmatch(e.name) and e.is_dir(follow_symlinks=False))

    @contextlib.contextmanager
    def fetched(self, step: int, store) -> Iterator[tuple[Path, str]]:
        """Rank 0 downloads the step's DCP directory from the store into the local directory (a
        temporary, renamed once complete), or the first rank of each node-local directory into its
        own; every rank waits for it. The copy stays."""
        import torch.distributed as dist
        name = self.name(step)
        final = self.path(step)
        failed = None
        if self.downloads:
            try:
                tmp = self.directory / f".{name}.download"
                if os.path.lexists(tmp):  # a killed download's, or a link: never followed
                    remove_step_path(tmp)
                tmp.mkdir()
                for rel in store.list(name):  # "step_.../__0_0.gdsckpt", relative to the prefix
                    store.download(rel, tmp / rel.split("/", 1)[1])
                if os.path.lexists(final):  # the damaged local copy (or a link to one) it replaces
                    remove_step_path(final, commit_point=DCP_METADATA)
                os.replace(tmp, final)
                fsync_dir(self.directory)
            except Exception as e:
                failed = f"{type(e).__name__}: {e}"
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, failed)
        failed = next((f"rank {r}: {why}" for r, why in enumerate(every) if why is not None), None)
        if failed is not None:
            raise OSError(f"downloading step {step} from {store.url(name)} failed: {failed}")
        yield final, str(final)
