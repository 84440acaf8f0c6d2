"""gdsckpt: checkpoint PyTorch training state through GPU compression and GPUDirect Storage.

    gdsckpt.save(state, "ckpt.gdsckpt")             # durable on return
    fut = gdsckpt.save_async(state, "ckpt.gdsckpt") # state safe to mutate on return; fut.result(): durable
    gdsckpt.reserve(state)                          # before the loop: the first save_async allocates nothing
    state = gdsckpt.load("ckpt.gdsckpt")            # tensors back where they were saved from
    gdsckpt.load_into("ckpt.gdsckpt", state)       # in place; objects through load_state_dict()
    with gdsckpt.open("ckpt.gdsckpt") as ck: ck.get_tensor("model/wte.weight")
"""

# `import gdsckpt` imports neither torch nor the modules below: each public name is imported from
# its module on first use (PEP 562), so that the command line answers `gdsckpt --version`, --help
# and a usage error before torch loads (seconds on a busy machine).

import importlib
import sys
import types

from ._version import __version__

# module -> the public names it defines
_EXPORTS = {
    "api": ("Checkpoint", "Stats", "load", "load_into", "open", "save"),
    "async_save": ("save_async",),
    "manager": ("Checkpointer", "Restored"),
    "stateful": ("RNG",),
    "errors": (
        "BackendUnavailableError", "BackgroundSaveError", "CheckpointExistsError", "CheckpointFormatError",
        "ChecksumError", "CodecUnavailableError", "DCPPlanError", "GDSUnavailableError", "GdsckptError",
        "SaveInFlightError", "StateMismatchError", "UnsupportedStateError", "VersionError",
        # the checkpoint manager and its object-store tier
        "BucketNotFoundError", "CheckpointLockedError", "NoCheckpointError", "ReadOnlyCheckpointerError",
        "RemoteAccessError", "RemoteNotFoundError", "RemoteStoreError", "RemoteTimeoutError",
        "RemoteUnavailableError", "UploadIncompleteError",
        "MemoryTierFullError",  # the checkpoint manager's memory tier
    ),
    "reserve": ("Reservation", "reserve"),  # host memory ahead of the first save
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = ["__version__", *_MODULE_OF]


def __getattr__(name: str):
    """A public name, imported from its module on first use; or a submodule not imported yet
    (`gdsckpt.stats` after a bare `import gdsckpt`, as when this package imported them all)."""
    module = _MODULE_OF.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
        globals()[name] = value  # the next use is a plain attribute
        return value
    if not name.startswith("_"):
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":  # the module exists; something it imports does not
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """This package, as a module that keeps a public name over the submodule of the same name:
    importing gdsckpt.save or gdsckpt.reserve (as gdsckpt itself does) binds the module here, where
    `gdsckpt.save` and `gdsckpt.reserve` are the functions (the module: sys.modules)."""

    def __setattr__(self, name: str, value) -> None:
        if name in _MODULE_OF and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
