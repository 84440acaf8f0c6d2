"""The writer's bytes do not change under refactoring (issue 19, "done when"): a fixed state saved
with each CPU codec, and through save_async's pool, gives the file the code before the save
seam wrote (tests/data/writer_bytes/, made once by tests/writer_golden.py from that code).

Compared exactly: every byte before the index (header, chunk records, their zero padding), the
parsed index less its `created` time (the one field that differs on every save; gdsckpt files
carry no ids), and every footer field but the two checksums that cover `created`. The index's
`library` and `writer.torch` name the environment; where they differ from the one that wrote the
goldens they are compared as that environment's, and zstd's output is compared only with the
same zstd library (another zstd may compress differently and still be a valid file)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import gdsckpt
from gdsckpt.format import file as fmt
from conftest import assert_same
from writer_golden import CASES, golden_state, write_all

GOLDEN = Path(__file__).parents[1] / "data" / "writer_bytes"
ENV = json.loads((GOLDEN / "ENV.json").read_text())


def _parts(data: bytes, env: dict) -> tuple[bytes, dict, tuple]:
    """(bytes before the index, the index less what differs per save or per environment, the
    footer's fields less its checksums)."""
    body = data[-fmt.FOOTER_SIZE:-8]
    magic, major, minor, flags, off, length, _index_ck, file_len, reserved = fmt._FOOTER.unpack(body)
    index = json.loads(data[off:off + length])
    index.pop("created")
    assert index["library"] == f"gdsckpt {env['gdsckpt']}" and index["writer"]["torch"] == env["torch"]
    index["library"], index["writer"]["torch"] = "<gdsckpt>", "<torch>"
    return data[:off], index, (magic, major, minor, flags, off, length, file_len, reserved)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("writer_bytes")
    return out, write_all(out)


@pytest.mark.parametrize("name", list(CASES))
def test_saved_bytes_match_the_golden_file(name, written):
    out, env = written
    if CASES[name][1] != "raw" and env["zstd"] != ENV["zstd"]:
        pytest.skip(f"goldens compressed by zstd {ENV['zstd']}, this is {env['zstd']}")
    want, got = (GOLDEN / f"{name}.gdsckpt").read_bytes(), (out / f"{name}.gdsckpt").read_bytes()
    assert len(got) == len(want)
    w_head, w_index, w_footer = _parts(want, ENV)
    g_head, g_index, g_footer = _parts(got, env)
    assert g_footer == w_footer
    assert g_index == w_index
    assert g_head == w_head, next(i for i, (a, b) in enumerate(zip(g_head, w_head)) if a != b)
    assert_same(gdsckpt.load(out / f"{name}.gdsckpt"), golden_state())


def test_the_goldens_are_whole_checkpoints_of_the_state():
    """They load bit-exact and pass every checksum: what is compared above is a real file."""
    for name in CASES:
        with gdsckpt.open(GOLDEN / f"{name}.gdsckpt") as ck:
            ck.verify(deep=True)
            assert_same(ck.load(), golden_state())


def test_index_from_cached_parts_is_the_whole_document_encoded_at_once():
    """encode_index joins the index from parts, its tensor list cached per layout: the bytes are
    json.dumps of the whole document at once (the golden files above check its content), for
    layouts saved in turn and the same tensors on another device (a cached list is never handed
    to another layout)."""
    from gdsckpt.format.plan import make_plan
    from gdsckpt.engine.ring import ChunkRecord

    layouts = []
    for n in (3, 5):
        specs = [(f"w{i}", "float32", (i + 1, 2), 8 * (i + 1)) for i in range(n)]
        plan = make_plan(specs, lambda d: {"name": "zstd", "level": 3}, 16)
        records = [ChunkRecord(64 * c.index, c.length - 1, c.index % 2 == 1, 2 ** 63 + c.index,
                               [c.length] if c.index == 0 else None) for c in plan.chunks]
        skeleton = {"w": [{"__tensor__": i} for i in range(n)], "lr": 0.5, "nan": float("nan")}
        layouts.append(({"library": "x", "created": n}, skeleton, ["cuda:0"] * n, plan, records))
    for meta, skeleton, devices, plan, records in layouts + layouts + [(*layouts[0][:2], ["cpu"] * 3, *layouts[0][3:])]:
        raw = fmt.encode_index(meta, skeleton, devices, plan, records)
        doc = json.loads(raw)
        assert raw == json.dumps(doc, separators=(",", ":")).encode()
        assert list(doc)[-2:] == ["tensors", "chunks"] and doc["created"] == meta["created"]
        assert [(t["key"], tuple(t["shape"]), t["device"]) for t in doc["tensors"]] == \
            [(t.key, t.shape, d) for t, d in zip(plan.tensors, devices)]
        assert [(c["stored"], c["checksum"], c.get("raw", False)) for c in doc["chunks"]] == \
            [(r.stored, f"{r.checksum:016x}", r.raw) for r in records]
