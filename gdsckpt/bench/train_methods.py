"""gdsckpt-bench --train's methods: one way to checkpoint each, and the table of them.

A method is a Method subclass: `save` returns a handle (a future that completes in the
background) or None (a synchronous save, whose whole cost is the call), `before_step` is any
wait it imposes before the next optimizer step. METHODS holds one line per method or mode;
gdsckpt.save_async modes are detected from the installed save_async's signature, and a mode it
does not accept is reported as unavailable. The save_async methods reserve their host memory in
`setup` (gdsckpt.reserve, waited for: before the first save and the loops) and say what it took
in `reserved`.
"""

from __future__ import annotations

import inspect
import os
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

import torch

from . import ranks, states
from .ranks import Ranks


def checkpoint_state(model, opt) -> dict:
    """model + optimizer state; the optimizer's per-parameter keys as strings, so that every
    method (DCP's flattening included) takes the same dict."""
    osd = opt.state_dict()
    return {"model": model.state_dict(),
            "optim": {"state": {str(k): v for k, v in osd["state"].items()}, "param_groups": osd["param_groups"]}}


@dataclass
class Ctx:
    """What a method sees: the loop's model and optimizer, the checkpoint directory, the device."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    directory: Path
    device: str
    io_path: str | None = None
    stored_bytes: int | None = None
    pinned: int = 0  # the largest pinned_host_bytes a gdsckpt Stats reported
    ranks: Ranks | None = None  # under torchrun
    dcp_planner: str = "cached"  # every DCP method's: "cached" (gdsckpt.dcp.CachedSavePlanner) or "default"

    @property
    def group(self):
        """The process group for DCP's collectives (None: the default one)."""
        return self.ranks.group if self.ranks else None

    def planner(self, method: str):
        """The DCP save planner of a DCP method (None: DCP's DefaultSavePlanner); cached plans
        are the method's own (each stores its writer's data)."""
        if self.dcp_planner == "cached":
            from gdsckpt.dcp import CachedSavePlanner
            return CachedSavePlanner(cache_key=method)
        return None

    def state(self) -> dict:
        if self.ranks:
            return ranks.checkpoint_state(self.model, self.opt)
        return checkpoint_state(self.model, self.opt)


class Method:
    """One way to checkpoint. `save` returns a handle; `pending` futures complete in the
    background. Sync methods return None (their whole cost is the call)."""

    name = "?"
    asynchronous = False
    sharded = False  # runs under torchrun: saves each rank's DTensor shards
    notes = ""  # what the result should say about how it ran
    reserved: dict | None = None  # what setup reserved ahead of the first save (reservation()), if anything
    spawns_process = False  # its first save starts a process of its own (DCP's async save process)

    def available(self) -> str | None:
        """None if it can run here, else why not."""
        return None

    def setup(self, ctx: Ctx) -> None:
        pass

    def save(self, ctx: Ctx, state: dict, path: Path):
        raise NotImplementedError

    def before_step(self) -> None:
        """Called before each optimizer step (timed into blocked): wait for what must finish
        before the state may change."""

    def teardown(self) -> None:
        pass

    def extra(self) -> dict:
        """Fields of its own for the method's row (after teardown)."""
        return {}


def reservation(start) -> dict | None:
    """Run a reservation (start(): gdsckpt.reserve, gdsckpt.dcp.reserve or Checkpointer.reserve, a Future of a
    Reservation) and wait for it, in a method's setup: before its first save and the loops.
    What it took, for the result; None where the installed gdsckpt has no reserve."""
    t = time.perf_counter()
    fut = start()
    if fut is None:
        return None
    r = fut.result()
    return {"when": "setup: before the first save and the loops, waited for", "seconds": time.perf_counter() - t,
            "where": r.where, "allocated_bytes": r.allocated_bytes, "held_bytes": r.held_bytes,
            "limit_bytes": r.limit_bytes, "pinned": r.pinned, "warm_s": r.warm_s, "alloc_s": r.alloc_s,
            "slots": r.slots}


