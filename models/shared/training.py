"""Training draft heads with Lightning: one module per family and their losses (docs/reference.md#training-recipes).

    module = models.methods.recipe_kind("hydra").module(heads, base_model, Recipe(kind="hydra", lr=1e-3))
    trainer, best = fit_resumable(module, ...)       # models/shared/fitting.py: resumable, best val epoch kept

Targets: head k at position t predicts token t+k+2, and the position counts only when that token
is an assistant token (labels != -100). A batch (models/shared/head_data.py) holds input_ids and labels
[B, T] (right padding), optionally `sources` [B, T] (the positions the heads read; all when absent)
and, when the frozen base's hidden states come from the cache, `hidden` [B, T, h] (window batches:
[B, 1, h]); without it the modules run the frozen backbone themselves.

Draft vocabulary (heads.draft_ids, models/shared/draft_vocab.py): the heads' logits cover it only. The CE
losses leave out targets outside it (nothing to learn there); the Hydra++ teacher is the base
distribution restricted to it and renormalised; val top-1/top-5 count every target, an
out-of-vocabulary one as a miss, so accuracies compare with full-vocabulary heads.

HeadsModule is the base every method's module subclasses, named by the method's recipe kinds (its Method's
RecipeKind, models/methods/<method>/__init__.py):
  Medusa1Module   frozen backbone, loss sum_k decay^k CE_k (0.8^k)              models/methods/medusa/training.py
  Medusa2Module   LoRA backbone trained jointly: L_LM + lambda * s(t) * sum_k 0.8^(k+1) CE_k      (the same)
  HydraModule     Medusa-1's loss, head k also sees the true tokens x_{t+1..t+k+1} (teacher forcing; heads equal:
                  1.0^k)                                                        models/methods/hydra/training.py
  HydraPPModule   Hydra + the prefix decoder layer; loss = soft CE against softmax(base logits)   (the same)
  AutoregressiveFitModule  EAGLE's layer, EAGLE-3's or a draft model (models/shared/autoregressive/training.py)
"""
from __future__ import annotations

import logging
import math

import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from models.engine.taps import final_and_taps
from models.hardware import cpu_has_fast_bf16
from models.shared.recipes import Recipe

IGNORE_INDEX = -100
log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Precision


def on_gpu(accelerator: str) -> bool:
    """Whether a Trainer with this accelerator runs on GPUs: gpu/cuda, or auto with one present."""
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def resolve_precision(precision: str, accelerator: str, cpuinfo: str | None = None, cpu_fp32: bool = False) -> str:
    """`auto`: bf16-mixed on GPUs (accelerator gpu, or auto with one present) and on CPUs with bf16 hardware
    (unless `cpu_fp32`: heads measured faster in float32 on a CPU), else 32-true.

    Autocast to bf16 on an AVX2-only CPU emulates every matmul: head training ran ~70x slower
    (20 steps in 25 minutes) than in float32 on such a machine.
    """
    if precision != "auto":
        return precision
    if on_gpu(accelerator):
        return "bf16-mixed"
    return "bf16-mixed" if cpu_has_fast_bf16(cpuinfo) and not cpu_fp32 else "32-true"


def head_positions(labels: torch.Tensor, k: int, sources: torch.Tensor | None = None):
    """(b, t, target) of head k: every source t whose token t+k+2 is an assistant token. labels, sources: [B, T]."""
    target = labels[:, k + 2:]                            # [B, T-k-2]: the token head k predicts from t
    valid = target != IGNORE_INDEX
    if sources is not None:
        valid &= sources[:, :target.shape[1]]
    b, t = valid.nonzero(as_tuple=True)
    return b, t, target[b, t]


def path_tokens(input_ids: torch.Tensor, b: torch.Tensor, t: torch.Tensor, k: int) -> torch.Tensor:
    """[N, k+1]: the true tokens x_{t+1} .. x_{t+k+1} above head k's target (Hydra's teacher forcing)."""
    offsets = torch.arange(1, k + 2, device=t.device)     # [k+1]
    return input_ids[b[:, None], t[:, None] + offsets]


# ---------------------------------------------------------------------------------------------
# Losses


