"""python -m pipelines.train heads=<a conf/heads option: medusa1, hydra_pp, eagle3, sps, ...> [profile=smoke] [trainer=gpu] [profile.train.data=prepared]

DVC runs it on the composed params.yaml, where a group override no longer exists, so the family is
swapped in with `+select.heads=<name>` (pipelines/common.py loads conf/heads/<name>.yaml and resolves
it against the rest of the config):
    python -m pipelines.train --config-dir . --config-name params +select.heads=hydra

  1) data: the distilled conversations (profile.train.data=distilled, default) or the prepared ones,
     cut to profile.train.max_length; only assistant tokens are targets
  2) draft vocabulary: the profile.train.draft_vocab_size most frequent answer tokens of the train
     split (models/shared/draft_vocab.py; null = the full vocabulary), its coverage of the val answer tokens
  3) frozen-backbone families: the base hidden states of all examples, computed once into
     results/cache/hidden/<model>/<key>/ (key = model + data + lengths + the union of the taps of
     pipeline_heads' families) and reused by every family, each loading its own taps, and every epoch
     (profile.train.hidden_cache)
  4) fit the family's LightningModule (models/shared/training.py) for up to the effective epochs on batches
     of about profile.train.batch_positions target positions (models/shared/head_data.py: random positions
     for Medusa/Hydra on the cache, length-bucketed conversations otherwise), resuming from
     results/checkpoints/<heads>/last.ckpt when it was written for the same settings, and keep the
     weights of the val epoch with the best head-0 top-1;
     Medusa-2 = stage 1 heads only (on the cache) + stage 2 LoRA backbone and heads together
     (on the first joint_max_train_samples conversations); a run killed mid-epoch goes on at the next unseen
     batch. trainer=ddp (CPU: trainer.accelerator=cpu trainer.devices=N, gloo): each process trains on its
     share of every batch
  5) heads folder results/heads/<heads> (draft_ids inside, + adapter/ for Medusa-2); per-head val
     top-1/top-5, the best epoch, positions/s and the draft vocabulary's coverage in
     reports/metrics/train_<heads>.json; everything logged to MLflow through Lightning's MLFlowLogger
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import time

from pathlib import Path

import pytorch_lightning as pl
import torch
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import LearningRateMonitor

from models.methods import recipe_kind
from models.shared.head_data import target_positions, unigram_baseline
from models.shared.hidden_cache import sequences_fingerprint
from models.shared.schedules import plan_stages
from models.shared.fitting import Throughput, fit_resumable
from models.shared.training import Recipe, on_gpu, resolve_precision
from pipelines.deps import code_digest
from pipelines.common import load_model, log, mlflow_run, run_record, stage, write_json
from pipelines.train_inputs import draft_vocabulary, hidden_caches, load_examples, make_loader, trainable_heads
from pipelines.recipes import effective_epochs, profile_overrides, recipe_record, trainable_recipe, with_profile_heads

RECIPE_FILE = "recipe.json"        # beside the trained heads: the recipe as resolved (pipelines/recipes.py)
# profile.train keys that change how a run goes, not what it computes: a checkpoint survives them.
RUNTIME_KEYS = ("num_threads", "progress_bar", "log_every_n_steps", "checkpoint_every_n_steps", "cache_batch_tokens")


def fingerprint(cfg: DictConfig, data_key: str, part: str) -> str:
    """What a checkpoint must match to be resumed: settings, data and the training code."""
    code = code_digest("pipelines.train")
    items = {"heads": OmegaConf.to_container(cfg.heads, resolve=True),
             "train": {k: v for k, v in OmegaConf.to_container(cfg.profile.train, resolve=True).items()
                       if k not in RUNTIME_KEYS},
             "model": [cfg.model.name, str(cfg.model.source), cfg.model.dtype], "precision": trainer_precision(cfg),
             "seed": int(cfg.seed), "data": data_key, "code": code, "part": part}
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()[:16]


def trainer_precision(cfg: DictConfig) -> str:
    return resolve_precision(str(cfg.trainer.precision), str(cfg.trainer.accelerator),
                             cpu_fp32=cfg.heads.name in (cfg.trainer.get("cpu_fp32_heads") or []))


def cpu_threads(cfg: DictConfig) -> int | None:
    """profile.train.num_threads; unset under CPU DDP: the cores shared out between the trainer.devices processes."""
    if cfg.profile.train.get("num_threads"):
        return int(cfg.profile.train.num_threads)
    devices = str(cfg.trainer.devices)
    if not on_gpu(str(cfg.trainer.accelerator)) and devices.isdigit() and int(devices) > 1:
        return max(1, (os.cpu_count() or 1) // int(devices))
    return None


def trainer_settings(cfg: DictConfig) -> dict:
    t = cfg.profile.train
    return {"accelerator": cfg.trainer.accelerator, "devices": cfg.trainer.devices,
            "num_nodes": int(cfg.trainer.num_nodes), "strategy": cfg.trainer.strategy,
            "precision": trainer_precision(cfg), "accumulate_grad_batches": int(t.grad_accum),
            "limit_val_batches": t.limit_val_batches, "gradient_clip_val": t.get("gradient_clip_val"),
            "log_every_n_steps": int(t.get("log_every_n_steps", 10)),
            "enable_progress_bar": bool(t.get("progress_bar", True)),
            "use_distributed_sampler": False}   # models/shared/head_data.py's samplers shard by rank


def train_metrics(cfg: DictConfig, recipe: Recipe, trainer, parts: dict, data: dict, vocab: tuple, final: dict,
                  drift: dict, times: dict) -> dict:
    """reports/metrics/train_<heads>.json. vocab: (draft_ids, val coverage); times: cache_time_s, fit_time_s,
    wall_time_s."""
    h, t, (draft_ids, val_coverage) = cfg.heads, cfg.profile.train, vocab
    per_head = lambda n: {f"head{k}": round(float(final.get(f"val/top{n}_head{k}", float("nan"))), 4)  # noqa: E731
                          for k in range(int(h.num_heads))}
    joint = {}
    if "stage2" in parts:
        joint = {"joint_curve": parts["stage2"]["curve"], **drift, "joint_train_examples": min(
            len(data["train"][0]), t.get("joint_max_train_samples") or len(data["train"][0]))}
    return {"heads": h.name, "family": h.family, "kind": recipe.kind, "data": t.get("data", "distilled"),
            "recipe": dataclasses.asdict(recipe), "dropout": float(h.dropout), "profile_overrides": profile_overrides(cfg),
            "epochs": effective_epochs(cfg), "recipe_epochs": int(h.recipe.get("epochs") or t.epochs),
            "world_size": trainer.world_size,
            "steps": {p: v["steps"] for p, v in parts.items()}, "best_epoch": {p: v["best_epoch"] for p, v in parts.items()},
            "val_top1_head0_by_epoch": {p: v["history"] for p, v in parts.items()}, **joint,
            "train_positions_per_s": {p: v["positions_per_s"] for p, v in parts.items()},
            "batch_positions": int(t.batch_positions),
            "train_examples": len(data["train"][0]), "val_examples": len(data["val"][0]),
            "train_targets_head0": sum(target_positions(y) for y in data["train"][1]),
            "val_targets_head0": sum(target_positions(y) for y in data["val"][1]),
            "draft_vocab_size": None if draft_ids is None else len(draft_ids),
            "draft_vocab_val_coverage": round(val_coverage, 4), "val_loss": round(float(final["val/loss"]), 4),
            "val_top1": per_head(1), "val_top5": per_head(5),
            "baseline_unigram_top1": round(unigram_baseline(data["train"][1], data["val"][1]), 4),
            **{k: round(v, 1) for k, v in times.items()}}


def run_log_dict(record: dict, name: str) -> None:
    import mlflow

    mlflow.log_dict(record, name)


def log_metrics(metrics: dict, out_dir: Path, path: Path) -> None:
    import mlflow

    mlflow.log_metrics({f"final_val_top{n}_head{k}": v for n in (1, 5) for k, v in enumerate(metrics[f"val_top{n}"].values())})
    mlflow.log_metrics({"fit_time_s": metrics["fit_time_s"], "baseline_unigram_top1": metrics["baseline_unigram_top1"],
                        "draft_vocab_val_coverage": metrics["draft_vocab_val_coverage"],
                        **{f"{p}_positions_per_s": v for p, v in metrics["train_positions_per_s"].items()},
                        **{f"{p}_best_epoch": v for p, v in metrics["best_epoch"].items() if v is not None}})
    mlflow.log_artifacts(str(out_dir), artifact_path="heads")
    mlflow.log_artifact(str(path))
    log.info("train %s: val top-1 %s, top-5 %s (unigram baseline %.3f), best epoch %s, %s positions/s, draft "
             "vocabulary %s (val coverage %.3f) in %.0f s", metrics["heads"], metrics["val_top1"], metrics["val_top5"],
             metrics["baseline_unigram_top1"], metrics["best_epoch"], metrics["train_positions_per_s"],
             metrics["draft_vocab_size"], metrics["draft_vocab_val_coverage"], metrics["wall_time_s"])


def run_train(cfg: DictConfig) -> dict:
    """Steps 1) to 5); returns the metrics also written to reports/metrics/train_<heads>.json."""
    cfg = with_profile_heads(cfg)
    t0, h = time.time(), cfg.heads
    recipe = trainable_recipe(cfg)
    if cpu_threads(cfg):
        torch.set_num_threads(cpu_threads(cfg))
    pl.seed_everything(int(cfg.seed), workers=True)
    # each DDP rank (Lightning starts them with LOCAL_RANK set) computes on its own GPU
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if on_gpu(str(cfg.trainer.accelerator)) else "cpu"
    model, tokenizer = load_model(cfg, device=device)
    model.requires_grad_(False)
    data = load_examples(cfg)                                                          # 1) data
    data_key = sequences_fingerprint([s for split in data.values() for part in split for s in part])
    draft_ids, val_coverage = draft_vocabulary(cfg, data, model.config.vocab_size)     # 2) draft vocabulary
    hidden, cache_s = hidden_caches(cfg, model, data)                                  # 3) hidden cache
    heads = trainable_heads(cfg, model, draft_ids)                                     # 4) heads, fit
    loader = make_loader(cfg, data, hidden, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    ckpt_root, out_dir = Path(cfg.paths.results) / "checkpoints" / h.name, Path(cfg.paths.results) / "heads" / h.name
    fit = functools.partial(fit_family, cfg, heads, model, recipe, loader, ckpt_root, data_key, effective_epochs(cfg),
                            trainer_settings(cfg))
    every = cfg.profile.train.get("checkpoint_every_n_steps")
    if not is_global_zero():
        # DDP/FSDP ranks > 0 (Lightning re-runs this script with LOCAL_RANK/NODE_RANK set): train, log and save nothing
        module, trainer, _ = fit(False, [], every)
        trainer.validate(module, loader("val"), verbose=False)
        return {}
    with mlflow_run(cfg, "train", run_name=f"train-{h.name}") as run:
        from pytorch_lightning.loggers import MLFlowLogger

        logger = MLFlowLogger(experiment_name=cfg.mlflow.experiment, run_id=run.info.run_id,
                              tracking_uri=os.environ.get("MLFLOW_TRACKING_URI") or cfg.mlflow.tracking_uri)
        t_fit = time.time()
        module, trainer, parts = fit(logger, [LearningRateMonitor(logging_interval="step")], every)
        t_fit = time.time() - t_fit
        # 5) final figures (the best epoch's weights), heads folder, metrics
        final = trainer.validate(module, loader("val"), verbose=False)[0]
        drift = module.after_fit(data, device)
        record = recipe_record(cfg, recipe)
        save_heads(heads, module if module.joint_backbone else None, out_dir, record)
        run_log_dict(record, RECIPE_FILE)
        metrics = train_metrics(cfg, recipe, trainer, parts, data, (draft_ids, val_coverage), final, drift,
                                {"cache_time_s": cache_s, "fit_time_s": t_fit, "wall_time_s": time.time() - t0})
        metrics["run"] = run_record()
        path = write_json(Path(cfg.paths.reports) / "metrics" / f"train_{h.name}.json", metrics)
        log_metrics(metrics, out_dir, path)
    return metrics


def is_global_zero() -> bool:
    """Before the Trainer exists: RANK (torchrun, SLURM) or LOCAL_RANK + NODE_RANK (Lightning's own launcher)."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"]) == 0
    return int(os.environ.get("LOCAL_RANK", 0)) == 0 and int(os.environ.get("NODE_RANK", 0)) == 0


def fit_part(module, train_loader, val_loader, ckpt_dir, fp, epochs, trainer_kwargs, logger, cbs, every):
    """(trainer, summary of the part: steps, best epoch, val top-1 history, training positions/s)."""
    speed = Throughput()
    trainer, best = fit_resumable(module, train_loader, val_loader, ckpt_dir, fp, epochs, trainer_kwargs, logger,
                                  [*cbs, speed], every)
    return trainer, {"steps": trainer.global_step, "best_epoch": best.epoch, "history": best.history,
                     "positions_per_s": round(speed.positions_per_s, 1)}


def fit_family(cfg, heads, model, recipe, loader, ckpt_root, data_key, epochs, trainer_kwargs, logger, cbs, every):
    """(the last stage's module and trainer, {stage: summary}): every stage the recipe plans
    (models/shared/schedules.py), each resumable from its own checkpoints."""
    r, t = cfg.heads.recipe, cfg.profile.train
    plans = plan_stages(recipe_kind(recipe.kind).module, recipe, epochs, float(r.get("stage1_fraction") or 0),
                        OmegaConf.to_container(r.lora, resolve=True) if r.get("lora") else None,
                        t.get("joint_max_train_samples"), t.get("joint_val_every_n_steps"))
    parts = {}
    for plan in plans:
        module = plan.module(heads, model)
        train, kwargs, extra = loader("train", plan.loader_kind, limit=plan.limit), dict(trainer_kwargs), []
        if plan.val_every:   # at most once an epoch's batches (Lightning refuses a longer interval)
            kwargs["val_check_interval"] = min(int(plan.val_every), len(train))
        extra = module.stage_callbacks()
        trainer, parts[plan.name] = fit_part(module, train, loader("val"), ckpt_root if plan.name == "fit" else
                                             ckpt_root / plan.name, fingerprint(cfg, data_key, plan.name), plan.epochs,
                                             kwargs, logger, [*cbs, *extra], every)
        if extra:
            parts[plan.name]["curve"] = extra[0].points
    return module, trainer, parts


def save_heads(heads, joint_module, out_dir: Path, recipe: dict | None = None) -> None:
    """heads.save (+ the LoRA adapter of a jointly trained backbone, + recipe.json: the resolved recipe), written
    beside and renamed into place."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    heads.save(tmp)
    if joint_module is not None:
        joint_module.backbone.save_pretrained(str(tmp / "adapter"))
    if recipe is not None:
        (tmp / RECIPE_FILE).write_text(json.dumps(recipe, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)


@stage
def main(cfg: DictConfig) -> None:
    run_train(cfg)


if __name__ == "__main__":
    main()
