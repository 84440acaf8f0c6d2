"""GdsckptReader: dcp.load of a checkpoint GdsckptWriter wrote.

Loading reads each rank file's index once and only the chunks of the tensors the rank needs; a
read item that covers a whole stored tensor is decoded straight into the target shard's memory
(its GPU memory for GPU shards), others are read into a temporary on the target's device and
the requested slice copied in. `.metadata` is read without running anything from it
(metadata.py), and so are the pickles of non-tensor values (byte_values.py)."""

from __future__ import annotations

import io
import os
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from gdsckpt.reading.reader import Checkpoint
from gdsckpt.reading.reader import open as open_checkpoint
from gdsckpt.core.defaults import RING_DEPTH
from gdsckpt.engine.device_copy import cuda_device_of, on_device, settle
from gdsckpt.core.dtypes import name_of
from ..errors import CheckpointFormatError
from ..stats import Stats
from .byte_values import RefusedPickle, load_plain
from .layout import local_dir_id, metadata_path
from .metadata import read_metadata as read_metadata_file

__all__ = ["GdsckptReader"]


class GdsckptReader(StorageReader):
    """StorageReader for dcp.load of a checkpoint written by GdsckptWriter.

    backend, io, io_threads, ring_depth: passed to gdsckpt.open (backend None: the GPU when
    a target is a CUDA tensor or a chunk needs nvCOMP, else the CPU).
    """

    def __init__(self, path: str | os.PathLike, *, backend: str | None = None, io: str = "auto",
                 io_threads: int | None = None, ring_depth: int = RING_DEPTH):
        super().__init__()
        self.path = Path(path)
        self.open_options = dict(backend=backend, io=io, io_threads=io_threads, ring_depth=ring_depth)
        self.storage_data: dict = {}
        self.load_id = uuid.uuid4().hex
        self.rank: int | None = None
        self.use_collectives = True
        self.last_stats: list[Stats] = []  # one per gdsckpt read of the last read_data

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # DCP's own metadata file, through an allowlist unpickler and its checksum (metadata.py)
        metadata = read_metadata_file(metadata_path(self.path, kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise CheckpointFormatError("the DCP metadata has no storage_data", path=self.path)
        bad = next((v for v in metadata.storage_data.values()
                    if not (isinstance(v, dict) and isinstance(v.get("file"), str) and isinstance(v.get("key"), str))),
                   None)
        if bad is not None:
            raise CheckpointFormatError(
                f"this checkpoint was not written by GdsckptWriter (an item's storage data is "
                f"{type(bad).__name__}); read it with the StorageReader that wrote it, e.g. FileSystemReader",
                path=self.path)
        self.storage_data = metadata.storage_data
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        per_file: dict[str, list[tuple[ReadItem, str]]] = defaultdict(list)
        for ri in plan.items:
            sd = self.storage_data[ri.storage_index]
            name = sd["file"]
            if "/" in name or "\\" in name or name in ("", ".", ".."):
                raise CheckpointFormatError(f"the metadata names a file outside the checkpoint: {name!r}",
                                            path=self.path)
            per_file[name].append((ri, sd["key"]))
        self.last_stats = []
        for name, reqs in per_file.items():
            with open_checkpoint(self.path / name, **self.open_options) as ck:
                self._read_file(ck, reqs, planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_file(self, ck: Checkpoint, reqs, planner: LoadPlanner) -> None:
        for _, key in reqs:
            if key not in ck:
                raise CheckpointFormatError("the DCP metadata names a key the file does not hold",
                                            path=ck.path, key=key)
        # Byte items (pickled non-tensor values, as DCP's planner made them): host memory.
        byte_reqs = [(ri, k) for ri, k in reqs if ri.type == LoadItemType.BYTE_IO]
        if byte_reqs:
            got = ck.read(sorted({k for _, k in byte_reqs}), "cpu")
            self._stats(ck)
            for ri, k in byte_reqs:
                planner.load_bytes(ri, _checked_pickle(got[k].numpy().tobytes(), ck.path, k, ri.dest_index.fqn))
        # Tensor items: resolve every target first, then read per stored tensor.
        by_stored: dict[str, list[tuple[ReadItem, torch.Tensor]]] = defaultdict(list)
        for ri, k in reqs:
            if ri.type != LoadItemType.BYTE_IO:
                by_stored[k].append((ri, planner.resolve_tensor(ri).detach()))
        direct: dict[str, torch.Tensor] = {}
        staged: dict[torch.device, list[str]] = defaultdict(list)
        for i, items in by_stored.items():
            e = ck.info(i)
            ri, target = items[0]
            whole = (len(items) == 1 and all(int(o) == 0 for o in ri.storage_offsets)
                     and tuple(int(n) for n in ri.lengths) == tuple(e["shape"]))
            if (whole and tuple(target.shape) == tuple(e["shape"]) and name_of(target.dtype) == e["dtype"]
                    and target.device.type in ("cpu", "cuda") and target.layout == torch.strided):
                direct[i] = target  # decoded straight into the target shard's memory
            else:
                staged[items[0][1].device].append(i)
        if direct:
            settle(direct.values())  # nothing queued before may land on the shards after the decode
            with on_device(cuda_device_of(direct.values())):
                ck.read_into(direct)
            self._stats(ck)
            for i in direct:
                ri, target = by_stored[i][0]
                planner.commit_tensor(ri, target)
        for device, idx in staged.items():
            dev = device if device.type in ("cpu", "cuda") else torch.device("cpu")
            with on_device(dev.index if dev.type == "cuda" else None):
                got = ck.read(idx, dev)
            self._stats(ck)
            for i in idx:
                for ri, target in by_stored[i]:
                    src = _narrow(got[i], ri.storage_offsets, ri.lengths)
                    if tuple(src.shape) != tuple(target.shape):
                        raise CheckpointFormatError(
                            f"read item {ri.storage_index} is {list(src.shape)} in the checkpoint but the target "
                            f"is {list(target.shape)}", path=ck.path, key=i)
                    target.copy_(src)
                    planner.commit_tensor(ri, target)
                del got[i]

    def _stats(self, ck: Checkpoint) -> None:
        if ck.last_stats is not None:
            self.last_stats.append(ck.last_stats)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return local_dir_id(checkpoint_id)

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.path


def _checked_pickle(data: bytes, path: Path, key: str, fqn: str) -> io.BytesIO:
    """A byte item's pickle (DCP's torch.save of a non-tensor value), for planner.load_bytes.

    DCP's planner unpickles it with torch.load(weights_only=False), which runs whatever the pickle
    asks for, and anyone can write a valid gdsckpt file. So it is loaded here first without running
    anything (byte_values.load_plain), and the planner gets the pickle of what that built, never
    the file's own bytes. Anything else is a CheckpointFormatError naming the file and key."""
    try:
        value = load_plain(data)
    except RefusedPickle as e:
        raise CheckpointFormatError(f"the non-tensor value {fqn!r} is a pickle that torch.load(weights_only=True) "
                                    f"refuses ({e}): refused, nothing of it was run", path=path, key=key) from None
    out = io.BytesIO()
    torch.save(value, out)
    out.seek(0)
    return out


def _narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        t = t.narrow(dim, int(o), int(n))
    return t
