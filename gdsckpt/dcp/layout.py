"""A DCP checkpoint directory as GdsckptWriter and GdsckptReader lay it out: the file names,
each write item's key in its rank file, and which checkpoint ids name a local directory."""

from __future__ import annotations

import os
import re
from pathlib import Path

from torch.distributed.checkpoint.metadata import MetadataIndex

__all__ = ["METADATA_FILE", "SUFFIX", "DCP_VERSION", "RANK_FILE", "item_key", "metadata_path", "local_dir_id"]

METADATA_FILE = ".metadata"  # DCP's name for it: FileSystemReader finds it there too
SUFFIX = ".gdsckpt"
DCP_VERSION = "1.0.0"  # torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION in torch 2.4-2.13
RANK_FILE = re.compile(r"^__\d+_\d+" + re.escape(SUFFIX) + "$")


def item_key(index: MetadataIndex) -> str:
    """The gdsckpt key of a write item: its FQN, and for tensors the chunk's offset in the
    global tensor (one rank may hold several chunks of one FQN)."""
    if index.offset is None:
        return index.fqn
    return f"{index.fqn}@{','.join(str(int(o)) for o in index.offset)}"


def metadata_path(root: Path, rank: int | None) -> Path:
    return root / (METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}")


def local_dir_id(checkpoint_id) -> bool:
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        return False
    s = os.fspath(checkpoint_id)
    if isinstance(s, bytes) or "://" in s:
        return False
    p = Path(s)
    return not p.exists() or p.is_dir()
