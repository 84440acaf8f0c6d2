"""torch.distributed.checkpoint storage plugin: each rank saves through gdsckpt, PyTorch plans.

    import gdsckpt.dcp
    fut = gdsckpt.dcp.async_save(state, "/ckpt/step100")  # writer, CachedSavePlanner, dcp_view, overlap: set up

    import torch.distributed.checkpoint as dcp
    from gdsckpt.dcp import CachedSavePlanner, GdsckptReader, GdsckptWriter, reserve

    dcp.save(state_dict, storage_writer=GdsckptWriter("/ckpt/step100"))
    dcp.load(state_dict, storage_reader=GdsckptReader("/ckpt/step100"))
    reserve(state_dict)  # before the loop: the async staging's host pool, made ahead of its first save
    fut = dcp.async_save(state_dict, storage_writer=GdsckptWriter("/ckpt/step200"),
                         planner=CachedSavePlanner())  # every save after the first skips DCP's plan exchange

The parts, one job each:

| module | its job |
| --- | --- |
| `writer.py` | `GdsckptWriter`: a rank file per rank through save.save_flat; `.metadata` as the commit point |
| `staging.py` | what dcp.async_save's staging makes of the state dict, per snapshot mode; `reserve`, its pool ahead of need |
| `standins.py` | the staging's stand-in tensors, kept per process and reused while a key keeps its layout |
| `results.py` | write results after a staging, prepared once per layout; their compact pickling to the coordinator |
| `reader.py` | `GdsckptReader`: only the chunks each rank needs, decoded into its shards |
| `metadata.py` | `.metadata` written with a checksum (pickled once per layout), read with an allowlist unpickler |
| `recipe.py` | `gdsckpt.dcp.save` / `async_save`: the writer, the planner, the DCP view and the overlap in one call |
| `planner.py` | `CachedSavePlanner`: DCP's plan cache, reused only while nothing changed (no plan built for stand-ins) |
| `layout.py` | the directory's file names and each write item's key |
"""

from .layout import DCP_VERSION, METADATA_FILE, SUFFIX, item_key
from .planner import CachedSavePlanner, RankStateLoadPlanner
from .reader import GdsckptReader
from .recipe import async_save, load, save
from .staging import reserve
from .writer import GdsckptWriter
# the process group gdsckpt runs DCP's collectives in off the training's thread (async_save's default)
from gdsckpt.core.process_groups import shared_group
# the state as DCP takes it, and its plain values written back after a load
from gdsckpt.format.stateful import dcp_view, dcp_write_back

__all__ = ["GdsckptWriter", "GdsckptReader", "CachedSavePlanner", "RankStateLoadPlanner", "reserve", "save",
           "async_save", "shared_group", "DCP_VERSION", "METADATA_FILE", "SUFFIX", "item_key"]
