"""Fitting a heads module with Lightning so that a killed run resumes where it stopped and the best val epoch's
weights are kept.

    trainer, best = fit_resumable(module, train_loader, val_loader, "results/checkpoints/hydra", fingerprint,
                                  max_epochs=3)      # the weights of the best val epoch: best.epoch, best.history
"""
from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from models.shared.training import HeadsModule, head_positions

log = logging.getLogger(__name__)


class BestEpoch(pl.Callback):
    """After each val epoch of a fit: keeps a copy of the trainable weights when `monitor` beat every earlier
    epoch; `restore(module)` puts the best ones back. Its state (best epoch, weights, history) goes into
    the checkpoints, so a resumed run still knows the best epoch before the interruption."""

    def __init__(self, monitor: str):
        self.monitor = monitor
        self.epoch, self.value, self.weights, self.history = None, None, None, []

    def on_validation_end(self, trainer, module):
        if trainer.sanity_checking or trainer.state.fn != "fit" or self.monitor not in trainer.callback_metrics:
            return
        value, epoch = float(trainer.callback_metrics[self.monitor]), trainer.current_epoch + 1   # epochs from 1
        self.history.append(round(value, 4))                  # the value of epoch len(history)
        if self.value is None or value > self.value:
            trainable = {n for n, p in module.named_parameters() if p.requires_grad}
            self.weights = {k: v.detach().cpu().clone() for k, v in module.state_dict().items() if k in trainable}
            self.epoch, self.value = epoch, value

    def restore(self, module) -> None:
        if self.weights is not None:
            missing = set(self.weights) - set(module.state_dict())
            if missing:
                raise RuntimeError(f"best-epoch weights name parameters the module lacks: {sorted(missing)[:5]}")
            module.load_state_dict(self.weights, strict=False)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "value": self.value, "weights": self.weights, "history": self.history}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.value, self.weights, self.history = (state["epoch"], state["value"], state["weights"],
                                                              state["history"])


class LoaderState(pl.Callback):
    """The training loader's place (a ResumableLoader's state_dict: seed, epoch, batches done) in the checkpoints,
    given back on resume. Lightning saves a stateful loader's state itself but never loads it when
    configure_optimizers asks for estimated_stepping_batches (ours do): that sets the loader up before the
    checkpoint is restored. Callbacks are restored before it."""

    def __init__(self, loader):
        self.loader = loader

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)


class Throughput(pl.Callback):
    """Training positions (head 0's targets) per second of training steps (forward, backward, optimizer);
    under DDP the positions of all ranks (each rank trains on its share of every batch)."""

    def __init__(self):
        self.positions, self.seconds, self._start = 0, 0.0, None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.seconds += time.perf_counter() - self._start
        self.positions += len(head_positions(batch["labels"], 0, batch.get("sources"))[0])

    def on_train_end(self, trainer, module):
        if trainer.world_size > 1:
            total = trainer.strategy.reduce(torch.tensor(float(self.positions), device=module.device), reduce_op="sum")
            self.positions = int(total.item())

    @property
    def positions_per_s(self) -> float:
        return self.positions / self.seconds if self.seconds else float("nan")


def fit_resumable(module: HeadsModule, train_loader, val_loader, ckpt_dir: str | Path, fingerprint: str,
                  max_epochs: int, trainer_kwargs: dict | None = None, logger=False, callbacks=(),
                  every_n_train_steps: int | None = None) -> tuple[pl.Trainer, BestEpoch]:
    """trainer.fit for max_epochs, resuming from ckpt_dir/last.ckpt when it exists and was written for
    `fingerprint`; then the module gets the weights of its best val epoch (by val top-1 of head 0).

    A last.ckpt of other settings (data, recipe, code) is discarded. A finished run resumed
    returns at once with the module holding the best epoch's weights.
    """
    ckpt_dir = Path(ckpt_dir)
    last = ckpt_dir / "last.ckpt"
    resume = None
    if last.is_file():
        saved = torch.load(last, map_location="cpu", weights_only=False).get("fingerprint")
        if saved == fingerprint:
            resume = str(last)
            log.info("resuming from %s", last)
        else:
            log.warning("%s was written for other settings (%s, now %s): starting over", last, saved, fingerprint)
            shutil.rmtree(ckpt_dir, ignore_errors=True)     # under DDP every rank gets here
    module.fingerprint = fingerprint
    # last.ckpt at every epoch end (so a finished run resumes to its final state) and, optionally, every
    # N optimizer steps. A mid-epoch resume restores step, optimizer and schedule, and a ResumableLoader
    # (models/shared/head_data.py) goes on at the next unseen batch of the interrupted epoch's order.
    # Both write last.ckpt (no "-v1" copies): it always holds the latest state.
    same = {"dirpath": ckpt_dir, "filename": "{epoch}-{step}", "save_top_k": 0, "save_last": True,
            "enable_version_counter": False}
    checkpoints = [ModelCheckpoint(**same)]
    if every_n_train_steps:
        checkpoints.append(ModelCheckpoint(**same, every_n_train_steps=every_n_train_steps))
    best = BestEpoch(f"{module.log_prefix}val/top1_head0")
    resumable = [LoaderState(train_loader)] if hasattr(train_loader, "load_state_dict") else []
    kwargs = {"enable_model_summary": False, "num_sanity_val_steps": 0, **(trainer_kwargs or {})}
    trainer = pl.Trainer(max_epochs=max_epochs, logger=logger, callbacks=[best, *resumable, *checkpoints, *callbacks],
                         default_root_dir=str(ckpt_dir), **kwargs)
    trainer.fit(module, train_loader, val_loader, ckpt_path=resume)
    best.restore(module)
    return trainer, best
