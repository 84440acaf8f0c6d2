"""gdsckpt: checkpoint PyTorch training state through GPU compression and GPUDirect Storage.

    gdsckpt.save(state, "ckpt.gdsckpt")             # durable on return
    fut = gdsckpt.save_async(state, "ckpt.gdsckpt") # state safe to mutate on return; fut.result(): durable
    state = gdsckpt.load("ckpt.gdsckpt")            # tensors back where they were saved from
    gdsckpt.load_into("ckpt.gdsckpt", model.state_dict())  # in place, no second copy
    with gdsckpt.open("ckpt.gdsckpt") as ck: ck.get_tensor("model/wte.weight")
"""

__version__ = "0.1.0"

from .api import Checkpoint, Stats, load, load_into, open, save  # noqa: E402
from .async_save import save_async  # noqa: E402
from .errors import (  # noqa: E402
    CheckpointFormatError, ChecksumError, CodecUnavailableError, GDSUnavailableError, GdsckptError,
    StateMismatchError, UnsupportedStateError, VersionError,
)

__all__ = [
    "save", "save_async", "load", "load_into", "open", "Checkpoint", "Stats",
    "GdsckptError", "UnsupportedStateError", "CheckpointFormatError", "ChecksumError", "VersionError",
    "CodecUnavailableError", "StateMismatchError", "GDSUnavailableError",
]
