"""A DCP checkpoint's `.metadata` (issue 20, finding 5), and the pickles of its non-tensor values
in the rank files (audit C): never read with an unrestricted unpickler.

A pickle payload planted in `.metadata` (in the bucket, or on disk) is refused with a
CheckpointFormatError naming the file, and the test proves it never ran; a damaged `.metadata`
(every single flipped byte, truncated, empty) is a CheckpointFormatError naming the file, which
the manager's restore falls back past; the metadata gdsckpt writes, and DCP's own tools'
reading of it, keep working. A payload planted in a non-tensor value's pickle (DCP's planner
would torch.load it with weights_only=False) is refused the same way, naming the rank file and key.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.distributed.checkpoint.metadata as dcp_metadata  # noqa: E402

import gdsckpt  # noqa: E402
from gdsckpt.dcp import GdsckptReader, GdsckptWriter  # noqa: E402
from gdsckpt.dcp.metadata import TRAILER_MAGIC, read_metadata  # noqa: E402
from conftest import all_dtype_tensors, assert_same, tensors_of  # noqa: E402


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "dtypes": all_dtype_tensors(n=16),
            "strided": torch.randn(6, 4).t(), "empty": torch.empty(0, 3),
            "meta": {"step": 7, "name": "run", "lrs": [1e-3, None]}}


@pytest.fixture
def saved(tmp_path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(), storage_writer=GdsckptWriter(tmp_path / "ck"), no_dist=True)
    return tmp_path / "ck"


def _load(d: Path) -> dict:
    target = _state()
    for t in tensors_of(target):
        t.zero_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=GdsckptReader(d), no_dist=True)
    return target



# ---------------------------------------------------------------- our own metadata


def test_our_metadata_loads_and_dcps_own_reader_still_reads_it(saved):
    data = (saved / ".metadata").read_bytes()
    assert data[-16:-8] == TRAILER_MAGIC
    assert_same(_load(saved), _state())
    ours = read_metadata(saved / ".metadata")
    theirs = dcp.FileSystemReader(saved).read_metadata()  # DCP's plain pickle.load stops before the trailer
    assert ours.state_dict_metadata == theirs.state_dict_metadata and ours.storage_data == theirs.storage_data
    assert isinstance(ours, dcp_metadata.Metadata) and ours.version == gdsckpt.dcp.DCP_VERSION


def test_metadata_written_before_the_trailer_still_loads(saved):
    """A step saved by an earlier gdsckpt (the pickle alone, as FileSystemWriter writes it)."""
    meta = saved / ".metadata"
    meta.write_bytes(pickle.dumps(read_metadata(meta)))
    assert_same(_load(saved), _state())


# ---------------------------------------------------------------- payloads


class _Payload:
    """What an attacker who can write the bucket plants: unpickling it runs a shell command."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class _Eval:
    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return eval, (self.code,)


def _with_trailer(data: bytes) -> bytes:
    from gdsckpt.format.checksum import crc64nvme
    import struct
    return data + TRAILER_MAGIC + struct.pack("<Q", crc64nvme(data))


def _payloads(marker: Path, metadata) -> dict[str, bytes]:
    run = f"touch {marker}"
    hidden = pickle.loads(pickle.dumps(metadata))
    hidden.planner_data = {"model.0.weight": _Payload(run)}  # inside an otherwise valid Metadata
    return {
        "os.system": pickle.dumps(_Payload(run)),
        "os.system, trailer forged": _with_trailer(pickle.dumps(_Payload(run))),
        "eval": pickle.dumps(_Eval(f"__import__('pathlib').Path({str(marker)!r}).touch()")),
        "inside real metadata": _with_trailer(pickle.dumps(hidden)),
        "protocol 0": pickle.dumps(_Payload(run), protocol=0),
        "torch.load": pickle.dumps(_Reduce(torch.load, (str(marker),))),
    }


