"""gdsckpt/reading/isolated.py driven directly: a child process decodes chunks from a (file, index) source,
`IndexedFile`, opening the very file the parent opened (by its inherited descriptor) or, once the
parent has closed it, by its path, and refusing another file there. The trusted=False paths
through `load` / `load_into` / `verify --isolated` are in test_reader_contract.py."""

from __future__ import annotations

import pytest
import torch

import gdsckpt
from gdsckpt.format import file as fmt
from gdsckpt.reading import isolated, sources


def _file(tmp_path, value: float):
    p = tmp_path / "c.gdsckpt"
    state = {f"t{i}": torch.arange(3000.0) * value + i for i in range(4)}
    gdsckpt.save(state, p, codec="zstd", chunk_bytes=8 << 10)
    return p, state


def _open(p) -> isolated.IndexedFile:
    src = sources.LocalFile(p)
    return isolated.IndexedFile(src, fmt.read_index(src.pread, src.size, p))


def _logical(state) -> bytes:
    return b"".join(t.numpy().tobytes() for t in state.values())  # one float32 stream, in key order


def test_the_child_decodes_the_file_the_parent_opened(tmp_path):
    p, old = _file(tmp_path, 1.0)
    source = _open(p)
    try:
        _file(tmp_path, 2.0)  # a newer save renamed over the path: the child must not read it
        chunks = [c.index for c in source.index.plan.chunks]
        got = {}
        n = isolated.run(source, chunks[::-1], "cpu", None,
                         deliver=lambda c, data: got.__setitem__(c, bytes(data.numpy())))
        assert n == len(chunks) and sorted(got) == chunks
        assert b"".join(got[c] for c in chunks) == _logical(old)
        assert isolated.run(source, chunks[:2], "cpu", None) == 2  # vet: into scratch only
        assert isolated.run(source, [], "cpu", None) == 0  # nothing to do: no child
    finally:
        source.file.close()


def test_a_closed_file_is_opened_by_its_path_and_must_be_the_same(tmp_path):
    p, state = _file(tmp_path, 1.0)
    source = _open(p)
    source.file.close()
    assert isolated.run(source, [0, 1], "cpu", None) == 2  # by the path: the same file
    _file(tmp_path, 2.0)
    with pytest.raises(gdsckpt.BackendUnavailableError, match="opened another file than the parent's") as ei:
        isolated.run(source, [0, 1], "cpu", None)
    assert str(p) in str(ei.value)
