"""`gdsckpt`: inspect, verify, convert, export and clean checkpoints, and look after a
Checkpointer's directory.

Exit codes (gdsckpt/cli/exitcodes.py): 0 ok; 1 damaged, failed verification or failed;
2 usage error; 3 not found. An error is one line on stderr, "gdsckpt COMMAND: error: MESSAGE" (a
path not found: the path, and what the command expected there). Every command takes --json: one
JSON document on stdout (an error: {"error": {"type", "message", "exit_code"}}, the message on
stderr too). Long commands show a progress bar on stderr while stdout is a terminal.

JSON documents, by command (fields are only ever added):
  inspect FILE   {"kind": "file", "path", "metadata", "streams": [{dtype, codec, tensors, logical_bytes,
                  stored_bytes, raw_chunks, ratio}], "tensors": {key: {dtype, shape, nbytes, codec, device}},
                  "values": {key: a plain value, or a list of them}}
  inspect DIR    {"kind": "dcp", "path", "dcp": {items, tensors, bytes_items, logical_bytes,
                  files: {rank file: [keys]}}, "files": [inspect FILE documents]}
  verify         {"path", "kind": "file"|"dcp", "ok", "deep", "isolated", "metadata": null | {ok, items,
                  tensors, error}, "files": [{path, ok, chunks, tensors, stored_bytes, error: null | {type,
                  message}}]}
  convert        {"src", "dst", "codec", "tensors", "streams", "logical_bytes", "stored_bytes", "file_bytes",
                  "ratio", "seconds", "backend"}
  export         {"src", "dst", "to", "tensors", "bytes"[, "values_left_out"]}
  clean          {"directory", "stale": [paths], "removed", "memory_dropped": [{rank, holder, steps, bytes, folder}],
                  "replicas_kept": [{rank, holder, folder, step, why}]} (holder: a peer replica's, null: own)
  clean --memory {"directory": null, "removed", "memory_gone": [{directory, rank, holder, steps, bytes, folder,
                  removed}]}
  ls             [{step, memory, memory_bytes, memory_state, replicas, replicas_bytes, replicas_state, local,
                  local_bytes, local_state, remote, remote_bytes, remote_state, remote_files}]
  restore-test   {"location", "remote", "step", "newest", "checked": [ls rows]}
  prune          {"directory", "removed", "local": [steps], "remote": [steps], "rollback": {"local": [steps],
                  "remote": [steps]} (a pending rollback's, among "local" and "remote"), "damaged": {step: why}}
"""

from __future__ import annotations

import argparse
import sys

from .._version import FORMAT_MAJOR, FORMAT_MINOR, __version__
from .exitcodes import ExitCode, exit_code_for
from .output import describe_error, emit_json, message_of, quiet_pipe

# Nothing above imports torch, nor much else: a command's module (and torch with it) is imported by
# run_command, after parsing, so that --help, --version and a usage error answer at once.

__all__ = ["main", "build_parser", "describe", "restore_test", "ExitCode"]

# The codecs `convert --codec` takes (gdsckpt.codecs.ALL_CODECS, which imports torch; a test keeps them equal).
CODECS = ("raw", "zstd", "ans", "ans-planes", "bitcomp")

EXPORT_HELP = """write the checkpoint in another format, one tensor at a time (never the whole state in
memory). safetensors: every key (a tied weight as a copy under each of its keys); plain values
(step, lr) have no place there and are left out. torch: what gdsckpt.load returns, as torch.save
writes it (NumPy arrays and bytes as tensors, so torch's weights-only loader reads it). torch.save
itself writes the file's description of every tensor and empty records for their bytes
(torch.serialization.skip_data), which are then filled one tensor at a time."""

EPILOG = """exit codes: 0 ok; 1 damaged, failed verification or failed (I/O, store, no decoder here);
2 usage error; 3 not found. --json on any command prints one JSON document on stdout."""