class NoCheckpoint(Method):
    name = "none"
    sharded = True


class TorchSave(Method):
    name = "torch.save"

    def save(self, ctx, state, path):
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        ctx.stored_bytes = path.stat().st_size


class GdsSave(Method):
    name = "gdsckpt.save"

    def save(self, ctx, state, path):
        import gdsckpt
        s = gdsckpt.save(state, path)
        ctx.io_path, ctx.stored_bytes = s.io_path, s.file_bytes
        ctx.pinned = max(ctx.pinned, s.memory.get("pinned_host_bytes", 0))


class GdsSaveAsync(Method):
    asynchronous = True

    def __init__(self, name: str, kwargs: dict, optimizer: bool = False):
        self.name, self.kwargs, self.with_opt = name, kwargs, optimizer

    def available(self):
        import gdsckpt
        from gdsckpt.writing.save import SaveOptions
        params = inspect.signature(gdsckpt.save_async).parameters
        options = {f.name for f in fields(SaveOptions)}  # save_async's **save_options
        want = list(self.kwargs) + (["optimizer"] if self.with_opt else [])
        missing = [k for k in want if k not in params and k not in options]
        return f"save_async does not accept {', '.join(missing)}" if missing else None

    def setup(self, ctx):
        import gdsckpt
        if hasattr(gdsckpt, "reserve"):
            self.reserved = reservation(lambda: gdsckpt.reserve(self.saved(ctx.state())))

    def saved(self, state):
        """What save() saves of `state`."""
        return state

    def save(self, ctx, state, path):
        import gdsckpt
        kw = dict(self.kwargs)
        if self.with_opt:
            kw["optimizer"] = ctx.opt
        fut = gdsckpt.save_async(state, path, **kw)

        def done(f):
            if f.exception() is None:
                s = f.result()
                ctx.io_path, ctx.stored_bytes = s.io_path, s.file_bytes
                ctx.pinned = max(ctx.pinned, s.memory.get("pinned_host_bytes", 0))
        fut.add_done_callback(done)
        return fut


class GdsSaveAsyncShards(GdsSaveAsync):
    """Under torchrun: each rank gdsckpt.save_async's its local shards (DTensor.to_local) to a
    file of its own, without DCP. Not a checkpoint DCP can load or reshard: it measures what
    DCP's planning and collectives add to dcp.async_save with GdsckptWriter."""

    sharded = True

    def __init__(self, overlap: bool = False):
        super().__init__("gdsckpt.save_async" + (" overlap" if overlap else "") + " per rank, no DCP",
                         {"overlap": True} if overlap else {}, optimizer=overlap)

    def available(self):
        return None if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "a comparison for runs under torchrun"

    def saved(self, state):
        return states.local_tensors(state)

    def save(self, ctx, state, path):
        rank = ctx.ranks.rank if ctx.ranks else 0
        return super().save(ctx, self.saved(state), path.with_name(f"{path.name}-rank{rank}.gdsckpt"))


_PG_READY = False


