"""The writing side's interfaces: where one save puts its file (`Destination`, save_flat's seam:
a new file, the bench's sinks, save_async's pool), with its call order. The snapshot modes'
interface and registry are gdsckpt/writing/snapshot/modes.py (`SnapshotMode`); where a
save_async(memory=) snapshot goes, writing/snapshot/host.py (`SnapshotTarget`)."""

from __future__ import annotations

from typing import Protocol

from gdsckpt.engine.interfaces import Backend, ChunkFile
from gdsckpt.format import file as fmt
from gdsckpt.format.plan import Plan


class Destination(Protocol):
    """Where save_flat puts one checkpoint file. save_flat calls, in this order:

        file = open(backend)                       # a ChunkFile the ring writes records through
        layout(file.fd, meta, skeleton, devices, plan) -> format.FileWriter
                                                   # places each record; writes the index and footer
        ...the ring writes every chunk record through `file`...
        commit(file)                               # all written: make it durable (or hand it on)
      | abort(file, error)                         # anything raised after open returned,
                                                   # KeyboardInterrupt included: undo, leave nothing

    open cleans up after itself when it raises (neither commit nor abort follows). abort may
    raise a clearer error (chained to `error`); else save_flat re-raises `error`. `label` names
    the checkpoint in errors and Stats: the user's path, never a temporary."""

    label: str

    def open(self, backend: Backend) -> ChunkFile: ...

    def layout(self, fd: int | None, meta: dict, skeleton: dict, devices: list[str], plan: Plan) -> fmt.FileWriter: ...

    def commit(self, file: ChunkFile) -> None: ...

    def abort(self, file: ChunkFile, error: BaseException) -> None: ...
