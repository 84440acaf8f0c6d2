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

# `import gdsckpt` imports neither torch nor the modules below until a name of the package is first
# used (PEP 562 __getattr__), so that the command line answers `gdsckpt --version`, --help and a
# usage error before torch loads (seconds on a busy machine).

import sys

from ._version import __version__

if "torch" in sys.modules:  # a training script (not the CLI): from now on, note each optimizer that steps, so
    from .writing.snapshot.overlap import watch_optimizers  # that a save of fresh state_dict()s may overlap
    watch_optimizers()                                      # with it (overlap.fencing_optimizer)
    del watch_optimizers

__all__ = [
    "__version__", "save", "save_async", "load", "load_into", "open", "Checkpoint", "Stats",
    "GdsckptError", "UnsupportedStateError", "CheckpointFormatError", "ChecksumError", "VersionError",
    "CodecUnavailableError", "StateMismatchError", "GDSUnavailableError", "BackendUnavailableError",
    "SaveInFlightError", "BackgroundSaveError", "DCPPlanError", "CheckpointExistsError",
    "Checkpointer", "Restored", "RemoteStoreError", "RemoteAccessError", "BucketNotFoundError",
    "RemoteNotFoundError", "RemoteUnavailableError", "CheckpointLockedError", "NoCheckpointError",
    "RemoteTimeoutError", "UploadIncompleteError", "ReadOnlyCheckpointerError", "RNG",
    "MemoryTierFullError", "MemoryTierTrustError", "ReplicaPlacementError", "reserve", "Reservation",
    "wait_for_saves_to",
]


def _import_public_names() -> dict:
    """What `import gdsckpt` imported before it was lazy: the public names (and, as a side effect,
    the submodules they come from, as attributes of the package)."""
    from .api import Checkpoint, Stats, load, load_into, open, save
    from .writing.async_save import save_async, wait_for_saves_to
    from .manager.checkpointer import Checkpointer
    from .manager.restored import Restored
    from .format.stateful import RNG
    from .errors import (
        BackendUnavailableError, BackgroundSaveError, CheckpointExistsError, CheckpointFormatError, ChecksumError,
        CodecUnavailableError, DCPPlanError, GDSUnavailableError, GdsckptError, SaveInFlightError,
        StateMismatchError, UnsupportedStateError, VersionError,
    )
    from .errors import (  # the checkpoint manager and its object-store tier
        BucketNotFoundError, CheckpointLockedError, NoCheckpointError, ReadOnlyCheckpointerError, RemoteAccessError,
        RemoteNotFoundError, RemoteStoreError, RemoteTimeoutError, RemoteUnavailableError, UploadIncompleteError,
    )
    from .errors import MemoryTierFullError, MemoryTierTrustError, ReplicaPlacementError  # the memory tier, its replicas
    from .writing.reserve import Reservation, reserve  # host memory ahead of the first save
    return locals()


def __getattr__(name: str):
    """A public name not imported yet: the public names are imported (all of them, once; with them
    the submodules they come from become attributes, as when this package imported them eagerly)."""
    if name in __all__:
        namespace = globals()
        if name not in namespace:
            namespace.update(_import_public_names())
        return namespace[name]
    # Not a submodule either, here: a submodule's `from . import x` asks for `x` first, then imports it.
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (if it is a submodule: import "
                         f"{__name__}.{name} first)")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