def soft_cross_entropy(logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -sum_v softmax(teacher)_v log softmax(logits)_v. [N, Vd] each."""
    return -(F.softmax(teacher_logits.float(), -1) * F.log_softmax(logits.float(), -1)).sum(-1).mean()


def kl_to_reference(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(softmax(ref) || softmax(logits)). [N, V] each."""
    ref = F.log_softmax(ref_logits.float(), -1)
    return F.kl_div(F.log_softmax(logits.float(), -1), ref, log_target=True, reduction="batchmean")


def topk_hits(logits: torch.Tensor, target: torch.Tensor, to_token_ids=None, ks=(1, 5)) -> dict[int, torch.Tensor]:
    """Number of rows whose target token is among the top-k logits, per k. logits [N, Vd], target [N] token ids;
    to_token_ids maps logit positions to token ids (a draft vocabulary)."""
    top = logits.topk(min(max(ks), logits.shape[-1]), dim=-1).indices       # [N, kmax]
    if to_token_ids is not None:
        top = to_token_ids(top)
    hit = top == target[:, None]
    return {k: hit[:, :k].any(-1).sum() for k in ks}


def lr_lambda(total_steps: int, warmup_steps: int, min_ratio: float):
    """Linear warm-up, then cosine decay from 1 to min_ratio (a factor on the base lr)."""
    def fn(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return fn


# ---------------------------------------------------------------------------------------------
# Modules


class HeadsModule(pl.LightningModule):
    """Frozen backbone, heads trained. What a head reads (path tokens, the Hydra++ prefix layer) comes from the
    heads' family and module (models/shared/families.py, DraftHeads.read_hidden); subclasses change the losses or
    what is trained."""

    recipe_type: type[Recipe] = Recipe   # the dataclass of the recipe kinds this module trains
    heads_only_kind: str | None = None   # a joint recipe's heads-only first stage trains as this kind, with
    heads_only_module: type["HeadsModule"] | None = None    # this module

    joint_backbone = False      # True: the backbone is trained too (Medusa-2), its adapter is saved with the heads

    def __init__(self, heads, base_model, recipe: Recipe, log_prefix: str = ""):
        super().__init__()
        self.heads, self.recipe, self.log_prefix = heads, recipe, log_prefix
        # Not a submodule: the frozen base is neither trained nor written into checkpoints.
        self._frozen = {"base": base_model}
        self.fingerprint = None

    @property
    def base(self):
        return self._frozen["base"]

    def on_fit_start(self):
        self.base.to(self.device)
        self.trainable().train()          # dropout on (Lightning keeps the modes it finds; copied layers come in eval)

    def stage_callbacks(self) -> list:
        """Lightning callbacks the stage this module trains adds (Medusa-2's joint stage: its curve)."""
        return []

    def after_fit(self, data: dict, device: str) -> dict:
        """Figures measured once the fit is done, for the stage's metrics (Medusa-2: the backbone's drift)."""
        return {}

    def trainable(self) -> torch.nn.Module:
        return self.heads

    def on_validation_start(self):
        self.base.to(self.device)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["fingerprint"] = self.fingerprint

    # -- forward pieces ------------------------------------------------------------------------
    def base_hidden(self, batch) -> torch.Tensor:
        """[B, T, h] of the frozen base: from the cache when the batch carries it (right padding: no mask needed);
        [B, T, h * (1 + n)] when the family reads n taps (models/engine/taps.py): the final state, then the taps."""
        if "hidden" in batch:
            return batch["hidden"]
        taps = self.heads.family.taps(self.base.config, self.heads.config.num_layers)
        return final_and_taps(self.base.get_decoder(), batch["input_ids"], taps)

    @property
    def uses_path(self) -> bool:
        return self.heads.family.reads_path

    def head_inputs(self, hidden: torch.Tensor, batch) -> torch.Tensor:
        """What the heads read: the base hidden states, through the heads' read_hidden when the family has a prefix
        layer (Hydra++)."""
        if not self.heads.family.prefix_layer:
            return hidden
        B, T, _ = hidden.shape
        positions = torch.arange(T, device=hidden.device).expand(B, T)   # right padding: pads come after
        return self.heads.read_hidden(hidden, positions)

    def heads_loss(self, head_hidden: torch.Tensor, base_hidden: torch.Tensor, batch) -> tuple[torch.Tensor, list]:
        """sum_k weight_k (lm_w CE_k + teacher_w softCE_k); per head (loss, logits [N, Vd], target token ids [N])."""
        r, total, per_head = self.recipe, head_hidden.new_zeros(()), []
        if r.teacher_loss_weight:
            # The teacher is the frozen base's distribution for the same token: its LM head at position
            # t+k+1 (which predicts t+k+2), over the draft vocabulary (softmax renormalises it there).
            # Recomputed here from the cached hidden states, once per position for all heads.
            nxt = batch["labels"][:, 1:] != IGNORE_INDEX                           # [B, T-1]
            pb, pp = nxt.nonzero(as_tuple=True)
            with torch.no_grad():
                teacher_all = self.heads.base_draft_logits(base_hidden[pb, pp])    # [P, Vd]
            row = torch.full(nxt.shape, -1, dtype=torch.long, device=nxt.device)
            row[pb, pp] = torch.arange(len(pp), device=nxt.device)
        for k in range(self.heads.config.num_heads):
            b, t, target = head_positions(batch["labels"], k, batch.get("sources"))
            if len(t) == 0:
                per_head.append(None)
                continue
            path = path_tokens(batch["input_ids"], b, t, k) if self.uses_path else None
            logits = self.heads.draft_logits(k, head_hidden[b, t], path)           # [N, Vd]
            loss_k = logits.new_zeros(())
            if r.lm_loss_weight:
                index = self.heads.to_draft_index(target)                          # [N], -1 outside the vocabulary
                inside = index >= 0
                ce = F.cross_entropy(logits[inside].float(), index[inside]) if inside.any() else logits.sum() * 0
                loss_k = loss_k + r.lm_loss_weight * ce
            if r.teacher_loss_weight:
                loss_k = loss_k + r.teacher_loss_weight * soft_cross_entropy(logits, teacher_all[row[b, t + k + 1]])
            total = total + r.head_weight(k) * loss_k
            per_head.append((loss_k.detach(), logits.detach(), target))
        return total, per_head

    def compute(self, batch) -> tuple[torch.Tensor, list, dict]:
        base_hidden = self.base_hidden(batch)
        loss, per_head = self.heads_loss(self.head_inputs(base_hidden, batch), base_hidden, batch)
        return loss, per_head, {}

    # -- Lightning hooks -----------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        loss, per_head, extra = self.compute(batch)
        p = self.log_prefix
        self.log(f"{p}train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        for k, item in enumerate(per_head):
            if item is not None:
                self.log(f"{p}train/loss_head{k}", item[0], batch_size=len(item[2]))
        for name, value in extra.items():
            self.log(f"{p}train/{name}", value, batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch, batch_idx):
        loss, per_head, _ = self.compute(batch)
        p = self.log_prefix
        self.log(f"{p}val/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0], sync_dist=True)
        for k, item in enumerate(per_head):
            if item is None:
                continue
            _, logits, target = item
            hits = topk_hits(logits, target, self.heads.to_token_ids)   # out-of-vocabulary targets: misses
            for kk, n in hits.items():  # weighted by the number of targets: the epoch value is the accuracy
                self.log(f"{p}val/top{kk}_head{k}", n.float() / len(target), batch_size=len(target),
                         sync_dist=True)

    def param_groups(self) -> list[dict]:
        return [{"params": [p for p in self.heads.parameters() if p.requires_grad], "lr": self.recipe.lr, "name": "heads"}]

    def configure_optimizers(self):
        r = self.recipe
        groups = self.param_groups()
        # fused: one kernel for every tensor's update, not a loop of small ops per tensor (Hydra++ in float32 on
        # 2 cores: 0.88k -> 0.97k positions/s); float tensors on CPU or CUDA only, and not under Lightning's
        # mixed-precision plugin, which refuses to clip the gradients of an optimizer that unscales them itself
        fused = "mixed" not in str(self.trainer.precision) and all(
            p.device.type in ("cpu", "cuda") and p.is_floating_point() for g in groups for p in g["params"])
        opt = torch.optim.AdamW(groups, lr=r.lr, weight_decay=r.weight_decay, fused=fused)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = r.warmup_steps if r.warmup_steps is not None else round(r.warmup_ratio * total)
        if r.max_warmup_ratio is not None:
            warmup = min(warmup, round(r.max_warmup_ratio * total))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, warmup, r.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

