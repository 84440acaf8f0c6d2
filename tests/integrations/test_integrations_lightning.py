"""gdsckpt.integrations.lightning with the real Lightning on the CPU (gdsckpt[lightning]).

One child process trains a small LightningModule for 3 epochs without checkpoints (the
reference), then, for each way of plugging gdsckpt in, trains it with ModelCheckpoint
(every 3 steps, top 2 by loss, and last.ckpt) until a callback stops the run at step 10. A
second child process resumes each run from its last.ckpt (`trainer.fit(..., ckpt_path="last")`)
and trains to the end: its final weights and Adam moments must equal the reference's bit for
bit. The data come from torchdata's StatefulDataLoader, whose position Lightning keeps in the
checkpoint (the run stops mid-epoch), so the resumed run sees exactly the batches the reference saw.

Ways: GdsckptCheckpointIO(); Lightning's AsyncCheckpointIO around it; GdsckptCheckpointIO(
async_save=True) (gdsckpt.save_async); and pytorch_lightning (the standalone package) where
it is installed. Run as a script, this file is the child."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from integration_tools import digests, gdsckpt_files_only, report, run_child  # noqa: E402

STOP_AT = 10  # the interrupted runs stop after this many optimizer steps; last.ckpt is step 9's
EPOCHS = 3
VARIANTS = ("sync", "lightning_async", "gdsckpt_async", "pytorch_lightning")


# ---------------------------------------------------------------- the child


def _framework(variant: str):
    if variant == "pytorch_lightning":
        import pytorch_lightning as pl
        from pytorch_lightning.plugins.io import AsyncCheckpointIO
        return pl, AsyncCheckpointIO
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    return pl, AsyncCheckpointIO


def _module(pl, **hparams):
    import torch

    class Regressor(pl.LightningModule):
        def __init__(self, hidden: int = 16, lr: float = 0.01, **extra):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]

    torch.manual_seed(0)
    return Regressor(**hparams)


def _data():
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    # Not shuffled: Lightning 2.6 itself does not resume a shuffled StatefulDataLoader mid-epoch
    # bit-exactly (its default TorchCheckpointIO gives the same weights as gdsckpt there, and
    # both differ from the uninterrupted run's); in order, it does, and the position still matters.
    return StatefulDataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def _trainer(pl, variant: str | None, ckpt_dir: Path | None, *, callbacks=(), accelerator="cpu"):
    from gdsckpt.integrations.lightning import GdsckptCheckpointIO
    plugins = []
    if variant is not None:
        _, async_io = _framework(variant)
        io = {"sync": lambda: GdsckptCheckpointIO(),
              "lightning_async": lambda: async_io(GdsckptCheckpointIO()),
              "gdsckpt_async": lambda: GdsckptCheckpointIO(async_save=True),
              "pytorch_lightning": lambda: GdsckptCheckpointIO()}[variant]()
        plugins = [io]
        callbacks = [pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=2,
                                                  monitor="train_loss", save_last=True), *callbacks]
    return pl.Trainer(max_epochs=EPOCHS, plugins=plugins, callbacks=list(callbacks),
                      enable_checkpointing=variant is not None, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, accelerator=accelerator, devices=1, deterministic=True)


def _final(model, trainer) -> dict:
    return {"model": digests(model.state_dict()), "optimizer": digests(trainer.optimizers[0].state_dict()["state"]),
            "global_step": trainer.global_step}


class _Stop(Exception):
    pass


def child_first(root: Path, variants: list[str], accelerator: str) -> dict:
    pl, _ = _framework("sync")
    model = _module(pl)
    trainer = _trainer(pl, None, None, accelerator=accelerator)
    trainer.fit(model, _data())
    out = {"reference": _final(model, trainer), "interrupted": {}}

    for variant in variants:
        vpl, _ = _framework(variant)

        class StopAt(vpl.Callback):
            def on_train_batch_end(self, trainer, *args):
                if trainer.global_step == STOP_AT:
                    raise _Stop

        model = _module(vpl)
        trainer = _trainer(vpl, variant, root / variant, callbacks=[StopAt()], accelerator=accelerator)
        try:
            trainer.fit(model, _data())
        except _Stop:
            pass
        out["interrupted"][variant] = trainer.global_step
    if accelerator == "cpu":
        out["refusal"] = _refusal(pl, root / "refused")
    return out


def _refusal(pl, where: Path) -> dict:
    """A hyper-parameter gdsckpt cannot store (a class): the save names it, and writes nothing."""
    import torch
    from gdsckpt.integrations.lightning import GdsckptCheckpointIO
    model = _module(pl, activation=torch.nn.ReLU)
    trainer = pl.Trainer(max_steps=1, plugins=[GdsckptCheckpointIO()], enable_checkpointing=False, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(model, _data())
    try:
        trainer.save_checkpoint(where / "x.ckpt")
    except Exception as e:  # noqa: BLE001 - the parent checks the type
        return {"type": type(e).__name__, "message": str(e), "notes": getattr(e, "__notes__", []),
                "files": sorted(p.name for p in where.iterdir()) if where.exists() else []}
    return {"type": None}


def child_resume(root: Path, variants: list[str], accelerator: str) -> dict:
    from gdsckpt.integrations.lightning import GdsckptCheckpointIO
    out = {}
    for variant in variants:
        pl, _ = _framework(variant)
        model = _module(pl, hidden=16)
        trainer = _trainer(pl, variant, root / variant, accelerator=accelerator)
        trainer.fit(model, _data(), ckpt_path="last")
        result = _final(model, trainer)
        weights = root / variant / "weights-only.ckpt"
        trainer.save_checkpoint(weights, weights_only=True)
        trainer.strategy.checkpoint_io.teardown()
        loaded = GdsckptCheckpointIO().load_checkpoint(weights, weights_only=True)
        result["weights_only_keys"] = sorted(loaded)
        result["weights_only_model"] = digests(loaded["state_dict"])
        result["files"] = sorted(p.name for p in (root / variant).iterdir())
        trainer.strategy.remove_checkpoint(weights)
        result["removed"] = not weights.exists()
        out[variant] = result
    return out


# ---------------------------------------------------------------- the tests


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None  # without importing it here: the children do


def _needs(*names: str) -> None:
    missing = [n for n in names if not _installed(n)]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}")


def _variants() -> list[str]:
    return [v for v in VARIANTS if _installed("pytorch_lightning" if v == "pytorch_lightning" else "lightning")]


def test_fit_interrupt_resume_in_a_new_process_is_bit_identical(tmp_path):
    _needs("lightning", "torchdata")
    variants = _variants()
    first = run_child(Path(__file__), "first", str(tmp_path), ",".join(variants), "cpu")
    ref = first["reference"]
    assert ref["global_step"] == EPOCHS * 8
    assert first["interrupted"] == {v: STOP_AT for v in variants}

    resumed = run_child(Path(__file__), "resume", str(tmp_path), ",".join(variants), "cpu")
    for v in variants:
        got = resumed[v]
        assert got["global_step"] == ref["global_step"], v
        assert got["model"] == ref["model"], f"{v}: final weights differ from the uninterrupted run's"
        assert got["optimizer"] == ref["optimizer"], f"{v}: final Adam state differs from the uninterrupted run's"
        # trainer.save_checkpoint(weights_only=True): the module's weights and the loops, no optimizer
        assert "optimizer_states" not in got["weights_only_keys"] and "state_dict" in got["weights_only_keys"], v
        assert got["weights_only_model"] == ref["model"], v
        assert got["removed"], v
        # ModelCheckpoint kept its top 2 (remove_checkpoint took the others) and last.ckpt. Under
        # Lightning's AsyncCheckpointIO a removal is not queued behind the saves its thread has
        # yet to run (it calls the wrapped remove_checkpoint at once): on a loaded host a top-k
        # file removed before its queued save ran comes back. Lightning's race, with its own
        # TorchCheckpointIO too; the resume above is exact either way.
        ckpts = [f for f in got["files"] if f.startswith("epoch=")]
        assert "last.ckpt" in got["files"], (v, got["files"])
        assert len(ckpts) == 2 or (v == "lightning_async" and len(ckpts) >= 2), (v, got["files"])
        assert gdsckpt_files_only(tmp_path / v) == [], v  # no pickle, no torch.save file

    refusal = first["refusal"]
    assert refusal["type"] == "UnsupportedStateError", refusal
    assert "hyper_parameters/activation" in refusal["message"], refusal
    assert any("on_save_checkpoint" in n for n in refusal["notes"]), refusal
    assert refusal["files"] == []  # nothing written, not even a temporary


def test_io_without_a_trainer(tmp_path):
    """The CheckpointIO's own contract: the folder is created, a missing file is Lightning's
    FileNotFoundError, map_location takes devices only, storage_options takes save options."""
    pytest.importorskip("lightning")
    import torch
    from gdsckpt.integrations.lightning import GdsckptCheckpointIO
    from lightning.fabric.plugins import CheckpointIO
    io = GdsckptCheckpointIO(codec="zstd")
    assert isinstance(io, CheckpointIO)
    ck = {"state_dict": {"w": torch.arange(6.0).reshape(2, 3)}, "epoch": 2, "hyper_parameters": {"lr": 0.1},
          "loops": {"fit_loop": {"inf": float("inf"), "t": (1, "a", None)}}, "blob": b"\x00\x01"}
    path = tmp_path / "new" / "deeper" / "a.ckpt"
    io.save_checkpoint(ck, path, storage_options={"codec": "raw"})
    back = io.load_checkpoint(path, map_location="cpu", weights_only=True)
    assert torch.equal(back["state_dict"]["w"], ck["state_dict"]["w"])
    assert back["loops"] == ck["loops"] and back["blob"] == ck["blob"] and back["epoch"] == 2
    with pytest.raises(TypeError, match="map_location must be None or a device"):
        io.load_checkpoint(path, map_location=lambda storage, loc: storage)
    with pytest.raises(TypeError, match="storage_options must be a dict"):
        io.save_checkpoint(ck, path, storage_options="zstd")
    # its options checked when it is made, not at the first checkpoint an epoch into the run
    with pytest.raises(ValueError, match="unknown codec 'lz4'"):
        GdsckptCheckpointIO(codec="lz4")
    with pytest.raises(ValueError, match="'snapshot' is not a save option here"):
        GdsckptCheckpointIO(snapshot="device")  # gdsckpt.save's: async_save=True takes save_async's
    with pytest.raises(ValueError, match="snapshot must be one of 'host', 'device', not 'overlap'"):
        GdsckptCheckpointIO(async_save=True, snapshot="overlap")  # needs an optimizer= Lightning does not give
    GdsckptCheckpointIO(async_save=True, snapshot="device", pool_bytes=2**30)
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    with pytest.raises(ValueError, match="local files only"):
        io.save_checkpoint(ck, "s3://bucket/a.ckpt")
    with pytest.raises(IsADirectoryError):
        io.remove_checkpoint(tmp_path / "new")
    io.remove_checkpoint(path)
    io.remove_checkpoint(path)  # missing: fine, as TorchCheckpointIO
    assert not path.exists() and (tmp_path / "new" / "deeper").is_dir()


def test_async_save_waits_before_load_and_remove(tmp_path):
    pytest.importorskip("lightning")
    import torch
    from gdsckpt.integrations.lightning import GdsckptCheckpointIO
    io = GdsckptCheckpointIO(async_save=True)
    w = torch.randn(256, 256)
    saved = w.clone()
    io.save_checkpoint({"state_dict": {"w": w}}, tmp_path / "a.ckpt")
    w.add_(1.0)  # the state may change once save_checkpoint returned
    assert torch.equal(io.load_checkpoint(tmp_path / "a.ckpt")["state_dict"]["w"], saved)
    io.save_checkpoint({"state_dict": {"w": w}}, tmp_path / "b.ckpt")
    io.remove_checkpoint(tmp_path / "b.ckpt")
    io.teardown()
    assert not (tmp_path / "b.ckpt").exists() and (tmp_path / "a.ckpt").exists()


def test_a_load_by_another_instance_waits_for_the_save_in_flight(tmp_path, monkeypatch):
    """The documented recipe `GdsckptCheckpointIO().load_checkpoint(path)` (or a new Trainer's
    plugin) reads the checkpoint being saved to `path`, not the one it replaces."""
    pytest.importorskip("lightning")
    import time
    import torch
    from gdsckpt.core import storage
    from gdsckpt.integrations.lightning import GdsckptCheckpointIO
    path = tmp_path / "last.ckpt"
    io = GdsckptCheckpointIO(async_save=True)
    io.save_checkpoint({"state_dict": {"w": torch.zeros(4)}, "global_step": 1}, path)
    io.teardown()
    commit = storage.AtomicFile.commit

    def slow(self):  # a slow disk under a large state
        time.sleep(1.0)
        return commit(self)
    monkeypatch.setattr(storage.AtomicFile, "commit", slow)
    io.save_checkpoint({"state_dict": {"w": torch.ones(4)}, "global_step": 2}, path)
    loaded = GdsckptCheckpointIO().load_checkpoint(path)
    io.teardown()
    assert loaded["global_step"] == 2 and torch.equal(loaded["state_dict"]["w"], torch.ones(4))


def test_the_previous_checkpoint_goes_only_once_the_next_is_durable(tmp_path, monkeypatch):
    """ModelCheckpoint saves step 4's checkpoint, then removes step 2's: with async_save, step 2's
    file goes only once step 4's is committed (a kill in between left no checkpoint at all, or a
    last.ckpt link to nothing, and the run started over), and stays if step 4's save fails."""
    pytest.importorskip("lightning")
    import threading
    import torch
    from gdsckpt.core import storage
    from gdsckpt.integrations.lightning import GdsckptCheckpointIO
    io = GdsckptCheckpointIO(async_save=True)
    old, new, worse = tmp_path / "step=2.ckpt", tmp_path / "step=4.ckpt", tmp_path / "step=6.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.zeros(4)}, "global_step": 2}, old)
    io.teardown()
    gate = threading.Event()
    commit = storage.AtomicFile.commit

    def held(self):  # the write window a kill can fall into
        assert gate.wait(30)
        if self.path == worse:
            raise OSError(28, "No space left on device (test)")
        return commit(self)
    monkeypatch.setattr(storage.AtomicFile, "commit", held)
    io.save_checkpoint({"state_dict": {"w": torch.ones(4)}, "global_step": 4}, new)
    io.remove_checkpoint(old)
    assert old.exists() and not new.exists()  # the only committed checkpoint is still there
    gate.set()
    io.teardown()
    assert not old.exists() and io.load_checkpoint(new)["global_step"] == 4
    gate.clear()
    io.save_checkpoint({"state_dict": {"w": torch.ones(4)}, "global_step": 6}, worse)
    io.remove_checkpoint(new)
    gate.set()
    with pytest.raises(OSError, match="No space left"):
        io.teardown()
    assert new.exists() and not worse.exists()  # the failed save's predecessor stays


