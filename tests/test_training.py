"""Head training: loss masking, each family learns and round-trips through load_heads, Medusa-2's adapter,
resume after an interruption, the hidden cache and the stage end to end (tiny model, synthetic data)."""
from __future__ import annotations

import copy
import json

import pytest
import pytorch_lightning as pl
import torch
from datasets import Dataset, DatasetDict

from models.base import build_tiny_model
from models.conversations import tokenize_conversation
from models.heads import HeadsConfig, build_heads, load_heads
from models.hidden_cache import HiddenCache, cache_key
from models.training import (IGNORE_INDEX, MODULES, HeadsDataset, Recipe, collate, fit_resumable, head_positions,
                             resolve_precision)
from pipelines.prepare import FEATURES

@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread is faster than two, and the two cores are shared with other work."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


FAMILY = {"medusa1": "medusa", "hydra": "hydra", "hydra_pp": "hydra_pp", "medusa2": "medusa"}


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """Answers that repeat a short pattern, so tokens two and more ahead are predictable."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        word = "".join(chr(97 + int(c)) for c in torch.randint(0, 6, (3,), generator=g))
        out.append([{"role": "user", "content": f"say {word}"}, {"role": "assistant", "content": (word + " ") * 6}])
    return out


def examples(tok, n: int, seed: int = 0):
    rows = [tokenize_conversation(tok, m, 96) for m in conversations(n, seed)]
    return [r[0] for r in rows], [r[1] for r in rows]


def loaders(tok, model, n_train=8, n_val=4, batch_size=4, cache_dir=None):
    tr, va = examples(tok, n_train, 0), examples(tok, n_val, 1)
    hid = [None, None]
    if cache_dir is not None:
        hid = [HiddenCache.build(model, d[0], cache_dir / name, batch_size=3, shard_size=5)
               for name, d in (("train", tr), ("val", va))]
    pad = tok.pad_token_id
    mk = lambda d, h, shuffle: torch.utils.data.DataLoader(HeadsDataset(*d, h), batch_size=batch_size, shuffle=shuffle,
                                                           collate_fn=lambda x: collate(x, pad))
    return mk(tr, hid[0], True), mk(va, hid[1], False)


def make_module(kind, model, lr=1e-2):
    fam = FAMILY[kind]
    heads = build_heads(HeadsConfig.for_base(model, fam, num_heads=3, num_layers=2 if fam == "hydra_pp" else 1,
                                             dropout=0.0), model)
    heads.requires_grad_(True)
    model.requires_grad_(False)
    extra = {"teacher_loss_weight": 1.0, "lm_loss_weight": 0.0} if kind == "hydra_pp" else {}
    recipe = Recipe(kind=kind, lr=lr, warmup_ratio=0.0, **extra)
    if kind == "medusa2":
        from peft import LoraConfig, get_peft_model
        backbone = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
        return MODULES[kind](heads, backbone, recipe), heads
    return MODULES[kind](heads, model, recipe), heads


def quiet_trainer_kwargs():
    return {"accelerator": "cpu", "devices": 1, "enable_progress_bar": False, "log_every_n_steps": 1}


# -- losses -----------------------------------------------------------------------------------


def test_head_targets_skip_masked_positions():
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 7, 8, IGNORE_INDEX, 9]])
    b, t, target = head_positions(labels, k=0)          # head 0 at t predicts t+2
    assert t.tolist() == [1, 2, 4] and target.tolist() == [7, 8, 9]
    b, t, target = head_positions(labels, k=2)          # head 2 at t predicts t+4
    assert t.tolist() == [0, 2] and target.tolist() == [8, 9]


@pytest.mark.parametrize("kind", ["medusa1", "hydra", "hydra_pp"])
def test_only_assistant_targets_count(kind, tiny_model):
    """With one labelled token at p, the loss is sum_k 0.8^k CE(head k at p-k-2, x_p): nothing else counts.

    Hydra++: soft CE against the base's distribution at p-1 (which predicts p), on the prefix layer's output.
    """
    model, tok = tiny_model
    module, heads = make_module(kind, model)
    ids = torch.tensor([examples(tok, 1)[0][0]])                       # [1, T]
    p = 12
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[0, p] = ids[0, p]
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    loss, per_head, _ = module.compute(batch)
    with torch.no_grad():
        base = model.get_decoder()(input_ids=ids).last_hidden_state      # [1, T, h]
        hidden = heads.prefix_forward(base, torch.arange(ids.shape[1])[None])[0]
        teacher = torch.softmax(model.get_output_embeddings()(base[0, p - 1]), -1)
        expected = 0.0
        for k in range(3):
            t = p - k - 2
            path = ids[0, t + 1:t + k + 2][None] if kind != "medusa1" else None
            logits = heads.head_logits(k, hidden[t][None], path)
            if kind == "hydra_pp":
                expected += 0.8 ** k * -(teacher * torch.log_softmax(logits[0], -1)).sum()
            else:
                expected += 0.8 ** k * torch.nn.functional.cross_entropy(logits, ids[0, p][None])
    assert torch.allclose(loss, expected, atol=1e-5)
    assert all(len(item[2]) == 1 for item in per_head)
    # unlabelled (-100) tokens at every other position: none of them is a target
    labels[0, p] = IGNORE_INDEX
    loss, per_head, _ = module.compute(batch)
    assert loss.item() == 0.0 and per_head == [None, None, None]


# -- each family learns and round-trips ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["medusa1", "hydra", "hydra_pp"])
def test_family_learns_and_reloads_identically(kind, tmp_path):
    model, tok = build_tiny_model(seed=0)
    train, val = loaders(tok, model, cache_dir=tmp_path / "cache")
    module, heads = make_module(kind, model)
    before = pl.Trainer(logger=False, **quiet_trainer_kwargs()).validate(module, val, verbose=False)[0]["val/loss"]
    trainer = fit_resumable(module, train, val, tmp_path / "ckpt", "fp", max_epochs=8,
                            trainer_kwargs=quiet_trainer_kwargs())
    after = trainer.validate(module, val, verbose=False)[0]
    # Hydra++'s soft CE cannot go below the (random) teacher's entropy: a smaller drop is all there is
    assert after["val/loss"] < (0.95 if kind == "hydra_pp" else 0.8) * before
    assert 0.0 <= after["val/top1_head0"] <= after["val/top5_head0"] <= 1.0
    heads.save(tmp_path / "heads")
    _, loaded = load_heads(tmp_path / "heads", model)
    heads.eval()
    h = torch.randn(2, 5, model.config.hidden_size)
    pos = torch.arange(5).expand(2, 5)
    path = torch.randint(0, model.config.vocab_size, (2, 5, 3))
    with torch.no_grad():
        a, b = heads.prefix_forward(h, pos), loaded.prefix_forward(h, pos)
        assert torch.equal(a, b)
        for k in range(3):
            p = path[..., :k + 1] if kind != "medusa1" else None
            assert torch.equal(heads.head_logits(k, a, p), loaded.head_logits(k, b, p))


def test_medusa2_adapter_and_heads_load_together(tmp_path):
    from pipelines.train import save_heads

    model, tok = build_tiny_model(seed=0)
    reference = copy.deepcopy(model)
    train, val = loaders(tok, model, cache_dir=tmp_path / "cache")   # cached hidden = the adapters-off reference
    module, heads = make_module("medusa2", model, lr=2e-2)
    trainer = fit_resumable(module, train, val, tmp_path / "ckpt", "fp", max_epochs=4,
                            trainer_kwargs=quiet_trainer_kwargs())
    assert trainer.global_step == 8
    save_heads(heads, module, tmp_path / "heads")
    assert (tmp_path / "heads" / "adapter" / "adapter_config.json").is_file()
    merged, loaded = load_heads(tmp_path / "heads", copy.deepcopy(reference))
    ids = torch.tensor([examples(tok, 1, 3)[0][0]])
    module.eval()
    with torch.no_grad():
        trained_logits = module.backbone(input_ids=ids).logits
        merged_logits = merged(input_ids=ids).logits
        assert torch.allclose(trained_logits, merged_logits, atol=1e-4)           # the adapter came back
        assert not torch.allclose(merged_logits, reference(input_ids=ids).logits, atol=1e-3)  # and it changed the base
        hid = merged.get_decoder()(input_ids=ids).last_hidden_state
        assert torch.allclose(heads.head_logits(0, hid), loaded.head_logits(0, hid), atol=1e-5)


# -- resume ---------------------------------------------------------------------------------------


class Interrupt(pl.Callback):
    def __init__(self, at_step):
        self.at_step = at_step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= self.at_step:
            raise RuntimeError("simulated crash")


class FirstStep(pl.Callback):
    def on_train_start(self, trainer, *args):
        self.global_step = trainer.global_step


def test_interrupted_training_resumes_from_last_checkpoint(tmp_path):
    model, tok = build_tiny_model(seed=0)
    train, val = loaders(tok, model, n_train=12, batch_size=2)           # 6 steps per epoch
    module, _ = make_module("hydra", model)
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit_resumable(module, train, val, tmp_path / "ckpt", "fp", max_epochs=2, trainer_kwargs=quiet_trainer_kwargs(),
                      callbacks=[Interrupt(5)], every_n_train_steps=2)
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["last.ckpt"]
    module, heads = make_module("hydra", model)                          # a fresh process would start like this
    first = FirstStep()
    trainer = fit_resumable(module, train, val, tmp_path / "ckpt", "fp", max_epochs=2,
                            trainer_kwargs=quiet_trainer_kwargs(), callbacks=[first], every_n_train_steps=2)
    assert first.global_step == 4 and trainer.global_step == 12 and trainer.current_epoch == 2
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["last.ckpt"]
    # a finished run started again resumes to its final state and trains no further
    module2, heads2 = make_module("hydra", model)
    first = FirstStep()
    trainer = fit_resumable(module2, train, val, tmp_path / "ckpt", "fp", max_epochs=2,
                            trainer_kwargs=quiet_trainer_kwargs(), callbacks=[first], every_n_train_steps=2)
    assert first.__dict__.get("global_step") in (None, 12) and trainer.global_step == 12
    assert all(torch.equal(a, b) for a, b in zip(heads.state_dict().values(), heads2.state_dict().values()))
    # other settings: the checkpoint is not resumed
    module, _ = make_module("hydra", model)
    first = FirstStep()
    fit_resumable(module, train, val, tmp_path / "ckpt", "other", max_epochs=1, trainer_kwargs=quiet_trainer_kwargs(),
                  callbacks=[first])
    assert first.global_step == 0


def test_hidden_cache_is_built_once_and_matches_the_model(tmp_path):
    model, tok = build_tiny_model(seed=0)
    ids, _ = examples(tok, 7)
    folder = tmp_path / cache_key(model, ids)
    cache = HiddenCache.build(model, ids, folder, batch_size=3, shard_size=3)
    stamps = {p: p.stat().st_mtime_ns for p in folder.glob("*.safetensors")}
    assert len(stamps) == 3
    again = HiddenCache.build(model, ids, folder, batch_size=3, shard_size=3)
    assert {p: p.stat().st_mtime_ns for p in folder.glob("*.safetensors")} == stamps
    with torch.no_grad():
        ref = model.get_decoder()(input_ids=torch.tensor([ids[4]])).last_hidden_state[0]
    assert torch.allclose(cache[4], ref, atol=1e-5) and torch.equal(cache[4], again[4])
    assert cache_key(model, ids[:-1]) != cache_key(model, ids)


# -- the stage ------------------------------------------------------------------------------------


@pytest.fixture
def stage_cfg(compose_cfg, monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

    def make(heads):
        cfg = compose_cfg("profile=smoke", f"+select.heads={heads}", "profile.train.batch_size=4",
                          "profile.train.max_length=96", "profile.train.progress_bar=false",
                          "profile.train.log_every_n_steps=1")
        from pipelines.common import apply_selection
        cfg = apply_selection(cfg)
        _, tok = build_tiny_model()
        parts = {}
        for split, n, seed in (("train", 8, 0), ("val", 4, 1)):
            convs = conversations(n, seed)
            rows = [tokenize_conversation(tok, m, 96) for m in convs]
            parts[split] = Dataset.from_dict({"id": [f"{split}{i}" for i in range(n)],
                                              "messages": [json.dumps(m) for m in convs],
                                              "input_ids": [r[0] for r in rows], "labels": [r[1] for r in rows]},
                                             features=FEATURES)
        DatasetDict(parts).save_to_disk(cfg.data.distilled_dir)
        return cfg
    return make


def test_train_stage_writes_heads_metrics_and_reuses_the_cache(stage_cfg, tmp_path):
    from pipelines.train import run_train

    cfg = stage_cfg("hydra_pp")
    assert cfg.heads.name == "hydra_pp" and cfg.heads.share_lm_head is True
    metrics = run_train(cfg)
    assert set(metrics["val_top1"]) == {f"head{k}" for k in range(cfg.heads.num_heads)}
    saved = json.loads((tmp_path / "reports" / "metrics" / "train_hydra_pp.json").read_text())
    assert saved["val_top1"] == metrics["val_top1"] and saved["steps"]["fit"] == 2
    model, _ = build_tiny_model()
    _, heads = load_heads(tmp_path / "results" / "heads" / "hydra_pp", model)
    assert heads.config.family == "hydra_pp" and heads.prefix_layer is not None
    shards = {p: p.stat().st_mtime_ns for p in (tmp_path / "results" / "cache" / "hidden").rglob("*.safetensors")}
    assert shards
    metrics = run_train(stage_cfg("medusa2"))      # stage 1 + stage 2, on the same cache
    assert metrics["steps"] == {"stage1": 2, "stage2": 2}
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "results" / "cache" / "hidden").rglob("*.safetensors")} == shards
    assert (tmp_path / "results" / "heads" / "medusa2" / "adapter").is_dir()
    logged = {p.relative_to(p.parents[len(p.relative_to(tmp_path / "mlruns").parts) - 4]).as_posix()
              for p in (tmp_path / "mlruns").rglob("metrics/**/*") if p.is_file()}
    runs = list((tmp_path / "mlruns").rglob("metrics/val/top1_head0"))
    assert len(runs) == 2   # one MLflow run per training, each with per-head val accuracy, losses and the lr
    for name in ("val/top5_head3", "train/loss", "stage1/train/loss", "train/lm_loss", "lr-AdamW/heads", "lr-AdamW/lora"):
        assert any(l.endswith(name) for l in logged), name


def test_auto_precision_uses_bf16_only_where_the_hardware_has_it():
    amx = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16\n"
    avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"
    assert resolve_precision("auto", "cpu", cpuinfo=amx) == "bf16-mixed"
    assert resolve_precision("auto", "cpu", cpuinfo=avx2) == "32-true"
    assert resolve_precision("auto", "gpu", cpuinfo=avx2) == "bf16-mixed"
    assert resolve_precision("16-mixed", "cpu", cpuinfo=amx) == "16-mixed"  # an explicit choice is kept