def _process_group() -> None:
    """DCP's async paths want a process group: one rank of gloo, set up once."""
    global _PG_READY
    import torch.distributed as dist
    if _PG_READY or dist.is_initialized():
        _PG_READY = True
        return
    store = tempfile.mktemp(prefix="gdsckpt-bench-pg-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    _PG_READY = True


class DcpPinned(Method):
    """dcp.async_save with DCP's pinned-memory DefaultStager, FileSystemWriter (fsync on).

    One stager for every save, as DCP intends (its pinned buffers are reused), except where
    staging closes it: torch 2.11's DefaultStager closes its StateDictStager after each stage
    (pytorch/pytorch#183413; a second save then fails with KeyError(<class 'type'>)), and so
    frees its pinned cache anyway. There a new stager per save is DCP's actual behaviour, and
    the result's notes say so."""

    asynchronous = True
    sharded = True

    def __init__(self, kind: str):
        self.kind = kind
        self.name = f"dcp.async_save pinned {kind}"
        self.spawns_process = kind == "process"
        self.stager = None
        self.staging = None

    def available(self):
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType  # noqa: F401
        except ImportError as e:
            return f"torch {torch.__version__} has no DefaultStager/AsyncCheckpointerType: {e}"
        return None

    def setup(self, ctx):
        _process_group()
        self.gpu = ctx.device.startswith("cuda")
        if not self.gpu:
            self.notes = "CPU: DefaultStager without pinned memory or non-blocking copies (they need an accelerator)"
        self.stager = self._new_stager()

    def _new_stager(self):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        # (pinned memory, shared memory, async staging, non-blocking copies): torchtitan's async_with_pinned_mem
        return DefaultStager(StagingOptions(self.gpu, True, True, self.gpu))

    def _closed_by_staging(self) -> bool:
        inner = getattr(self.stager, "_state_dict_stager", None)
        return inner is not None and not getattr(inner, "_deepcopy_dispatch", True)

    def save(self, ctx, state, path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        if self._closed_by_staging():
            self.stager.close()
            self.stager = self._new_stager()
            self.notes = (f"torch {torch.__version__}: DefaultStager closes itself after staging "
                          "(pytorch/pytorch#183413), so a new one (new pinned buffers) per save")
        kind = AsyncCheckpointerType.THREAD if self.kind == "thread" else AsyncCheckpointerType.PROCESS
        r = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(path), sync_files=True),
                           async_checkpointer_type=kind, async_stager=self.stager, process_group=ctx.group,
                           planner=ctx.planner(self.name))
        if hasattr(r, "upload_completion"):  # AsyncSaveResponse: staging runs in the background too
            self.staging = r.staging_completion
            r = r.upload_completion
        r.add_done_callback(lambda f: f.exception() is None and setattr(ctx, "stored_bytes", _dir_bytes(path)))
        return r

    def before_step(self):
        if self.staging is not None:  # the state must not change before staging has copied it
            self.staging.result()
            self.staging = None

    def teardown(self):
        if self.stager is not None:
            self.stager.close()
            self.stager = None


def _dir_bytes(path) -> int:
    """A DCP checkpoint's size: every rank's files and the metadata (on a shared directory)."""
    return sum(p.stat().st_size for p in Path(path).iterdir())


class DcpGdsckpt(Method):
    """dcp.async_save through GdsckptWriter's compressed staging; overlap: staged during the
    next forward/backward (GdsckptWriter(optimizer=)), the optimizer step waiting for it."""

    asynchronous = True
    sharded = True

    def __init__(self, overlap: bool = False, snapshot: str | None = None):
        self.with_opt, self.snapshot = overlap, snapshot
        self.name = "dcp.async_save GdsckptWriter" + (" overlap" if overlap else "") + (
            f" snapshot={snapshot}" if snapshot else "")

    def available(self):
        from gdsckpt.dcp import GdsckptWriter
        if self.with_opt and "optimizer" not in inspect.signature(GdsckptWriter).parameters:
            return "GdsckptWriter does not accept optimizer"
        return None

    def setup(self, ctx):
        _process_group()
        import gdsckpt.dcp
        if hasattr(gdsckpt.dcp, "reserve"):  # the staging's pool, as save_async's methods reserve theirs
            self.reserved = reservation(lambda: gdsckpt.dcp.reserve(ctx.state(), snapshot=self.snapshot))

    def save(self, ctx, state, path):
        import torch.distributed.checkpoint as dcp
        from gdsckpt.dcp import GdsckptWriter
        w = GdsckptWriter(path, optimizer=ctx.opt) if self.with_opt else GdsckptWriter(path, snapshot=self.snapshot)
        fut = dcp.async_save(state, storage_writer=w, process_group=ctx.group, planner=ctx.planner(self.name))
        fut = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse: staging is a future

        def done(f):
            if f.exception() is None and w.last_stats is not None:
                ctx.io_path = w.last_stats.io_path
                ctx.stored_bytes = _dir_bytes(path)
        fut.add_done_callback(done)
        return fut


