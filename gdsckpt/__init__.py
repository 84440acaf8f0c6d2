"""gdsckpt: checkpoint PyTorch training state through GPU compression and GPUDirect Storage.

    gdsckpt.save(state, "ckpt.gdsckpt")             # durable on return
    fut = gdsckpt.save_async(state, "ckpt.gdsckpt") # state safe to mutate on return; fut.result(): durable
    gdsckpt.reserve(state)                          # before the loop: the first save_async allocates nothing
    state = gdsckpt.load("ckpt.gdsckpt")            # tensors back where they were saved from
    gdsckpt.load_into("ckpt.gdsckpt", state)       # in place; objects through load_state_dict()
    with gdsckpt.open("ckpt.gdsckpt") as ck: ck.get_tensor("model/wte.weight")
    gdsckpt.wait_for_saves_to("ckpt.gdsckpt")      # every save_async in flight to it, done

Options, the Checkpointer's grouped options and its retention policies: gdsckpt.options.
"""

from ._version import __version__
from .api import Checkpoint, Stats, load, load_into, open, save
from .writing.async_save import save_async, wait_for_saves_to
from .manager.checkpointer import Checkpointer, Restored
from .format.stateful import RNG
from .errors import (
    BackendUnavailableError, BackgroundSaveError, CheckpointExistsError, CheckpointFormatError, ChecksumError,
    CodecUnavailableError, DCPPlanError, GDSUnavailableError, GdsckptError, SaveInFlightError, StateMismatchError,
    UnsupportedStateError, VersionError,
)
from .errors import (  # the checkpoint manager and its object-store tier
    BucketNotFoundError, CheckpointLockedError, NoCheckpointError, ReadOnlyCheckpointerError, RemoteAccessError,
    RemoteNotFoundError, RemoteStoreError, RemoteTimeoutError, RemoteUnavailableError, UploadIncompleteError,
)
from .errors import MemoryTierFullError, MemoryTierTrustError  # the checkpoint manager's memory tier
from .writing.reserve import Reservation, reserve  # host memory ahead of the first save

__all__ = [
    "__version__", "save", "save_async", "load", "load_into", "open", "Checkpoint", "Stats",
    "GdsckptError", "UnsupportedStateError", "CheckpointFormatError", "ChecksumError", "VersionError",
    "CodecUnavailableError", "StateMismatchError", "GDSUnavailableError", "BackendUnavailableError",
    "SaveInFlightError", "BackgroundSaveError", "DCPPlanError", "CheckpointExistsError",
    "Checkpointer", "Restored", "RemoteStoreError", "RemoteAccessError", "BucketNotFoundError",
    "RemoteNotFoundError", "RemoteUnavailableError", "CheckpointLockedError", "NoCheckpointError",
    "RemoteTimeoutError", "UploadIncompleteError", "ReadOnlyCheckpointerError", "RNG",
    "MemoryTierFullError", "MemoryTierTrustError", "reserve", "Reservation", "wait_for_saves_to",
]