def test_teardown_returns_after_the_removal_waiting_for_a_save(tmp_path, monkeypatch):
    """teardown() waits for the removal that waits for a save, not only for the save: a future's
    waiters wake before its callbacks run, and the previous checkpoint was once still there after
    teardown() returned (seen under load)."""
    pytest.importorskip("lightning")
    import time
    import torch
    from gdsckpt.integrations import lightning as gl
    remove_after = gl._remove_after

    def slow(fut, path):  # the window the waiters' wake-up falls into, widened
        time.sleep(0.5)
        remove_after(fut, path)
    monkeypatch.setattr(gl, "_remove_after", slow)
    io = gl.GdsckptCheckpointIO(async_save=True)
    old, new = tmp_path / "step=2.ckpt", tmp_path / "step=4.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.zeros(4)}, "global_step": 2}, old)
    io.teardown()
    io.save_checkpoint({"state_dict": {"w": torch.ones(4)}, "global_step": 4}, new)
    io.remove_checkpoint(old)
    io.teardown()
    assert not old.exists() and new.exists()


def test_fabric_save_and_load(tmp_path):
    """Fabric's save / load go through the same CheckpointIO: a module, an optimizer and a plain value."""
    _needs("lightning")
    import torch
    from gdsckpt.integrations.lightning import GdsckptCheckpointIO
    from lightning.fabric import Fabric
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[GdsckptCheckpointIO()])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    fabric.backward(model(torch.randn(3, 4)).sum())
    opt.step()
    fabric.save(tmp_path / "f" / "state.ckpt", {"model": model, "optimizer": opt, "step": 3})
    want = {k: v.clone() for k, v in model.state_dict().items()}
    moments = opt.state_dict()["state"][0]["exp_avg"].clone()
    torch.manual_seed(1)
    model2 = torch.nn.Linear(4, 2)
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.1)
    model2, opt2 = fabric.setup(model2, opt2)
    state = {"model": model2, "optimizer": opt2, "step": 0}
    fabric.load(tmp_path / "f" / "state.ckpt", state)
    assert state["step"] == 3
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in want.items())
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], moments)
    assert gdsckpt_files_only(tmp_path / "f") == []


@pytest.mark.gpu
def test_gpu_fit_resume_with_gdsckpt_save_async(tmp_path):
    """On the GPU, GdsckptCheckpointIO(async_save=True): the snapshot is compressed on the GPU into
    pinned host memory; the resumed run's final weights equal the uninterrupted run's."""
    _needs("lightning", "torchdata")
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # deterministic=True: cuBLAS's deterministic mode
    first = run_child(Path(__file__), "first", str(tmp_path), "gdsckpt_async,sync", "gpu", env=env)
    resumed = run_child(Path(__file__), "resume", str(tmp_path), "gdsckpt_async,sync", "gpu", env=env)
    for v in ("gdsckpt_async", "sync"):
        assert resumed[v]["model"] == first["reference"]["model"], v
        assert resumed[v]["optimizer"] == first["reference"]["optimizer"], v


if __name__ == "__main__":
    mode, root, names, accel = sys.argv[1], Path(sys.argv[2]), sys.argv[3].split(","), sys.argv[4]
    report((child_first if mode == "first" else child_resume)(root, names, accel))