class DcpRecipe(Method):
    """gdsckpt.dcp.async_save(state, path): the shortest documented DCP call (the writer, plan
    caching, the overlap where one optimizer's step fences the state, a group of its own), as a
    user copies it from the README."""

    asynchronous = True
    sharded = True
    name = "gdsckpt.dcp.async_save"

    def setup(self, ctx):
        _process_group()

    def save(self, ctx, state, path):
        import gdsckpt.dcp
        fut = gdsckpt.dcp.async_save(state, path, **({"process_group": ctx.group} if ctx.group is not None else {}))
        fut = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse: staging is a future

        def done(f):
            if f.exception() is None:
                ctx.stored_bytes = _dir_bytes(path)
        fut.add_done_callback(done)
        return fut


class DcpSave(Method):
    """dcp.save (synchronous) through FileSystemWriter (fsync on) or GdsckptWriter: the sharded
    runs' counterparts of torch.save and gdsckpt.save."""

    sharded = True

    def __init__(self, writer: str):
        self.writer = writer
        self.name = f"dcp.save {writer}"

    def setup(self, ctx):
        _process_group()

    def save(self, ctx, state, path):
        import torch.distributed.checkpoint as dcp
        if self.writer == "GdsckptWriter":
            from gdsckpt.dcp import GdsckptWriter
            w = GdsckptWriter(path)
        else:
            w = dcp.FileSystemWriter(str(path), sync_files=True)
        dcp.save(state, storage_writer=w, process_group=ctx.group, planner=ctx.planner(self.name))
        ctx.stored_bytes = _dir_bytes(path)
        if getattr(w, "last_stats", None) is not None:
            ctx.io_path = w.last_stats.io_path


class DlroverFlash(Method):
    """DLRover's flash checkpoint (dlrover_flash.py), the in-memory baseline: every checkpoint
    copied into DLRover's shared memory by the training process (its whole cost is the call),
    every every_local-th (--every-local, as the memory tier's) also handed to DLRover's saver
    process to write to a directory of its own beside the loops'; that write's completion (the
    tracker naming the step) is the checkpoint's. Not a default method (--methods dlrover-flash, all)."""

    name = "dlrover flash checkpoint"
    sharded = True
    spawns_process = True

    def __init__(self, every_local: int = 4):
        self.every_local, self.engine, self.root, self.step, self.ranks = every_local, None, None, 0, None

    def available(self):
        from . import dlrover_flash
        return dlrover_flash.why_unavailable()

    def setup(self, ctx):
        from . import dlrover_flash
        import torch.distributed as dist
        self.ranks = ctx.ranks
        box = [tempfile.mkdtemp(prefix="gdsckpt-bench-dlrover-", dir=ctx.directory.parent)
               if not ctx.ranks or ctx.ranks.rank == 0 else None]
        if ctx.ranks:  # one directory for every rank, rank 0's
            dist.broadcast_object_list(box, src=0, group=ctx.ranks.group)
        self.root = Path(box[0])
        self.engine = dlrover_flash.open_engine(self.root, sharded=bool(ctx.ranks))
        self.notes = (f"DLRover {_version('dlrover')}: save_to_memory every checkpoint, save_to_storage (its saver "
                      f"process writes) every {self.every_local}th; run without dlrover-run (its engine starts "
                      "the saver)")

    def save(self, ctx, state, path):
        from . import dlrover_flash
        self.step += 1
        to_disk = (self.step - 1) % self.every_local == 0
        where = self.root / str(self.step) if ctx.ranks else self.root / str(self.step) / "rank_0.pt"  # DCP: a folder
        dlrover_flash.save(self.engine, self.step, state, where, to_disk, sharded=bool(ctx.ranks))
        if not to_disk:
            return None
        fut = dlrover_flash.when_persisted(self.root, self.step)
        fut.add_done_callback(lambda f: f.exception() is None and setattr(
            ctx, "stored_bytes", dlrover_flash.stored_bytes(self.root / str(self.step))))
        return fut

    def teardown(self):
        import shutil
        from . import dlrover_flash
        if self.engine is not None:
            dlrover_flash.close(self.engine)
            self.engine = None
        if self.ranks:
            self.ranks.barrier()
        if self.root is not None and (not self.ranks or self.ranks.rank == 0):
            shutil.rmtree(self.root, ignore_errors=True)
        self.root = None