class _VersionAction(argparse.Action):
    """--version: the installed versions (versions.py), without importing torch or probing the GPU."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        from .versions import installed
        print(f"gdsckpt {__version__} (file format {FORMAT_MAJOR}.{FORMAT_MINOR}, torch {installed('torch')}, "
              f"nvCOMP {installed('nvidia-nvcomp-cu13', 'nvidia-nvcomp-cu12')})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gdsckpt", description=__doc__.split("\n\n")[0], epilog=EPILOG)
    ap.add_argument("--version", action=_VersionAction, help="print the versions of gdsckpt, its file format, "
                    "torch and nvCOMP, and exit")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(name, help, **kw):
        p = sub.add_parser(name, help=help, description=kw.pop("description", help), parents=[common],
                           epilog=EPILOG, **kw)
        return p

    p = command("inspect", "tensors, dtypes, shapes, and codec and ratio per stream, of a file "
                "or a DCP step folder (each rank file)")
    p.add_argument("path", help="a gdsckpt file, an s3://bucket/key object, or a DCP step folder")
    p.add_argument("--summary", action="store_true", help="streams only, no tensor list")
    p = command("verify", "check every chunk's checksum (no GPU needed); of a DCP step folder, "
                "its .metadata, the keys it names and every rank file")
    p.add_argument("path", help="a gdsckpt file, an s3://bucket/key object, or a DCP step folder")
    p.add_argument("--deep", action="store_true", help="also decode every chunk")
    p.add_argument("--isolated", action="store_true",
                   help="decode every chunk in a child process, none in this one (files from elsewhere: a "
                        "forged chunk that faults a GPU decoder takes down only the child)")
    p = command("convert", "rewrite with another codec (zstd: readable on any CPU), one tensor "
                "at a time through a scratch file beside DST (free space: the logical size)")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--codec", default="zstd", choices=[*CODECS, "auto"])
    p = command("export", "write as safetensors or torch.save, one tensor at a time",
                description=EXPORT_HELP)
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--to", required=True, choices=["safetensors", "torch"])
    p = command("clean", "list (and with --yes remove) temporaries left by killed saves and restores")
    p.add_argument("directory", nargs="?",
                   help="a checkpoint directory; left out with --memory: the memory tiers of directories that are gone")
    p.add_argument("--yes", action="store_true")
    p.add_argument("--memory", action="store_true",
                   help="also drop the directory's memory-tier copies on this host (refused while a manager holds them); "
                        "with no directory: list (--yes: remove) this user's memory tiers whose directory was moved or "
                        "removed")
    p = command("ls", "steps of a Checkpointer directory or s3:// prefix: where, size, intact")
    p.add_argument("location", help="a checkpoint directory or s3://bucket/prefix")
    p.add_argument("--remote", help="also list this s3://bucket/prefix")
    p.add_argument("--verify", action="store_true", help="check every chunk checksum (reads every byte)")
    p = command("restore-test", "verify the newest step (newest first until one is intact); "
                "exit 0: the newest is intact, 1: it is not (an older one or none would be restored), "
                "3: no step at all")
    p.add_argument("location", help="a checkpoint directory or s3://bucket/prefix")
    p.add_argument("--remote", help="the directory's s3://bucket/prefix")
    p = command("prune", "apply the Checkpointer's retention now (never a step's only copy); "
                "with --yes it takes the directory's lock, without it changes nothing")
    p.add_argument("directory")
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--remote", help="the directory's s3://bucket/prefix")
    p.add_argument("--keep-remote", type=int, default=None)
    p.add_argument("--yes", action="store_true", help="remove (without it: list what would go)")
    return ap


def __getattr__(name: str):
    """describe and restore_test (views.py), imported on first use."""
    if name in ("describe", "restore_test"):
        from . import views
        return getattr(views, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def run_command(args) -> int:
    """Run the parsed command `args.cmd`: its module (and torch) imported now, not before parsing."""
    if args.cmd in ("inspect", "verify"):
        from . import files as module
    elif args.cmd in ("convert", "export"):
        from . import export as module
    else:
        from . import views as module
    return int(getattr(module, "cmd_" + args.cmd.replace("-", "_"))(args))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)  # a usage error exits 2 here (argparse)
    with quiet_pipe():
        try:
            return run_command(args)
        except Exception as e:  # noqa: BLE001 - mapped to an exit code, or re-raised as the bug it is
            try:
                code = exit_code_for(e)
            except TypeError:
                raise e from None
            print(f"gdsckpt {args.cmd}: error: {message_of(e)}", file=sys.stderr)
            if args.json:
                emit_json({"error": {**describe_error(e), "exit_code": int(code)}})
            return int(code)


if __name__ == "__main__":
    sys.exit(main())
