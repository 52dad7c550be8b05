"""python -m pipelines.bench.joint [+joint.limit=192] [+joint.every=20] [+joint.mode=recipe|heads_only|lora_only]
                                 [+joint.batches=conversations|positions]

A benchmark, not a stage: what Medusa-2's joint stage does to head 0, against the joint positions it has seen,
starting from the heads-only stage of the last `dvc repro train@medusa2` (results/checkpoints/medusa2/stage1/
last.ckpt: the heads that stage 1 ended with). Head-0 val top-1 is measured before the first step and every
`every` steps of one epoch over the first `limit` training conversations (null: all), with the recipe's learning
rates and schedule (heads config medusa2 and the profile's overrides):

  mode=recipe      the joint stage as `train` runs it: LoRA adapters on every linear layer and the heads together
  mode=heads_only  the heads alone on the frozen base (its cached hidden states), at the joint stage's heads lr
  mode=lora_only   the joint stage with the heads' learning rate at 0: only the backbone's adapters move
  batches          conversations: whole conversations, as the joint stage reads them; positions: random
                   positions over the same conversations, as the heads-only stage reads them (heads_only only)

Prints one line per validation and writes reports/bench/joint_<mode>_<limit>.json.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from omegaconf import DictConfig, OmegaConf

from models.methods.medusa.joint_stage import JointCurve
from models.shared.schedules import plan_stages
from models.methods import recipe_kind
from pipelines import train_inputs as T
from pipelines.recipes import trainable_recipe, with_profile_heads
from pipelines.common import load_model, log, stage, write_json

DEFAULTS = {"limit": 192, "every": 20, "mode": "recipe", "batches": "conversations"}
MODES = ("recipe", "heads_only", "lora_only")


class PrintedCurve(JointCurve):
    """JointCurve that logs each point as it comes (a long run stopped early keeps what it measured)."""

    def on_validation_end(self, trainer, module):
        super().on_validation_end(trainer, module)
        if self.points and self.points[-1]["step"] == trainer.global_step:
            log.info("step %d, %d joint positions: head-0 val top-1 %.4f", trainer.global_step,
                     self.points[-1]["positions"], self.points[-1]["val_top1_head0"])


def settings_of(cfg: DictConfig) -> dict:
    s = {**DEFAULTS, **OmegaConf.to_container(OmegaConf.select(cfg, "joint", default=OmegaConf.create({})))}
    if s["mode"] not in MODES or s["batches"] not in ("conversations", "positions"):
        raise ValueError(f"joint.mode={s['mode']!r}, joint.batches={s['batches']!r}: modes {MODES}, batches "
                         "conversations | positions")
    return s


def stage1_heads(cfg: DictConfig, model, data: dict):
    """The heads as stage 1 left them (its last.ckpt), on the run's draft vocabulary."""
    ckpt = Path(cfg.paths.results) / "checkpoints" / str(cfg.heads.name) / "stage1" / "last.ckpt"
    if not ckpt.is_file():
        raise FileNotFoundError(f"{ckpt} does not exist: run `dvc repro train@{cfg.heads.name}` first")
    draft_ids, _ = T.draft_vocabulary(cfg, data, model.config.vocab_size)
    heads = T.trainable_heads(cfg, model, draft_ids)
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    heads.load_state_dict({k[len("heads."):]: v for k, v in state.items() if k.startswith("heads.")}, strict=False)
    return heads


@stage
def main(cfg: DictConfig) -> None:
    s = settings_of(cfg)
    cfg = with_profile_heads(cfg)
    recipe = trainable_recipe(cfg)
    joint = recipe_kind(recipe.kind).module
    if not joint.joint_backbone:
        raise ValueError(f"heads={cfg.heads.name}: this benchmark measures a joint stage (a recipe that trains the "
                         "backbone with the heads); use heads=medusa2")
    heads_only_kind = joint.heads_only_kind
    if s["mode"] == "lora_only":
        recipe = dataclasses.replace(recipe, head_lr_multiplier=0.0)
    pl.seed_everything(int(cfg.seed))
    model, tok = load_model(cfg)
    model.requires_grad_(False)
    data = T.load_examples(cfg)
    heads = stage1_heads(cfg, model, data)
    hidden, _ = T.hidden_caches(cfg, model, data)
    loader = T.make_loader(cfg, data, hidden, tok.pad_token_id or 0)
    lora = OmegaConf.to_container(cfg.heads.recipe.lora, resolve=True)
    plan = plan_stages(joint, recipe, 2, 0.5, lora, s["limit"], s["every"])[-1]           # the joint stage's plan
    if s["mode"] == "heads_only":
        module = joint.heads_only_module(heads, model, dataclasses.replace(
            recipe, kind=heads_only_kind, lr=recipe.lr * recipe.head_lr_multiplier))
    else:
        module = plan.module(heads, model)
    kind = heads_only_kind if s["batches"] == "positions" else plan.loader_kind
    train = loader("train", kind, limit=s["limit"])
    curve = PrintedCurve()
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=bool(cfg.profile.train.get("progress_bar", True)),
                         val_check_interval=min(int(s["every"]), len(train)), num_sanity_val_steps=0,
                         gradient_clip_val=cfg.profile.train.get("gradient_clip_val"),
                         default_root_dir=str(Path(cfg.paths.results) / "bench" / "joint_logs"), callbacks=[curve])
    start = trainer.validate(module, loader("val"), verbose=False)[0]["val/top1_head0"]
    t0 = time.time()
    trainer.fit(module, train, loader("val"))
    record = {"settings": s, "recipe": dataclasses.asdict(recipe), "steps": trainer.global_step,
              "start_val_top1_head0": round(float(start), 4), "curve": curve.points, "fit_s": round(time.time() - t0)}
    path = write_json(Path(cfg.paths.reports) / "bench" / f"joint_{s['mode']}_{s['limit']}.json", record)
    print(f"head-0 val top-1 from {record['start_val_top1_head0']}: "
          + ", ".join(f"{p['val_top1_head0']} at {p['positions']} positions" for p in curve.points) + f"\nwrote {path}")


if __name__ == "__main__":
    main()
