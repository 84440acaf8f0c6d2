"""Typed errors. Every error names the file, and where it applies the tensor key and chunk."""

from __future__ import annotations


class GdsckptError(Exception):
    """Base class of every error gdsckpt raises on purpose."""


class UnsupportedStateError(GdsckptError, TypeError):
    """The state holds something gdsckpt will not save (raised before anything is written)."""


class CheckpointFormatError(GdsckptError, ValueError):
    """A file is not a valid gdsckpt checkpoint: torn, truncated, corrupt or hostile."""

    def __init__(self, message: str, *, path=None, key: str | None = None, chunk: int | None = None):
        where = []
        if path is not None:
            where.append(f"file {str(path)!r}")
        if key is not None:
            where.append(f"tensor {key!r}")
        if chunk is not None:
            where.append(f"chunk {chunk}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
        self.path, self.key, self.chunk = path, key, chunk


class ChecksumError(CheckpointFormatError):
    """A chunk's stored bytes do not match the checksum recorded for them."""


class VersionError(CheckpointFormatError):
    """The file was written by a newer format, or by an nvCOMP whose bitstream this one cannot read."""


class CodecUnavailableError(GdsckptError, RuntimeError):
    """A chunk needs a decoder this machine does not have (ANS on a machine with no GPU, say)."""


class StateMismatchError(GdsckptError, ValueError):
    """`load_into`: the target's keys, shapes or dtypes differ from the checkpoint's."""


class GDSUnavailableError(GdsckptError, RuntimeError):
    """GPUDirect Storage was asked for explicitly on a host that does not have it."""


class BackendUnavailableError(GdsckptError, RuntimeError):
    """The GPU backend was asked for (backend="gpu") where CUDA, nvCOMP or KvikIO is not usable."""


class SaveInFlightError(GdsckptError, RuntimeError):
    """save_async(..., wait=False) while an earlier save_async is still running."""


class DCPPlanError(GdsckptError, ValueError):
    """torch.distributed.checkpoint handed GdsckptWriter a plan or setting it cannot honour."""


class CheckpointExistsError(GdsckptError, FileExistsError):
    """A committed checkpoint is already there and overwrite was not allowed."""


class BackgroundSaveError(GdsckptError, RuntimeError):
    """An earlier save_async failed in the background and nobody looked at its future: raised by
    the next save_async (which then does not save), naming the earlier path; the cause is chained."""

    def __init__(self, message: str, *, path=None):
        super().__init__(message)
        self.path = path


class RemoteStoreError(GdsckptError, OSError):
    """The object store refused or failed a request. Names the bucket (and the key where there is
    one) and the store's error code; never a credential."""

    def __init__(self, message: str, *, bucket: str, key: str | None = None, code: str | None = None):
        where = f"bucket {bucket!r}" + (f", key {key!r}" if key is not None else "")
        super().__init__(f"{message} ({where}{f', {code}' if code else ''})")
        self.bucket, self.key, self.code = bucket, key, code


class RemoteAccessError(RemoteStoreError, PermissionError):
    """The store refused the credentials (wrong key or secret, or no permission on the bucket)."""


class BucketNotFoundError(RemoteStoreError, FileNotFoundError):
    """The bucket named in the remote URL does not exist on the store."""


class RemoteNotFoundError(RemoteStoreError, FileNotFoundError):
    """No object at that key."""


class RemoteUnavailableError(RemoteStoreError, ConnectionError):
    """The store could not be reached, or kept failing, after the client's retries."""


class CheckpointLockedError(GdsckptError, RuntimeError):
    """Another Checkpointer (this process or another) holds the checkpoint directory."""


class NoCheckpointError(GdsckptError, FileNotFoundError):
    """restore() found no committed, intact step (locally or on the remote tier)."""


class RemoteTimeoutError(RemoteUnavailableError, TimeoutError):
    """The store did not answer a request within the bound (the store's `timeout` option)."""


class UploadIncompleteError(GdsckptError, RuntimeError):
    """Checkpointer.close(): steps that were to go to the store never got there (their local
    copies are kept). `steps` lists them; close(wait_uploads=False) does not raise it."""

    def __init__(self, message: str, *, steps: list[int]):
        super().__init__(message)
        self.steps = list(steps)


class ReadOnlyCheckpointerError(GdsckptError, PermissionError):
    """A Checkpointer of a directory it cannot write (read-only): it restores, but does not save or prune."""


class MemoryTierFullError(GdsckptError, RuntimeError):
    """The memory tier has no room for a step (it is larger than the cap, or only the protected
    newest copy stands in the way): the Checkpointer saves that step to disk instead."""

    def __init__(self, message: str, *, step: int | None = None, need: int | None = None, cap: int | None = None):
        super().__init__(message)
        self.step, self.need, self.cap = step, need, cap


class MemoryTierTrustError(GdsckptError, PermissionError):
    """The memory tier's folder (or a segment in it) is not this user's own, or other users may
    write it: refused, since a restore would load what it holds. `path` names it."""

    def __init__(self, message: str, *, path=None):
        super().__init__(message)
        self.path = path


class ReplicaPlacementError(GdsckptError, ValueError):
    """A peer-replica placement that would keep a rank's replica in its own failure domain (the
    same node), or name ranks that are not there (Checkpointer(replicas=, placement=, node=))."""
