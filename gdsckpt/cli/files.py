"""`gdsckpt inspect` and `gdsckpt verify`: one checkpoint file (local or s3://), or a DCP step
folder (GdsckptWriter's: a `.metadata` and one gdsckpt file per rank).

A DCP folder is verified as dcp.load would need it: its `.metadata` read through the allowlist
unpickler and checked against its checksum (gdsckpt.dcp.metadata), every (file, key) it names
present, and every rank file verified like a single file.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import api
from ..dcp.layout import METADATA_FILE, RANK_FILE
from ..dcp.metadata import read_metadata
from gdsckpt.core.dtypes import ITEMSIZE, name_of
from ..errors import CheckpointFormatError, GdsckptError
from gdsckpt.engine.interfaces import ChunkFile, ReadsAhead
from gdsckpt.reading.interfaces import ChunkSource
from ..stores import is_remote
from gdsckpt.core.units import format_bytes
from .exitcodes import ExitCode
from .output import describe_error, emit_json, progress
from .paths import FILE_OR_FOLDER, expect_path

__all__ = ["Target", "resolve", "inspect_file", "dcp_summary", "cmd_inspect", "cmd_verify"]


@dataclass(frozen=True)
class Target:
    """What a PATH argument names: kind "file" (a gdsckpt file or store object) or "dcp" (a DCP
    step folder); `files` are its gdsckpt files (the one file; the folder's rank files)."""

    path: str
    kind: str
    files: list[str]


def resolve(path: str) -> Target:
    if is_remote(path):
        return Target(path, "file", [path])
    expect_path(path, FILE_OR_FOLDER)
    p = Path(path)
    if not p.is_dir():
        return Target(path, "file", [path])
    if not (p / METADATA_FILE).is_file():
        raise CheckpointFormatError(f"not a regular file, and not a DCP step folder either (no {METADATA_FILE}: "
                                    "never committed, or not a checkpoint)", path=path)
    return Target(path, "dcp", [str(f) for f in sorted(p.iterdir()) if RANK_FILE.match(f.name) and f.is_file()])


# ---------------------------------------------------------------- DCP step folders


def dcp_summary(root: str) -> dict:
    """What a DCP folder's `.metadata` says: {"items", "tensors", "bytes_items", "logical_bytes",
    "files": {rank file: keys it should hold}}; a CheckpointFormatError if it is damaged or was
    not written by GdsckptWriter."""
    path = Path(root) / METADATA_FILE
    md = read_metadata(path)
    tensors = bytes_items = logical = 0
    for item in md.state_dict_metadata.values():
        if hasattr(item, "chunks"):
            tensors += 1
            logical += math.prod(item.size) * ITEMSIZE.get(name_of(item.properties.dtype) or "", 0)
        else:
            bytes_items += 1
    files: dict[str, list[str]] = {}
    for sd in (md.storage_data or {}).values():
        if not (isinstance(sd, dict) and isinstance(sd.get("file"), str) and isinstance(sd.get("key"), str)):
            raise CheckpointFormatError("this DCP checkpoint was not written by GdsckptWriter (its storage data "
                                        f"is a {type(sd).__name__})", path=path)
        if "/" in sd["file"] or sd["file"] in ("", ".", ".."):
            raise CheckpointFormatError(f"the metadata names a file outside the folder: {sd['file']!r}", path=path)
        files.setdefault(sd["file"], []).append(sd["key"])
    return {"items": len(md.state_dict_metadata), "tensors": tensors, "bytes_items": bytes_items,
            "logical_bytes": logical, "files": {f: sorted(k) for f, k in sorted(files.items())}}


def _check_references(root: str, summary: dict, ck, name: str) -> None:
    """Every key the metadata expects in rank file `name` (opened as `ck`) is there."""
    missing = [k for k in summary["files"].get(name, []) if k not in ck]
    if missing:
        raise CheckpointFormatError(f"the DCP metadata names {len(missing)} key(s) the file does not hold",
                                    path=str(Path(root) / name), key=missing[0])


# ---------------------------------------------------------------- inspect


def inspect_file(path: str) -> dict:
    """{"path", "metadata", "streams", "tensors": {key: {dtype, shape, nbytes, codec, device}},
    "values": {key: value}} (plain_values)."""
    with api.open(path) as ck:
        return {"path": str(path), "metadata": ck.metadata, "streams": ck.streams(),
                "tensors": {k: {**ck.info(k), "shape": list(ck.info(k)["shape"])} for k in ck.keys()},
                "values": plain_values(ck.index.skeleton)}


def plain_values(skeleton: dict) -> dict:
    """The plain values a checkpoint holds besides its tensors (step, lr, a name), by key path as
    the tensors' ("<root>" for a state that is one value). A list or tuple of nothing but plain
    values (an optimizer's betas, its param_groups' parameter ids) is one entry: the list."""
    out = {}

    def visit(node: dict, key: str, depth: int) -> None:
        (kind, body), = node.items()
        if kind == "value":
            out[key or "<root>"] = body
            return
        if kind in ("list", "tuple") and body and all("value" in n for n in body):
            values = [n["value"] for n in body]
            out[key or "<root>"] = values if kind == "list" else tuple(values)
            return
        if kind == "odict":
            kind, body = "dict", body["items"]
        children = body if kind == "dict" else enumerate(body) if kind in ("list", "tuple") else ()
        for k, child in children:
            visit(child, f"{key}/{k}" if depth else str(k), depth + 1)

    visit(skeleton, "", 0)
    return out


def cmd_inspect(args) -> int:
    target = resolve(args.path)
    summary = dcp_summary(target.path) if target.kind == "dcp" else None
    files = [inspect_file(f) for f in target.files]
    if args.json:
        if summary is None:
            emit_json({"kind": "file", **files[0]})
        else:
            emit_json({"kind": "dcp", "path": target.path, "dcp": summary, "files": files})
        return ExitCode.OK
    if summary is not None:
        print(f"{target.path}: DCP checkpoint, {summary['items']} items ({summary['tensors']} tensors, "
              f"{summary['bytes_items']} byte items), {format_bytes(summary['logical_bytes'])} of tensors, "
              f"{len(files)} rank file(s)")
    for info in files:
        if summary is not None:
            print()
        _print_file(info, summary=args.summary)
    return ExitCode.OK


def _print_file(info: dict, *, summary: bool) -> None:
    meta, streams, tensors = info["metadata"], info["streams"], info["tensors"]
    w = meta.get("writer") or {}
    print(f"{info['path']}: format {meta['format'][0]}.{meta['format'][1]}, {meta.get('library')}, "
          f"nvCOMP {meta.get('nvcomp') or '-'}, written by the {w.get('backend')} backend "
          f"(io {w.get('io_path')}) {meta.get('created')}")
    print(f"\n{'stream':<16}{'codec':<9}{'tensors':>8}{'logical':>12}{'stored':>12}{'saved':>8}{'raw chunks':>12}")
    tot_l = tot_s = 0
    for s in streams:
        tot_l, tot_s = tot_l + s["logical_bytes"], tot_s + s["stored_bytes"]
        print(f"{s['dtype']:<16}{s['codec']:<9}{s['tensors']:>8}{format_bytes(s['logical_bytes']):>12}"
              f"{format_bytes(s['stored_bytes']):>12}{1 - s['ratio']:>8.1%}{s['raw_chunks']:>12}")
    print(f"{'total':<16}{'':<9}{len(tensors):>8}{format_bytes(tot_l):>12}{format_bytes(tot_s):>12}"
          f"{(1 - tot_s / tot_l) if tot_l else 0:>8.1%}")
    if not summary:
        print(f"\n{'tensor':<60}{'dtype':<16}{'shape':<24}{'device':<7}")
        for k, i in tensors.items():
            print(f"{k:<60}{i['dtype']:<16}{str(i['shape']):<24}{i['device']:<7}")
        if info["values"]:
            print("\nvalue")
            for k, v in info["values"].items():
                print(f"{k:<60}{_shown(v)}")


def _shown(value, width: int = 60) -> str:
    """A plain value as inspect prints it: its repr, a long list cut in the middle with its length."""
    text = repr(value)
    if len(text) <= width:
        return text
    if isinstance(value, (list, tuple)):
        head, tail = ", ".join(map(repr, value[:3])), repr(value[-1])
        opening, closing = "[]" if isinstance(value, list) else "()"
        return f"{opening}{head}, ..., {tail}{closing} ({len(value)} values)" if len(head) + len(tail) < width \
            else f"({len(value)} values)"
    return text[:width - 3] + "..."


# ---------------------------------------------------------------- verify


class _Counted:
    """A checkpoint's ChunkSource that reports the bytes read through it (the progress bar);
    everything else is the source's own."""

    def __init__(self, source: ChunkSource, on_bytes):
        self._source, self._on_bytes = source, on_bytes
        self.label, self.size, self.io_threads, self.io = source.label, source.size, source.io_threads, source.io
        self.read_task_bytes = source.read_task_bytes

    def pread(self, n: int, offset: int) -> bytes:
        data = self._source.pread(n, offset)
        self._on_bytes(len(data))
        return data

    def open_chunks(self, backend) -> ChunkFile:
        file = self._source.open_chunks(backend)
        return (_CountedAhead if isinstance(file, ReadsAhead) else _CountedChunks)(file, self._on_bytes)

    def child_file(self):
        return self._source.child_file()

    def close(self) -> None:
        self._source.close()


class _CountedChunks:
    def __init__(self, file: ChunkFile, on_bytes):
        self._file, self._on_bytes = file, on_bytes
        self.fd = file.fd

    def pread(self, buf, nbytes: int, offset: int):
        self._on_bytes(nbytes)
        return self._file.pread(buf, nbytes, offset)

    def pwrite(self, buf, nbytes: int, offset: int):
        return self._file.pwrite(buf, nbytes, offset)

    def close(self) -> None:
        self._file.close()


class _CountedAhead(_CountedChunks):
    """A counted file that reads ahead (ring.ReadsAhead): the ring's plan reaches it, so a deep
    verify on the GPU reads as a restore does, not record by record."""

    def will_read(self, ranges) -> None:
        self._file.will_read(ranges)

    @property
    def io_path(self) -> str:
        return self._file.io_path

    @property
    def stages(self) -> dict[str, float]:
        return self._file.stages


def _verify_one(path: str, args, bar, summary: dict | None, root: str) -> dict:
    """One file's verify entry: {"path", "ok", "chunks", "tensors", "stored_bytes", "error"}. The
    file named on the command line (a store object: resolve() cannot tell) missing is not found
    (exit 3), as a missing local file is; a part missing from a DCP folder is damage."""
    entry = {"path": str(path), "ok": False, "chunks": None, "tensors": None, "stored_bytes": None, "error": None}
    try:
        with api.open(path) as ck:
            if summary is not None:
                _check_references(root, summary, ck, Path(path).name)
            ck.source = _Counted(ck.source, bar.update)
            r = ck.verify(deep=args.deep, isolated=args.isolated)
        entry.update(ok=True, chunks=r["chunks"], tensors=r["tensors"], stored_bytes=r["stored_bytes"])
    except FileNotFoundError as e:
        if path == root:
            raise
        entry["error"] = describe_error(e)
    except (GdsckptError, OSError) as e:
        entry["error"] = describe_error(e)
    return entry


def cmd_verify(args) -> int:
    target = resolve(args.path)
    result = {"path": target.path, "kind": target.kind, "deep": bool(args.deep or args.isolated),
              "isolated": bool(args.isolated), "ok": False, "metadata": None, "files": []}
    summary = None
    files = list(target.files)
    if target.kind == "dcp":
        try:
            summary = dcp_summary(target.path)
            result["metadata"] = {"ok": True, "error": None, **{k: summary[k] for k in ("items", "tensors")}}
            files += [str(Path(target.path) / f) for f in summary["files"] if str(Path(target.path) / f) not in files]
        except (GdsckptError, OSError) as e:
            result["metadata"] = {"ok": False, "error": describe_error(e)}
    total = sum(Path(f).stat().st_size for f in files if not is_remote(f) and Path(f).is_file())
    passes = 2 if args.deep and not args.isolated else 1
    bar = progress(total * passes or None, f"verify {Path(target.path).name}")
    try:
        for f in files:
            result["files"].append(_verify_one(f, args, bar, summary, target.path))
    finally:
        bar.close()
    errors = [e["error"] for e in [result["metadata"] or {}, *result["files"]] if e.get("error")]
    result["ok"] = not errors
    if args.json:  # the JSON on stdout, each failure's message on stderr too (as every command's error)
        for e in errors:
            print(f"gdsckpt verify: error: {e['message']}", file=sys.stderr)
        emit_json(result)
    else:  # the report on stdout, each failure once in it (its DAMAGED line)
        _print_verify(result, args)
    return ExitCode.DAMAGED if errors else ExitCode.OK  # a part missing from a folder is damage too


def _print_verify(result: dict, args) -> None:
    how = (" and decoded in an isolated process" if args.isolated else " and decoded" if args.deep
           else " (checksums)")
    if result["metadata"] is not None:
        md = result["metadata"]
        if md["ok"]:
            print(f"{result['path']}/{METADATA_FILE}: OK, {md['items']} items")
        else:
            print(f"{result['path']}/{METADATA_FILE}: DAMAGED: {md['error']['type']}: {md['error']['message']}")
    for f in result["files"]:
        if f["ok"]:
            print(f"{f['path']}: OK, {f['chunks']} chunks of {f['tensors']} tensors verified{how}")
        else:
            print(f"{f['path']}: DAMAGED: {f['error']['type']}: {f['error']['message']}")
    if result["kind"] == "dcp":
        print(f"{result['path']}: {'OK' if result['ok'] else 'DAMAGED'}")
