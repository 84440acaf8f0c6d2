"""GdsckptWriter's write results after a compressed staging, prepared once per layout.

A steady dcp.async_save hands write_data the same final plan object (DCP's plan cache) and a
staging whose stand-ins are the same objects (standins.py). The tensor items' results (index,
size, {"file", "key"}) then cannot have changed: they are made once (`prepare_write`) and reused
(`reuse_write`), and only the byte items (pickled plain values, a few) are resolved per save.

DCP gathers every rank's results on the coordinator (pickled, every save); `RankResults`
pickles its prepared part as a pickle made once, which the coordinator unpickles once
(`_prepared_part`), so that the coordinator's `storage_data` (`storage_data_of`) is also built
once per layout. What reaches `finish` is, as before, a list of WriteResult per rank.
"""

from __future__ import annotations

import io
import pickle
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..errors import DCPPlanError
from .byte_values import check_savable
from .layout import item_key
from .standins import data_address

__all__ = ["PreparedWrite", "RankResults", "prepare_write", "reuse_write", "byte_tensor", "storage_data_of"]


@dataclass(eq=False)
class PreparedWrite:
    """The results of a final plan's tensor items after a staging of `layout`, and what the
    next save must show to reuse them."""

    plan: SavePlan  # the final local plan (held: DCP hands back this object while it is cached)
    layout: object  # the staging's stand-in layout token
    name: str  # the rank file of the tensors
    expected: tuple  # (fqn, stand-in) per tensor item: the planner's flattened state held these
    tensor_results: list[WriteResult]
    byte_items: list[WriteItem]
    byte_positions: tuple[int, ...]  # where each byte item is among the plan's items
    blob: bytes | None = None  # tensor_results pickled, made at the first gather

    def pickled(self) -> bytes:
        if self.blob is None:
            self.blob = pickle.dumps(self.tensor_results, protocol=pickle.HIGHEST_PROTOCOL)
        return self.blob


_PREPARED: "OrderedDict[int, PreparedWrite]" = OrderedDict()  # id(plan) -> its PreparedWrite (plan held)
_PREPARED_MAX = 8  # plans of this many cache keys at once
_LOCK = threading.Lock()


def byte_tensor(data, fqn: str) -> torch.Tensor:
    """A BYTE_IO item's resolved data (a BytesIO of its pickle) as a uint8 tensor, once a restore
    could load it (byte_values.check_savable: else UnsupportedStateError naming `fqn`)."""
    buf = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(data)
    check_savable(buf, fqn)
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8) if buf.nbytes else torch.empty(0, dtype=torch.uint8)


def _plain_lookup(planner: SavePlanner) -> dict | None:
    """The planner's flattened state dict, if resolve_data of a tensor item is its entry (as
    DefaultSavePlanner's own resolve_data, lookup_object and transform_object make it)."""
    cls = type(planner)
    if not isinstance(planner, DefaultSavePlanner) or any(
            getattr(cls, name) is not getattr(DefaultSavePlanner, name)
            for name in ("resolve_data", "lookup_object", "transform_object")):
        return None
    state = getattr(planner, "state_dict", None)
    return state if isinstance(state, dict) else None


def reuse_write(plan: SavePlan, layout: object, name: str, planner: SavePlanner) -> PreparedWrite | None:
    """The PreparedWrite for this final plan and staging layout, if the planner's state still
    holds the same stand-ins at every tensor item's key; else None."""
    with _LOCK:
        prepared = _PREPARED.get(id(plan))
    if prepared is None or prepared.plan is not plan or prepared.layout is not layout or prepared.name != name:
        return None
    state = _plain_lookup(planner)
    if state is None or any(state.get(fqn) is not want for fqn, want in prepared.expected):
        return None
    return prepared


def prepare_write(plan: SavePlan, layout: object, items: list, keys: dict, shapes: dict, name: str,
            planner: SavePlanner) -> PreparedWrite:
    """Build the tensor items' results from the resolved items [(write item, data)] of a plan
    whose tensors are all stand-ins of one staging (keys: their data addresses -> keys;
    shapes: key -> shape), and keep them for `reuse_write` where the planner allows it."""
    tensor_results, byte_items, positions, expected = [], [], [], []
    state = _plain_lookup(planner)
    for i, (item, data) in enumerate(items):
        if item.type == WriteItemType.BYTE_IO:
            byte_items.append(item)
            positions.append(i)
            continue
        key = keys.get(data_address(data)) if isinstance(data, torch.Tensor) else None
        if key is None or tuple(data.shape) != shapes[key]:
            raise DCPPlanError(f"write item {item_key(item.index)!r} is not a tensor this writer's stage() "
                               "compressed (snapshot='host' stages whole tensors and DTensor shards)")
        tensor_results.append(WriteResult(index=item.index, size_in_bytes=data.numel() * data.element_size(),
                                          storage_data={"file": name, "key": key}))
        if state is not None:
            expected.append((item.index.fqn, state.get(item.index.fqn)))
    prepared = PreparedWrite(plan, layout, name, tuple(expected), tensor_results, byte_items, tuple(positions))
    if state is not None and all(v is not None for _, v in expected):
        with _LOCK:
            _PREPARED[id(plan)] = prepared
            _PREPARED.move_to_end(id(plan))
            while len(_PREPARED) > _PREPARED_MAX:
                _PREPARED.popitem(last=False)
    return prepared