def _version(dist_name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist_name)
    except PackageNotFoundError:
        return None


# One line per method or mode: adding a save_async mode is one more GdsSaveAsync line.
METHODS: list[Callable[[], Method]] = [
    NoCheckpoint,
    TorchSave,
    lambda: DcpSave("FileSystemWriter"),
    lambda: DcpPinned("thread"),
    lambda: DcpPinned("process"),
    GdsSave,
    lambda: DcpSave("GdsckptWriter"),
    lambda: GdsSaveAsync("gdsckpt.save_async", {}),
    lambda: GdsSaveAsync("gdsckpt.save_async snapshot=host", {"snapshot": "host"}),
    lambda: GdsSaveAsync("gdsckpt.save_async snapshot=device", {"snapshot": "device"}),
    lambda: GdsSaveAsync("gdsckpt.save_async overlap", {"overlap": True}, optimizer=True),
    # the compression's share of the GPU beside training, shown by leaving it out (stored raw)
    lambda: GdsSaveAsync("gdsckpt.save_async overlap codec=raw", {"overlap": True, "codec": "raw"}, optimizer=True),
    DcpGdsckpt,
    DcpRecipe,
    lambda: DcpGdsckpt(overlap=True),
    lambda: DcpGdsckpt(snapshot="device"),
    GdsSaveAsyncShards,
    lambda: GdsSaveAsyncShards(overlap=True),
    DlroverFlash,
]
ALIASES = {"none": "none", "torch": "torch.save", "dcp-sync": "dcp.save FileSystemWriter",
           "dcp-gdsckpt-sync": "dcp.save GdsckptWriter", "dcp-thread": "dcp.async_save pinned thread",
           "dcp-process": "dcp.async_save pinned process", "save": "gdsckpt.save",
           "async": "gdsckpt.save_async", "async-host": "gdsckpt.save_async snapshot=host",
           "async-device": "gdsckpt.save_async snapshot=device", "async-overlap": "gdsckpt.save_async overlap",
           "async-overlap-raw": "gdsckpt.save_async overlap codec=raw",
           "async-shards": "gdsckpt.save_async per rank, no DCP",
           "async-shards-overlap": "gdsckpt.save_async overlap per rank, no DCP",
           "dcp-gdsckpt": "dcp.async_save GdsckptWriter", "dcp-recipe": "gdsckpt.dcp.async_save", "dcp-gdsckpt-overlap": "dcp.async_save GdsckptWriter overlap",
           "dcp-gdsckpt-device": "dcp.async_save GdsckptWriter snapshot=device",
           "dlrover-flash": "dlrover flash checkpoint"}


def all_methods() -> dict[str, Method]:
    ms = [f() for f in METHODS]
    return {m.name: m for m in ms}


def select(spec: str | None) -> list[Method]:
    table = all_methods()
    if not spec or spec == "all":
        return list(table.values())
    out = []
    for s in spec.split(","):
        name = ALIASES.get(s.strip(), s.strip())
        if name not in table:
            raise SystemExit(f"--methods: unknown {s!r}; known: {', '.join(ALIASES)} (or the full names)")
        out.append(table[name])
    if out[0].name != "none":  # overhead is measured against it
        out = [table["none"]] + [m for m in out if m.name != "none"]
    return out