class _Reduce:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def test_a_pickle_payload_is_refused_and_never_runs(saved, tmp_path):
    marker = tmp_path / "payload-ran"
    meta = saved / ".metadata"
    real = read_metadata(meta)
    for name, payload in _payloads(marker, real).items():
        meta.write_bytes(payload)
        with pytest.raises(gdsckpt.CheckpointFormatError, match="refused") as info:
            GdsckptReader(saved).read_metadata()
        assert str(meta) in str(info.value) and info.value.path == meta, name
        with pytest.raises(BaseException, match="refused"):  # DCP wraps it (CheckpointException) on the way up
            _load(saved)
        assert not marker.exists(), f"the {name} payload ran"
    # and the pickle module itself was never handed the file: control, with plain pickle.loads
    with pytest.raises(FileNotFoundError):
        pickle.loads(_payloads(marker, real)["torch.load"])
    pickle.loads(_payloads(marker, real)["os.system"])
    assert marker.exists()  # the payload is live: what the reader refused would have run


def test_a_payload_cannot_change_the_classes_it_is_allowed(saved):
    """BUILD sets attributes on whatever the pickle holds, a class included; the allowed classes
    come out of a refused file as they went in."""
    payload = (b"\x80\x04" + pickle.GLOBAL + b"torch.distributed.checkpoint.metadata\nMetadata\n"  # the class
               + pickle.NONE + pickle.EMPTY_DICT + pickle.SHORT_BINUNICODE + bytes([6]) + b"__eq__" + pickle.NONE
               + pickle.SETITEM + pickle.TUPLE2  # state: (None, {"__eq__": None})
               + pickle.BUILD + pickle.STOP)  # setattr(Metadata, "__eq__", None)
    (saved / ".metadata").write_bytes(payload)
    eq = dcp_metadata.Metadata.__eq__
    with pytest.raises(gdsckpt.CheckpointFormatError, match="sets attributes of Metadata"):
        read_metadata(saved / ".metadata")
    assert dcp_metadata.Metadata.__eq__ is eq


# ---------------------------------------------------------------- damage


def test_every_flipped_byte_is_a_format_error_naming_the_file(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(3), "h": torch.zeros(2, dtype=torch.bfloat16), "meta": {"step": 1}},
                 storage_writer=GdsckptWriter(tmp_path), no_dist=True)
    meta = tmp_path / ".metadata"
    good = meta.read_bytes()
    for i in range(len(good)):
        bad = bytearray(good)
        bad[i] ^= 0x10
        meta.write_bytes(bytes(bad))
        with pytest.raises(gdsckpt.CheckpointFormatError) as info:
            read_metadata(meta)
        assert info.value.path == meta and str(meta) in str(info.value), i


@pytest.mark.parametrize("cut", ["empty", "one byte", "half", "all but the trailer's last byte", "pickle only, cut"])
def test_a_truncated_or_empty_metadata_is_a_format_error(saved, cut):
    meta = saved / ".metadata"
    good = meta.read_bytes()
    keep = {"empty": 0, "one byte": 1, "half": len(good) // 2, "all but the trailer's last byte": len(good) - 1,
            "pickle only, cut": len(good) - 17}[cut]
    meta.write_bytes(good[:keep])
    with pytest.raises(gdsckpt.CheckpointFormatError, match=r"\.metadata") as info:
        GdsckptReader(saved).read_metadata()
    assert info.value.path == meta


def test_not_metadata_at_all_is_a_format_error(saved):
    meta = saved / ".metadata"
    for obj in ({"a": 1}, [1, 2], "x", None):
        meta.write_bytes(pickle.dumps(obj))
        with pytest.raises(gdsckpt.CheckpointFormatError, match="not DCP metadata"):
            read_metadata(meta)


# ---------------------------------------------------------------- non-tensor values in the rank files


def _plant(saved: Path, key: str, value) -> Path:
    """The rank file with `key`'s pickle replaced by torch.save(value): a valid gdsckpt file
    (checksums and all), as anyone who can write the bucket can make."""
    rank_file = saved / "__0_0.gdsckpt"
    state = gdsckpt.load(rank_file)
    assert key in state
    buf = io.BytesIO()
    torch.save(value, buf)
    state[key] = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    gdsckpt.save(state, rank_file)
    return rank_file


def _failure(info) -> BaseException:
    """The one rank's error inside DCP's CheckpointException."""
    (exc, _), = info.value.failures.values()
    return exc


