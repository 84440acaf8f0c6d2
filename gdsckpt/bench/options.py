"""gdsckpt-bench's options (the save/restore jobs'; --train and --cost add theirs in train.py and
cost.py), each checked as argparse reads it, so that a bad value is a usage error (exit 2)
naming the option before the workload is built or any job runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from gdsckpt.core import units
from gdsckpt.format.file import ALIGN, MAX_CHUNK_BYTES
from gdsckpt.writing.save import check_codec

from .train_loop import INTERVAL, STEPS, TRAIN_SIZES, n_checkpoints

NAMED_SIZES = ("auto", "tiny", "gpt2-small", *TRAIN_SIZES)  # --train takes its models by name too

# --output-format terse: one ';'-separated line per job, these fields in this order (more may be
# appended, never reordered).
TERSE_FIELDS = ("gdsckpt", "schema", "name", "rw", "target", "io_path", "codec", "bs", "iodepth", "logical_bytes",
                "stored_bytes", "logical_gbps", "stored_gbps", "iops", "lat_p50_ms", "lat_p90_ms", "lat_p99_ms",
                "lat_p99.9_ms", "logical_gbps_std", "cpu_user_s_per_gb", "cpu_sys_s_per_gb")
TERSE_DOC = ("\n--output-format terse: one line per job, fields separated by ';':\n  "
             + ";".join(TERSE_FIELDS) + "\n(GB/s: 10^9 bytes a second; lat: chunk latency percentiles; "
             "cpu: seconds of the whole process per GB of logical state)\n")


def _type(conv):
    """An argparse type from `conv`, whose ValueError becomes argparse's usage error."""
    def parse(text: str):
        try:
            return conv(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = conv.__name__  # argparse names the type in some messages
    return parse


def size(text: str) -> str:
    """--size: a named workload or model, or a byte count (kept as text: workload.make_state reads
    it); what the mode takes of these is checked with the other options (check_size)."""
    if text not in NAMED_SIZES:
        if units.parse_size(text) <= 0:
            raise ValueError(f"{text!r}: the state size must be more than 0 bytes")
    return text


def chunk_size(text: str) -> int:
    n = units.parse_size(text)
    if n <= 0 or n % ALIGN or n > MAX_CHUNK_BYTES:
        raise ValueError(f"{text!r} is {n} bytes: a chunk size must be a positive multiple of {ALIGN} bytes of at "
                         f"most {units.format_bytes(MAX_CHUNK_BYTES)} (e.g. 64MiB, or 64M)")
    return n


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a whole number") from None


def depth(text: str) -> int:
    n = _whole(text)
    if n < 2:
        raise ValueError(f"{n}: the ring needs at least 2 slots so that compression overlaps I/O")
    return n


def positive_int(text: str) -> int:
    n = _whole(text)
    if n < 1:
        raise ValueError(f"{n}: must be at least 1")
    return n


def seconds(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number of seconds") from None
    if not x >= 0 or x == float("inf"):
        raise ValueError(f"{text!r}: must be 0 or more seconds")
    return x


def comma_list(conv):
    """A comma list of `conv` values (a sweep): every value checked, none empty."""
    def parse(text: str) -> list:
        parts = text.split(",")
        if any(not p.strip() for p in parts):
            raise ValueError(f"{text!r}: an empty item in the comma list")
        return [conv(p.strip()) for p in parts]
    parse.__name__ = f"comma list of {conv.__name__}"
    return parse


def device(text: str) -> str:
    kind, _, index = text.partition(":")
    if kind == "cpu" and not index or kind == "cuda" and (not index or index.isdigit()):
        return text
    raise ValueError(f"{text!r}: the device must be cpu, cuda or cuda:N")


def codec(text: str) -> str:
    check_codec(text)
    return text


def data_spec(text: str) -> str:
    if text in ("default", "random", "zeros"):
        return text
    if text.startswith("file:") and text[5:]:
        if not Path(text[5:]).exists():
            raise ValueError(f"{text!r}: no such file")
        return text
    raise ValueError(f"{text!r}: the data must be default, random, zeros or file:PATH")


def add_shared(ap) -> None:
    """The options the save/restore jobs and --train both take."""
    ap.add_argument("--size", default="auto", type=_type(size),
                    help="the save/restore jobs' state: auto, tiny, gpt2-small, or bytes: 4GB (4 x 10^9), 4GiB or 4G "
                         "(4 x 2^30); --train's model: auto, " + ", ".join(TRAIN_SIZES))
    ap.add_argument("--device", default=None, type=_type(device), help="cpu, cuda or cuda:N (default: cuda if usable)")
    ap.add_argument("--directory", help="directory for the checkpoints (default: a temporary one)")
    ap.add_argument("--output-format", choices=["normal", "json", "terse"], default="normal",
                    help="normal (text), json (the schema in --help) or terse (';'-separated, fields in --help)")
    ap.add_argument("--output", help="also write the JSON result to this file")
    ap.add_argument("--plot", help="PNG chart of the compare table and/or the sweep, or of --train's methods")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The save/restore jobs' options, fio's names where fio has one, and the shared ones."""
    ap.add_argument("--rw", choices=["write", "read", "rw"], default="rw")
    add_shared(ap)
    ap.add_argument("--bs", type=_type(comma_list(chunk_size)),
                    help="chunk size, e.g. 64MiB (or 64M); a comma list sweeps")
    ap.add_argument("--iodepth", type=_type(comma_list(depth)), help="ring depth (slots in flight, at least 2); "
                    "a comma list sweeps")
    ap.add_argument("--numjobs", type=_type(positive_int), default=None,
                    help="I/O threads (KvikIO num_threads / host pool)")
    ap.add_argument("--direct", type=int, choices=[0, 1], default=None,
                    help="KvikIO O_DIRECT for compat-mode I/O (default: KvikIO's own)")
    ap.add_argument("--filename", help="checkpoint file to write/read")
    ap.add_argument("--loops", type=_type(positive_int), default=1, help="timed loops of each job (fio's loops)")
    ap.add_argument("--runtime", type=_type(seconds), default=0,
                    help="as fio's: no loop of a job starts once this many seconds have passed (at least one "
                         "runs; a save or load is never cut short)")
    ap.add_argument("--time_based", "--time-based", dest="time_based", action="store_true",
                    help="as fio's: repeat each job's loops until --runtime has passed, whatever --loops says")
    ap.add_argument("--codec", default="auto", type=_type(codec))
    ap.add_argument("--ioengine", choices=["gds", "compat", "posix"], default=None,
                    help="gds: cuFile (fail if absent); compat: KvikIO POSIX path; posix: the CPU path")
    ap.add_argument("--target", choices=["file", "null", "null-d2h"], default="file",
                    help="null: storage removed; null-d2h: plus the copy into a pinned host ring")
    ap.add_argument("--data", default="default", type=_type(data_spec),
                    help="default (realistic), random, zeros, file:PATH")
    ap.add_argument("--warm", action="store_true", help="read from the page cache (labelled warm)")
    ap.add_argument("--compare", action="store_true", help="also run safetensors, raw KvikIO, ... beside torch.save")
    ap.add_argument("--no-disk-probe", action="store_true")


def check(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """What no single option can check: options that need each other."""
    check_size(args, ap)
    if args.train:
        check_train(args, ap)
    if getattr(args, "state_per_gpu", None):  # cost.py's option, read only after the run otherwise
        try:
            units.parse_size(args.state_per_gpu)
        except ValueError as e:
            ap.error(f"argument --state-per-gpu: {e}")
    if args.time_based and not args.runtime:
        ap.error("--time_based needs --runtime (the seconds to repeat each job for)")
    if args.plot and not (args.train or args.compare or len(args.bs or []) > 1 or len(args.iodepth or []) > 1):
        ap.error("--plot needs --compare or a --bs/--iodepth sweep (comma lists), or --train")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib (pip install matplotlib, or the plot extra: pip install \".[plot]\")")
    if args.target != "file" and args.rw != "rw" and args.rw != "write":
        ap.error(f"--target {args.target} only writes: --rw read reads a file")


def check_train(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """--steps, --interval and --sync-every together, where given (with neither of the first two,
    the CPU's plan picks them to fit --sync-every: train.plan)."""
    if args.steps is None and args.interval is None and args.sync_every >= 1:
        return
    steps, interval = args.steps or STEPS, args.interval or INTERVAL
    if interval < 1 or n_checkpoints(steps, interval) < 1:
        ap.error(f"argument --steps: {steps} steps at --interval {interval}: the steps must be at least twice the "
                 "interval (every checkpoint is followed by a full interval)")
    if args.sync_every < 1 or max(1, interval // 4) % args.sync_every:
        ap.error(f"argument --sync-every: {args.sync_every}: must divide --interval // 4 ({max(1, interval // 4)}), "
                 "so that every run of steps the estimates sum ends with a sync")


def check_size(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """--size against the mode: --train takes a model by name; the save/restore jobs a state by
    name or a byte count, the realistic state's no smaller than it can be (its embeddings and
    head), which is refused with that minimum rather than measured at another size."""
    if args.train:
        if args.size != "auto" and args.size not in TRAIN_SIZES:
            ap.error(f"argument --size: {args.size!r}: --train takes a model by name: auto, {', '.join(TRAIN_SIZES)}")
        return
    if args.size in ("auto", "tiny", "gpt2-small"):
        return
    if args.size in TRAIN_SIZES:
        ap.error(f"argument --size: {args.size!r} is one of --train's models; the save/restore jobs take auto, tiny, "
                 "gpt2-small or a byte count")
    if args.data != "default":
        return
    from gdsckpt.engine.backend import gpu_status

    from .workload import min_bytes
    where = args.device or ("cuda" if gpu_status()[0] else "cpu")
    least = min_bytes(where)
    if units.parse_size(args.size) < least:
        ap.error(f"argument --size: {args.size!r} is below the smallest realistic state on "
                 f"{where.split(':')[0]}, {units.format_bytes(least)} ({least} bytes: its embeddings and head); "
                 "ask for that much or more, or take --data random for a smaller state")
