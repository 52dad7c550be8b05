"""What Medusa-2's joint stage is measured by: head 0 against the joint training positions seen (JointCurve, a
Lightning callback), and how far the adapted backbone moved (its val answers' perplexity, adapters on and off).
"""
from __future__ import annotations

import math

import pytorch_lightning as pl
import torch

from models.shared.training import IGNORE_INDEX, head_positions


class JointCurve(pl.Callback):
    """Head-0 val top-1 at each validation of the joint stage against the training positions seen so far (head 0's
    targets): how much joint data the heads and the backbone need before the joint stage helps."""

    def __init__(self, monitor: str = "val/top1_head0"):
        self.monitor, self.positions, self.points = monitor, 0, []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.positions += len(head_positions(batch["labels"], 0, batch.get("sources"))[0])

    def on_validation_end(self, trainer, module):
        if not trainer.sanity_checking and trainer.state.fn == "fit" and self.monitor in trainer.callback_metrics:
            self.points.append({"positions": self.positions, "step": trainer.global_step,
                                "val_top1_head0": round(float(trainer.callback_metrics[self.monitor]), 4)})

    def state_dict(self) -> dict:
        return {"positions": self.positions, "points": self.points}

    def load_state_dict(self, state: dict) -> None:
        self.positions, self.points = state["positions"], state["points"]


@torch.no_grad()
def answer_perplexity(model, ids_list, labels_list, device: str) -> float:
    """exp(mean NLL) of the answer tokens (labels != -100) under `model`, one conversation at a time."""
    nll, n = 0.0, 0
    for ids, labels in zip(ids_list, labels_list):
        x = torch.tensor([ids], device=device)
        y = torch.tensor([labels[1:]], device=device)
        logits = model(input_ids=x).logits[0, :-1].float()
        keep = y[0] != IGNORE_INDEX
        if keep.any():
            nll += float(torch.nn.functional.cross_entropy(logits[keep], y[0][keep], reduction="sum"))
            n += int(keep.sum())
    return math.exp(nll / n) if n else float("nan")


def backbone_drift(module, data: dict, device: str) -> dict:
    """How far a jointly trained backbone moved: the val answers' perplexity with its adapters on and off."""
    backbone = module.backbone.to(device)       # Lightning's teardown leaves a GPU-trained module on the CPU
    backbone.eval()
    ids, labels = data["val"]
    adapted = answer_perplexity(backbone, ids, labels, device)
    with backbone.disable_adapter():
        base = answer_perplexity(backbone, ids, labels, device)
    return {"val_answer_perplexity_base": round(base, 4), "val_answer_perplexity_adapted": round(adapted, 4)}