def test_a_payload_in_a_non_tensor_value_is_refused_and_never_runs(saved, tmp_path):
    marker = tmp_path / "payload-ran"
    payloads = {"os.system": _Payload(f"touch {marker}"),
                "eval": _Eval(f"__import__('pathlib').Path({str(marker)!r}).touch()"),
                "torch.load": _Reduce(torch.load, (str(marker),)),
                "inside a dict": {"step": 7, "x": _Payload(f"touch {marker}")}}
    for name, payload in payloads.items():
        rank_file = _plant(saved, "meta.step", payload)
        with pytest.raises(BaseException, match="refused") as info:  # DCP wraps it (CheckpointException)
            _load(saved)
        err = _failure(info)
        assert isinstance(err, gdsckpt.CheckpointFormatError), name
        assert err.path == rank_file and err.key == "meta.step" and "'meta.step'" in str(err), name
        assert not marker.exists(), f"the {name} payload ran"
    # control: the planted pickle is live, DCP's own torch.load would have run it
    torch.load(io.BytesIO(_plain_pickle(_Payload(f"touch {marker}"))), weights_only=False)
    assert marker.exists()


def _plain_pickle(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def test_plain_non_tensor_values_still_round_trip(tmp_path):
    """What DCP pickles for non-tensor values (torch.save of each): plain values and containers,
    bytes, sets, complex numbers, tensors inside a tuple, NumPy's arrays and scalars (NumPy's
    generator state, as RNG() saves it); torch's process-wide allowlist is left as it was."""
    import numpy as np
    state = {"w": torch.arange(4.), "step": 7, "lr": 0.1, "name": "run", "flag": True, "none": None,
             "opt": {"betas": (0.9, 0.99), "lrs": [1e-3, None], "tags": {"a", "b"}, "c": 1 + 2j, "raw": b"\x00\xff"},
             "pair": (torch.ones(2), 3), "py_rng": random.getstate(), "np_rng": np.random.get_state(),
             "np_scalar": np.float32(2.5), "np_array": np.arange(6, dtype=np.int16).reshape(2, 3)}
    allowed = torch.serialization.get_safe_globals()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=GdsckptWriter(tmp_path / "ck"), no_dist=True)
        target = {k: None for k in state} | {"w": torch.zeros(4), "opt": dict.fromkeys(state["opt"])}
        dcp.load(target, storage_reader=GdsckptReader(tmp_path / "ck"), no_dist=True)
    assert torch.equal(target["w"], state["w"])
    for k in ("step", "lr", "name", "flag", "none", "opt", "py_rng"):
        assert target[k] == state[k] and type(target[k]) is type(state[k]), k
    assert torch.equal(target["pair"][0], torch.ones(2)) and target["pair"][1] == 3
    assert target["np_rng"][0] == "MT19937" and np.array_equal(target["np_rng"][1], state["np_rng"][1])
    assert target["np_rng"][2:] == state["np_rng"][2:]
    assert type(target["np_scalar"]) is np.float32 and target["np_scalar"] == np.float32(2.5)
    assert target["np_array"].dtype == np.int16 and np.array_equal(target["np_array"], state["np_array"])
    # NumPy's globals were allowed only for the load (torch may register its own meanwhile: DTensor's)
    now = torch.serialization.get_safe_globals()
    added = [g[0] if isinstance(g, tuple) else g for g in now if g not in allowed]
    assert not [g for g in added if getattr(g, "__module__", "").startswith("numpy")]


def test_a_value_no_restore_could_load_is_refused_at_the_save_naming_it(tmp_path):
    """A non-tensor value whose pickle torch.load(weights_only=True) refuses (a Path, an Enum) would
    be refused by every load of the step (the test above): the writer refuses it at the save,
    naming it, and writes no step."""
    import pathlib
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(BaseException) as info:  # DCP wraps the rank's error (CheckpointException)
            dcp.save({"w": torch.ones(3), "meta": {"dir": pathlib.PurePosixPath("/data")}},
                     storage_writer=GdsckptWriter(tmp_path / "ck"), no_dist=True)
    err = _failure(info)
    assert isinstance(err, gdsckpt.UnsupportedStateError)
    assert "'meta.dir' cannot be restored" in str(err) and "PurePosixPath" in str(err)
    assert not (tmp_path / "ck" / ".metadata").exists()