class RankResults(list):
    """One rank's write results (a list of WriteResult) in the plan's order: the prepared
    tensor results with the byte items' results at their positions. Pickled as the prepared
    results' pickle, made once per layout, and the byte items' results."""

    def __init__(self, prepared: list, byte_results: list, positions: tuple, blob=None):
        super().__init__(prepared)
        for at, result in zip(positions, byte_results):  # ascending: each lands at its final place
            self.insert(at, result)
        self.prepared, self.byte_results, self.positions, self.blob = prepared, byte_results, positions, blob

    def __reduce__(self):
        blob = self.blob() if callable(self.blob) else self.blob
        if blob is None:
            return (list, (list(self),))
        return (_rank_results, (blob, list(self.byte_results), self.positions))


_UNPICKLED: "OrderedDict[bytes, list]" = OrderedDict()  # a rank's prepared-results pickle -> its results
_UNPICKLED_MAX_BYTES = 64 << 20
_unpickled_bytes = 0


def _rank_results(blob: bytes, byte_results: list, positions: tuple) -> RankResults:
    """A RankResults from a gather: its prepared part unpickled once per distinct pickle. The
    `.metadata` pickle shares what its objects share (one "file" key string for a rank's
    results, as the single pickle of them DCP made before): the byte results take the
    prepared part's key strings, so that the file stays byte for byte the same."""
    global _unpickled_bytes
    with _LOCK:
        prepared = _UNPICKLED.get(blob)
        if prepared is not None:
            _UNPICKLED.move_to_end(blob)
    if prepared is None:
        prepared = pickle.loads(blob)
        with _LOCK:
            if blob not in _UNPICKLED:
                _UNPICKLED[blob] = prepared
                _unpickled_bytes += len(blob)
                while _unpickled_bytes > _UNPICKLED_MAX_BYTES and len(_UNPICKLED) > 1:
                    _unpickled_bytes -= len(_UNPICKLED.popitem(last=False)[0])
    if prepared:  # one rank's results as one pickle would give them: the same "file" and "key" objects
        file_k, key_k = prepared[0].storage_data
        byte_results = [WriteResult(index=wr.index, size_in_bytes=wr.size_in_bytes,
                                    storage_data={file_k: wr.storage_data["file"], key_k: wr.storage_data["key"]})
                        for wr in byte_results]
    return RankResults(prepared, byte_results, positions, blob)


@dataclass(eq=False)
class _StorageData:
    parts: tuple  # every rank's prepared results (held: compared by identity)
    byte_entries: tuple  # every rank's byte results' (index, file, key)
    storage_data: dict = field(default_factory=dict)


_STORAGE_DATA: list[_StorageData] = []  # the last few, newest last
_STORAGE_DATA_MAX = 4


def storage_data_of(results: list[list[WriteResult]]) -> dict:
    """DCP's metadata.storage_data for the ranks' results: index -> {"file", "key"}. Built once
    while every rank's results are the same prepared results (RankResults) and byte items."""
    if not all(isinstance(r, RankResults) for r in results):
        return _build(results)
    parts = tuple(r.prepared for r in results)
    entries = tuple((r.positions, tuple((wr.index, wr.storage_data["file"], wr.storage_data["key"])
                                        for wr in r.byte_results)) for r in results)
    with _LOCK:
        for known in _STORAGE_DATA:
            if len(known.parts) == len(parts) and all(a is b for a, b in zip(known.parts, parts)) \
                    and known.byte_entries == entries:
                return known.storage_data
    built = _StorageData(parts, entries, _build(results))
    with _LOCK:
        _STORAGE_DATA.append(built)
        del _STORAGE_DATA[:-_STORAGE_DATA_MAX]
    return built.storage_data


def _build(results: list[list[WriteResult]]) -> dict:
    storage_md = {}
    for wr_list in results:
        storage_md.update({wr.index: wr.storage_data for wr in wr_list})
    return storage_md
