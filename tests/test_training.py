"""Head training: loss masking, the draft vocabulary in the losses and metrics, batches (windows and length
buckets), each family learns and round-trips through load_heads, Medusa-2's adapter, best-epoch selection,
resume after an interruption, the recipe details, the hidden cache and the stage end to end (tiny model,
synthetic data)."""
from __future__ import annotations

import copy
import json

import pytest
import pytorch_lightning as pl
import torch
from datasets import Dataset, DatasetDict
from omegaconf import OmegaConf
from torch import nn

from models.engine.drafting import heads_drafter
from models.base import build_tiny_model
from models.data.conversations import tokenize_conversation
from models.shared.draft_vocab import answer_token_counts, most_frequent
from models.shared.head_data import HeadsDataset, collate, conversation_loader, target_positions, window_loader
from models.shared import HeadsConfig
from models.methods import build_heads, load_heads
from models.shared.hidden_cache import HiddenCache, cache_key
from models.shared.fitting import fit_resumable
from models.shared.training import IGNORE_INDEX, Recipe, head_positions, resolve_precision
from models.methods import new_recipe, recipe_kind
from pipelines.prepare import FEATURES
from tests.test_decoding import perturbed


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


def save_distilled(path) -> None:
    """A distilled dataset of pattern conversations (8 train, 4 val) where the train stage reads it."""
    _, tok = build_tiny_model()
    parts = {}
    for split, n, seed in (("train", 8, 0), ("val", 4, 1)):
        convs = conversations(n, seed)
        rows = [tokenize_conversation(tok, m, 96) for m in convs]
        parts[split] = Dataset.from_dict({"id": [f"{split}{i}" for i in range(n)],
                                          "messages": [json.dumps(m) for m in convs],
                                          "input_ids": [r[0] for r in rows], "labels": [r[1] for r in rows]},
                                         features=FEATURES)
    DatasetDict(parts).save_to_disk(path)


def loaders(tok, model, n_train=8, n_val=4, batch_positions=100, cache_dir=None):
    """Length-bucketed conversation batches; every conversation has 25 target positions (4 per batch by default)."""
    tr, va = examples(tok, n_train, 0), examples(tok, n_val, 1)
    hid = [None, None]
    if cache_dir is not None:
        hid = [HiddenCache.build(model, d[0], cache_dir / name, batch_tokens=200, shard_size=5)
               for name, d in (("train", tr), ("val", va))]
    pad = tok.pad_token_id
    return (conversation_loader(HeadsDataset(*tr, hid[0]), batch_positions, pad, shuffle=True, seed=0),
            conversation_loader(HeadsDataset(*va, hid[1]), batch_positions, pad, shuffle=False))


def make_module(kind, model, lr=1e-2):
    fam = FAMILY[kind]
    heads = build_heads(HeadsConfig.for_base(model, fam, num_heads=3, num_layers=2 if fam == "hydra_pp" else 1,
                                             dropout=0.0), model)
    heads.requires_grad_(True)
    model.requires_grad_(False)
    extra = {"teacher_loss_weight": 1.0, "lm_loss_weight": 0.0} if kind == "hydra_pp" else {}
    recipe = new_recipe(kind=kind, lr=lr, warmup_ratio=0.0, **extra)
    if kind == "medusa2":
        from peft import LoraConfig, get_peft_model
        backbone = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
        return recipe_kind(kind).module(heads, backbone, recipe), heads
    return recipe_kind(kind).module(heads, model, recipe), heads


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
    batch = {"input_ids": ids, "labels": labels}
    loss, per_head, _ = module.compute(batch)
    with torch.no_grad():
        base = model.get_decoder()(input_ids=ids).last_hidden_state      # [1, T, h]
        hidden = heads.read_hidden(base, torch.arange(ids.shape[1])[None])[0]
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


def draft_heads(kind, model, draft_ids, dropout=0.0, share=True):
    fam = FAMILY[kind]
    config = HeadsConfig.for_base(model, fam, num_heads=3, num_layers=2 if fam == "hydra_pp" else 1, dropout=dropout,
                                  share_lm_head=share, draft_vocab_size=len(draft_ids))
    heads = build_heads(config, model, draft_ids)
    return perturbed(heads, 0)                              # every weight matters, as after training


@pytest.mark.parametrize("kind", ["medusa1", "hydra", "hydra_pp"])
def test_draft_vocabulary_loss_skips_outside_targets_and_metrics_count_them_as_misses(kind, tiny_model):
    """CE over the draft vocabulary on the targets inside it only; Hydra++'s teacher is the base distribution
    restricted to the draft vocabulary; top-k hits are counted over every target."""
    from models.shared.training import topk_hits

    model, tok = tiny_model
    ids, labels = examples(tok, 3)
    batch = collate([{"input_ids": torch.tensor(i), "labels": torch.tensor(y)} for i, y in zip(ids, labels)],
                    tok.pad_token_id)
    answer = batch["labels"][batch["labels"] != IGNORE_INDEX].unique()
    vocab = torch.cat([answer[::2], torch.tensor([0, 1])])          # half the answer tokens are outside
    heads = draft_heads(kind, model, vocab).eval()
    module = recipe_kind(kind).module(heads, model, new_recipe(kind=kind, **({"teacher_loss_weight": 1.0, "lm_loss_weight": 0.0}
                                                                 if kind == "hydra_pp" else {})))
    loss, per_head, _ = module.compute(batch)
    with torch.no_grad():
        base = model.get_decoder()(input_ids=batch["input_ids"]).last_hidden_state          # [B, T, h]
        hidden = heads.read_hidden(base, torch.arange(base.shape[1]).expand(base.shape[:2]))
        expected, outside = 0.0, 0
        for k in range(3):
            b, t, target = head_positions(batch["labels"], k)
            path = path_tokens_of(batch["input_ids"], b, t, k) if kind != "medusa1" else None
            full = heads.head_logits(k, hidden[b, t], path)                                 # [N, V], -inf outside
            inside = torch.isin(target, vocab)
            outside += int((~inside).sum())
            if kind == "hydra_pp":
                teacher = model.get_output_embeddings()(base[b, t + k + 1])[:, vocab].softmax(-1)   # renormalised
                loss_k = -(teacher * full[:, vocab].log_softmax(-1)).sum(-1).mean()
            else:
                loss_k = torch.nn.functional.cross_entropy(full[inside], target[inside])
            expected += 0.8 ** k * loss_k
            _, logits, got_target = per_head[k]
            hits = topk_hits(logits, got_target, heads.to_token_ids)
            assert torch.equal(got_target, target)
            assert int(hits[1]) == int((full.argmax(-1) == target).sum())          # over all N targets
            assert int(hits[5]) == int((full.topk(5).indices == target[:, None]).any(-1).sum())
            assert int(hits[5]) <= int(inside.sum())                              # an outside target is never hit
    assert outside > 0
    assert torch.allclose(loss, torch.as_tensor(expected), atol=1e-5)
    # no target inside the draft vocabulary: no CE at all (Hydra++'s teacher term is still defined)
    if kind != "hydra_pp":
        never = torch.tensor([i for i in range(model.config.vocab_size) if i not in answer.tolist()][:3])
        heads_out = draft_heads(kind, model, never)
        loss, _, _ = recipe_kind(kind).module(heads_out, model, new_recipe(kind=kind)).compute(batch)
        assert loss.item() == 0.0


def path_tokens_of(input_ids, b, t, k):
    from models.shared.training import path_tokens
    return path_tokens(input_ids, b, t, k)


def test_window_batches_hold_the_same_targets_as_conversation_batches(tmp_path):
    """Random-position windows give each head the same (h_t, path, target) triples as whole conversations."""
    model, tok = build_tiny_model(seed=0)
    ids, labels = examples(tok, 5)
    cache = HiddenCache.build(model, ids, tmp_path / "cache", batch_tokens=200)
    data = HeadsDataset(ids, labels, cache)
    heads = draft_heads("hydra", model, torch.arange(model.config.vocab_size)).eval()
    module = recipe_kind("hydra").module(heads, model, new_recipe(kind="hydra", head_decay=1.0))
    totals = {}
    for name, loader in (("windows", window_loader(data, 3, batch_positions=16, pad_id=tok.pad_token_id, seed=1)),
                         ("conversations", conversation_loader(data, 30, tok.pad_token_id, shuffle=True, seed=1))):
        sums, counts = torch.zeros(3), torch.zeros(3)
        for batch in loader:
            if name == "windows":
                assert batch["hidden"].shape[1] == 1 and batch["input_ids"].shape[1] == 3 + 2
            _, per_head, _ = module.compute(batch)
            for k, (loss_k, _, target) in enumerate(per_head):
                sums[k] += loss_k * len(target)
                counts[k] += len(target)
        totals[name] = (sums, counts)
    assert torch.equal(totals["windows"][1], totals["conversations"][1])
    assert totals["windows"][1][0] == sum(target_positions(y) for y in labels)
    assert torch.allclose(totals["windows"][0], totals["conversations"][0], rtol=1e-5)


def test_length_batches_cover_each_conversation_once_with_similar_lengths():
    from models.shared.head_data import LengthBatches

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(10, 200, (40,), generator=g).tolist()
    positions = [n // 2 for n in lengths]
    sampler = LengthBatches(lengths, positions, batch_positions=150, shuffle=True, seed=3)
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(40))
    ranges = sorted((min(lengths[i] for i in b), max(lengths[i] for i in b)) for b in batches)
    assert all(hi <= lo for (_, hi), (lo, _) in zip(ranges, ranges[1:]))           # length buckets do not overlap
    full = [sum(positions[i] for i in b) >= 150 for b in batches]
    assert sum(not f for f in full) <= 1                                             # only the last may be short
    sampler.set_epoch(1)
    assert list(sampler) != batches and sorted(map(sorted, sampler)) == sorted(map(sorted, batches))
    sampler.set_epoch(0)
    assert list(sampler) == batches                                                  # (seed, epoch) fixes the order


class Snapshots(pl.Callback):
    """A copy of the heads' weights at each val epoch of a fit."""

    def __init__(self):
        self.weights = []

    def on_validation_epoch_end(self, trainer, module):
        if trainer.state.fn == "fit":
            self.weights.append({k: v.clone() for k, v in module.heads.state_dict().items()})


def test_best_val_epoch_weights_are_kept_and_survive_a_resume(tmp_path):
    from models.methods.medusa.training import Medusa1Module

    class ScriptedVal(Medusa1Module):                     # val top-1 of head 0: 0.2, 0.5, 0.3 by epoch
        def validation_step(self, batch, batch_idx):
            self.log("val/top1_head0", [0.2, 0.5, 0.3][self.current_epoch], batch_size=1)

    model, tok = build_tiny_model(seed=0)
    train, val = loaders(tok, model)
    _, heads = make_module("medusa1", model)
    snapshots = Snapshots()
    _, best = fit_resumable(ScriptedVal(heads, model, new_recipe(kind="medusa1", lr=1e-2)), train, val, tmp_path / "ckpt",
                            "fp", max_epochs=3, trainer_kwargs=quiet_trainer_kwargs(), callbacks=[snapshots])
    assert best.epoch == 2 and best.history == [0.2, 0.5, 0.3]
    now = heads.state_dict()
    assert all(torch.equal(now[k], v) for k, v in snapshots.weights[1].items())          # epoch 2's weights
    assert not all(torch.equal(now[k], v) for k, v in snapshots.weights[2].items())      # not the last epoch's
    _, heads2 = make_module("medusa1", model)                  # the finished run started again
    _, best2 = fit_resumable(ScriptedVal(heads2, model, new_recipe(kind="medusa1", lr=1e-2)), train, val,
                             tmp_path / "ckpt", "fp", max_epochs=3, trainer_kwargs=quiet_trainer_kwargs())
    assert best2.epoch == 2 and all(torch.equal(heads2.state_dict()[k], v) for k, v in now.items())


# -- recipes as in the reference code --------------------------------------------------------------


def test_head_loss_weights_follow_each_trainer(compose_cfg):
    """Medusa-1 0.8^k, Medusa-2 0.8^(k+1) (k from 0), Hydra and Hydra++ equal weights."""
    from pipelines.common import apply_selection
    from pipelines.recipes import make_recipe

    want = {"medusa1": [1, 0.8, 0.64], "medusa2": [0.8, 0.64, 0.512], "hydra": [1, 1, 1], "hydra_pp": [1, 1, 1]}
    for name, weights in want.items():
        recipe = make_recipe(apply_selection(compose_cfg(f"+select.heads={name}")))
        assert [recipe.head_weight(k) for k in range(3)] == pytest.approx(weights), name


def test_profile_heads_overrides_change_one_family_only(compose_cfg):
    """profile.train.heads_overrides.<name> is merged into that family's config (recipe and all); the other
    families and conf/heads/<name>.yaml keep theirs; a name or key it does not know is refused, naming both."""
    from pipelines.common import apply_selection
    from pipelines.recipes import make_recipe, with_profile_heads

    def heads(name, *overrides):
        return with_profile_heads(apply_selection(compose_cfg(f"+select.heads={name}", *overrides)))

    set_pp = ["+profile.train.heads_overrides.hydra_pp.recipe.lr=0.002",
              "+profile.train.heads_overrides.hydra_pp.dropout=0.3"]
    pp = heads("hydra_pp", "profile=paper", *set_pp)
    assert make_recipe(pp).lr == pytest.approx(0.002) and pp.heads.dropout == pytest.approx(0.3)
    assert make_recipe(pp).teacher_loss_weight == 1.0          # what it does not set stays the heads config's
    paper = heads("hydra_pp", "profile=paper")                 # the paper profile keeps the published recipe
    assert make_recipe(paper).lr == pytest.approx(5e-4) and make_recipe(paper).lm_loss_weight == 0.0
    assert make_recipe(heads("hydra", "profile=paper", *set_pp)).lr == pytest.approx(1e-3)
    with pytest.raises(ValueError, match=r"names \['hydra_p'\].*hydra_pp"):
        heads("hydra", "profile=paper", "+profile.train.heads_overrides.hydra_p.dropout=0.1")
    with pytest.raises(ValueError, match=r"sets \['drop'\].*dropout"):
        heads("hydra_pp", "profile=paper", "+profile.train.heads_overrides.hydra_pp.drop=0.1")


def test_epoch_caps_per_heads(compose_cfg):
    """profile.train.max_epochs caps every family (a number) or each heads name (a mapping with a default)."""
    from pipelines.common import apply_selection
    from pipelines.recipes import effective_epochs

    def epochs(name, *overrides):
        return effective_epochs(apply_selection(compose_cfg(f"+select.heads={name}", *overrides)))

    cpu = {name: epochs(name, "profile=cpu") for name in ("medusa1", "medusa2", "hydra", "hydra_pp")}
    assert cpu == {"medusa1": 2, "medusa2": 3, "hydra": 2, "hydra_pp": 2}
    assert epochs("hydra_pp", "profile=paper") == 10 and epochs("medusa1", "profile=paper") == 2
    assert epochs("hydra_pp", "profile=cpu", "profile.train.max_epochs=4") == 4
    with pytest.raises(ValueError, match="needs a `default`"):
        epochs("hydra", "profile=cpu", "~profile.train.max_epochs.default")


def test_hydra_pp_drops_out_before_every_block_and_before_the_lm_head(tiny_model):
    model, _ = tiny_model
    heads = draft_heads("hydra_pp", model, torch.arange(model.config.vocab_size), dropout=0.5, share=False)
    seen = []                                  # share of exact zeros in the input of each block and LM head
    hook = lambda mod, args: seen.append(float((args[0] == 0).float().mean()))
    for block in heads.blocks[1]:
        block.register_forward_pre_hook(hook)
    heads.lm_heads[1].register_forward_pre_hook(hook)
    h, path = torch.randn(64, model.config.hidden_size), torch.randint(3, 200, (64, 2))
    heads.train()
    heads.draft_logits(1, h, path)
    assert len(seen) == 2 + 1 and all(0.3 < z < 0.7 for z in seen), seen          # 2 blocks + the LM head
    seen.clear()
    heads.eval()
    heads.draft_logits(1, h, path)
    assert all(z == 0.0 for z in seen)


def test_hydra_pp_prefix_layer_ends_in_its_own_rmsnorm(tiny_model, tmp_path):
    model, _ = tiny_model
    heads = draft_heads("hydra_pp", model, torch.arange(10))
    with torch.no_grad():
        heads.prefix_norm.weight.fill_(2.5)
        out = heads.read_hidden(torch.randn(2, 7, model.config.hidden_size), torch.arange(7).expand(2, 7))
    assert torch.allclose(out.pow(2).mean(-1).sqrt(), torch.full((2, 7), 2.5), atol=1e-3)
    # a checkpoint without the norm (the earlier layout) is refused, naming the missing weight
    from safetensors.torch import load_file, save_file

    heads.save(tmp_path / "h")
    state = load_file(str(tmp_path / "h" / "heads.safetensors"))
    del state["prefix_norm.weight"]
    save_file(state, str(tmp_path / "h" / "heads.safetensors"))
    with pytest.raises(ValueError, match="missing.*prefix_norm.weight"):
        load_heads(tmp_path / "h", model)


# -- each family learns and round-trips ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["medusa1", "hydra", "hydra_pp"])
def test_family_learns_and_reloads_identically(kind, tmp_path):
    model, tok = build_tiny_model(seed=0)
    train, val = loaders(tok, model, cache_dir=tmp_path / "cache")
    module, heads = make_module(kind, model)
    before = pl.Trainer(logger=False, **quiet_trainer_kwargs()).validate(module, val, verbose=False)[0]["val/loss"]
    trainer, best = fit_resumable(module, train, val, tmp_path / "ckpt", "fp", max_epochs=8,
                                  trainer_kwargs=quiet_trainer_kwargs())
    last_epoch = trainer.callback_metrics            # the last val epoch's (the module now holds the best epoch's)
    # Hydra++'s soft CE cannot go below the (random) teacher's entropy: a smaller drop is all there is
    assert last_epoch["val/loss"] < (0.95 if kind == "hydra_pp" else 0.8) * before
    after = trainer.validate(module, val, verbose=False)[0]
    assert 0.0 <= after["val/top1_head0"] <= after["val/top5_head0"] <= 1.0
    assert after["val/top1_head0"] == pytest.approx(max(best.history), abs=1e-4)
    heads.save(tmp_path / "heads")
    _, loaded = load_heads(tmp_path / "heads", model)
    heads.eval()
    h = torch.randn(2, 5, model.config.hidden_size)
    pos = torch.arange(5).expand(2, 5)
    path = torch.randint(0, model.config.vocab_size, (2, 5, 3))
    with torch.no_grad():
        a, b = heads.read_hidden(h, pos), loaded.read_hidden(h, pos)
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
    trainer, _ = fit_resumable(module, train, val, tmp_path / "ckpt", "fp", max_epochs=4,
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
    train, val = loaders(tok, model, n_train=12, batch_positions=50)     # 6 steps per epoch
    module, _ = make_module("hydra", model)
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit_resumable(module, train, val, tmp_path / "ckpt", "fp", max_epochs=2, trainer_kwargs=quiet_trainer_kwargs(),
                      callbacks=[Interrupt(5)], every_n_train_steps=2)
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["last.ckpt"]
    module, heads = make_module("hydra", model)                          # a fresh process would start like this
    first = FirstStep()
    trainer, _ = fit_resumable(module, train, val, tmp_path / "ckpt", "fp", max_epochs=2,
                               trainer_kwargs=quiet_trainer_kwargs(), callbacks=[first], every_n_train_steps=2)
    assert first.global_step == 4 and trainer.global_step == 12 and trainer.current_epoch == 2
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["last.ckpt"]
    # a finished run started again resumes to its final state and trains no further
    module2, heads2 = make_module("hydra", model)
    first = FirstStep()
    trainer, _ = fit_resumable(module2, train, val, tmp_path / "ckpt", "fp", max_epochs=2,
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
    cache = HiddenCache.build(model, ids, folder, batch_tokens=150, shard_size=3)
    stamps = {p: p.stat().st_mtime_ns for p in folder.glob("*.safetensors")}
    assert len(stamps) == 3
    again = HiddenCache.build(model, ids, folder, batch_tokens=150, shard_size=3)
    assert {p: p.stat().st_mtime_ns for p in folder.glob("*.safetensors")} == stamps
    with torch.no_grad():
        ref = model.get_decoder()(input_ids=torch.tensor([ids[4]])).last_hidden_state[0]
    assert torch.allclose(cache[4], ref, atol=1e-5) and torch.equal(cache[4], again[4])
    assert cache_key(model, ids[:-1]) != cache_key(model, ids)


def test_hidden_cache_batches_sequences_of_different_lengths_without_changing_them(tmp_path):
    """Length-sorted batches, right-padded without a mask: every sequence's rows equal its own forward."""
    from models.shared.hidden_cache import length_batches

    model, tok = build_tiny_model(seed=0)
    ids = [x[:n] for x, n in zip(examples(tok, 6)[0], (52, 9, 30, 31, 17, 44))]
    cache = HiddenCache.build(model, ids, tmp_path / "c", batch_tokens=100, shard_size=4)
    with torch.no_grad():
        for i, seq in enumerate(ids):
            ref = model.get_decoder()(input_ids=torch.tensor([seq])).last_hidden_state[0]
            assert torch.allclose(cache[i], ref, atol=1e-5), i
    rows = torch.tensor([0, 51, 52, 60])                      # rows of the sequences laid end to end
    assert torch.equal(cache.rows(rows), torch.cat([cache[0], cache[1]])[[0, 51, 52, 60]])
    assert torch.equal(cache.first(2)[1], cache[1]) and len(cache.first(2)) == 2
    lengths = [3, 5, 5, 8, 20, 30]
    batches = length_batches(lengths, batch_tokens=16)
    assert sum(batches, []) == list(range(6))
    assert all(len(b) * max(lengths[i] for i in b) <= 16 or len(b) == 1 for b in batches)


# -- the stage ------------------------------------------------------------------------------------


@pytest.fixture
def stage_cfg(compose_cfg, monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

    def make(heads):
        cfg = compose_cfg("profile=smoke", f"+select.heads={heads}", "profile.train.batch_positions=100",
                          "profile.train.draft_vocab_size=64",
                          "profile.train.max_length=96", "profile.train.progress_bar=false",
                          "profile.train.log_every_n_steps=1")
        from pipelines.common import apply_selection
        cfg = apply_selection(cfg)
        save_distilled(cfg.data.distilled_dir)
        return cfg
    return make


def test_train_stage_writes_heads_metrics_and_reuses_the_cache(stage_cfg, tmp_path):
    from pipelines.train import run_train

    cfg = stage_cfg("hydra_pp")
    assert cfg.heads.name == "hydra_pp" and cfg.heads.share_lm_head is True
    metrics = run_train(cfg)
    assert set(metrics["val_top1"]) == {f"head{k}" for k in range(cfg.heads.num_heads)}
    saved = json.loads((tmp_path / "reports" / "metrics" / "train_hydra_pp.json").read_text())
    # 8 conversations of 25 target positions in batches of >= 100: 2 steps in the smoke profile's 1 epoch
    assert saved["val_top1"] == metrics["val_top1"] and saved["steps"]["fit"] == 2
    assert saved["best_epoch"] == {"fit": 1} and saved["train_positions_per_s"]["fit"] > 0
    assert saved["val_top1_head0_by_epoch"]["fit"] == [pytest.approx(saved["val_top1"]["head0"], abs=1e-4)]
    assert saved["train_targets_head0"] == 8 * 25 and saved["draft_vocab_size"] == 64
    assert 0.5 < saved["draft_vocab_val_coverage"] <= 1.0
    model, tok = build_tiny_model()
    _, heads = load_heads(tmp_path / "results" / "heads" / "hydra_pp", model)
    assert heads.config.family == "hydra_pp" and heads.prefix_layer is not None
    assert heads.config.shared_blocks and heads.blocks[0][1] is heads.blocks[0][3]   # the authors' shared block
    train_labels = [tokenize_conversation(tok, m, 96)[1] for m in conversations(8, 0)]
    assert torch.equal(heads.draft_ids, most_frequent(answer_token_counts(train_labels, len(tok)), 64))
    shards = {p: p.stat().st_mtime_ns for p in (tmp_path / "results" / "cache" / "hidden").rglob("*.safetensors")}
    assert shards
    metrics = run_train(stage_cfg("medusa2"))      # stage 1 + stage 2, on the same cache
    # stage 1 on random positions: 25 + 3 windows per conversation (the 3 before the answer feed heads 1-3)
    # in batches of 100 -> 3 steps; stage 2 on the 8 joint conversations -> 2 steps
    assert metrics["steps"] == {"stage1": 3, "stage2": 2}
    # the joint stage's curve (one validation at its end here) and how far the adapters moved the backbone
    assert [p["step"] for p in metrics["joint_curve"]] == [2]
    assert metrics["joint_curve"][0]["positions"] == 8 * 25
    assert metrics["joint_curve"][0]["val_top1_head0"] == pytest.approx(metrics["val_top1_head0_by_epoch"]["stage2"][-1])
    assert metrics["val_answer_perplexity_base"] > 1 and metrics["val_answer_perplexity_adapted"] > 1
    assert metrics["joint_train_examples"] == 8
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "results" / "cache" / "hidden").rglob("*.safetensors")} == shards
    assert (tmp_path / "results" / "heads" / "medusa2" / "adapter").is_dir()
    # the resolved recipe beside each trained module and in its MLflow run
    for name, kind, typed in (("hydra_pp", "hydra_pp", "Recipe"), ("medusa2", "medusa2", "Medusa2Recipe")):
        record = json.loads((tmp_path / "results" / "heads" / name / "recipe.json").read_text())
        assert record["recipe"]["kind"] == kind and record["recipe_type"] == typed and record["profile"] == "smoke"
        assert record["epochs"] >= 1 and set(record["stage"]) == {"epochs", "stage1_fraction", "lora"}
    assert ("medusa_lambda" in record["recipe"]) and len(list((tmp_path / "mlruns").rglob("artifacts/recipe.json"))) == 2
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
    assert resolve_precision("auto", "cpu", cpuinfo=amx, cpu_fp32=True) == "32-true"    # heads faster in float32
    assert resolve_precision("auto", "gpu", cpuinfo=amx, cpu_fp32=True) == "bf16-mixed"  # ... on a CPU only


def test_cpu_trainer_keeps_the_heads_it_names_in_float32(compose_cfg):
    """trainer=cpu's cpu_fp32_heads: `auto` gives Hydra++ float32 on any CPU; an explicit precision still wins."""
    from pipelines.common import apply_selection
    from pipelines.train import trainer_precision

    def precision(name, *overrides):
        return trainer_precision(apply_selection(compose_cfg(f"+select.heads={name}", "trainer=cpu", *overrides)))

    assert precision("hydra_pp") == "32-true"
    assert precision("hydra_pp", "trainer.precision=bf16-mixed") == "bf16-mixed"
    assert precision("hydra") == resolve_precision("auto", "cpu")   # the hardware decides for the others


# -- the methods' list -----------------------------------------------------------------------------


def test_a_new_family_is_one_class_one_entry_and_one_config(stage_cfg, tmp_path, monkeypatch):
    """A family that reads h_t and the parent token only (not the whole path, as Hydra does): one class, one entry in
    models.methods.METHODS, described by one conf/heads YAML; it trains through the stage, saves, reloads and decodes
    losslessly."""
    from omegaconf import open_dict

    import models.methods
    from models.engine.decoding import generate
    from models.engine.trees import tree_from_config
    from models.methods.hydra.family import Hydra, HydraInputBlock
    from models.methods.hydra.proposer import HydraProposer
    from models.methods.hydra.training import HydraModule
    from models.shared.method import Method, RecipeKind
    from pipelines.train import run_train

    class ParentToken(Hydra):
        name = "parent_token"

        def build_blocks(self, hidden, num_heads, num_layers):
            return nn.ModuleList([nn.Sequential(HydraInputBlock(hidden, 2)) for _ in range(num_heads)])

        def head_input(self, k, hidden, path_tokens, embed):
            return torch.cat([hidden, embed(path_tokens[..., -1]).to(hidden.dtype)], dim=-1)

    parent = Method(name="parent_token", family=ParentToken(), proposer=HydraProposer,
                    recipes=(RecipeKind("hydra", HydraModule),))
    monkeypatch.setattr(models.methods, "METHODS", (*models.methods.METHODS, parent))
    (tmp_path / "parent_token.yaml").write_text(
        "name: parent_token\nfamily: parent_token\nnum_heads: 3\nnum_layers: 1\ndropout: 0.0\n"
        "share_lm_head: true\nrecipe: {kind: hydra, lr: 1.0e-3, head_decay: 1.0}\n")
    cfg = stage_cfg("hydra")
    with open_dict(cfg):
        cfg.heads = OmegaConf.load(tmp_path / "parent_token.yaml")
    metrics = run_train(cfg)
    assert metrics["family"] == "parent_token" and set(metrics["val_top1"]) == {"head0", "head1", "head2"}
    model, tok = build_tiny_model()
    model, heads = load_heads(tmp_path / "results" / "heads" / "parent_token", model)
    assert isinstance(heads.family, ParentToken) and heads.blocks[2][0].linear.in_features == 2 * 64
    tree = tree_from_config({"kind": "paths", "top_k": 3, "paths": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]})
    ids = tok("<|im_start|>user\ncount: 1 2 3 4 5 6<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    want = generate(model, tok, ids, max_new_tokens=24, stop_token_ids=[])
    got = generate(model, tok, ids, heads_drafter(heads, tree), max_new_tokens=24, stop_token_ids=[])
    assert got.new_tokens == want.new_tokens and got.steps <= want.steps
    bad = OmegaConf.load(tmp_path / "parent_token.yaml")
    bad.recipe.kind = "medusa2"
    with open_dict(cfg):
        cfg.heads = bad
    with pytest.raises(ValueError, match="does not train the 'parent_token' family"):
        run_train(cfg)


def test_unknown_family_and_recipe_name_the_known_ones(tiny_model):
    model, _ = tiny_model
    with pytest.raises(ValueError, match=r"heads family 'medusa3' is not known; use one of \['dflash', 'draft_model', 'dspark', 'dspark_gated', "
                       r"'dspark_rnn', 'eagle', 'eagle3', 'hydra', 'hydra_pp', 'medusa'"):
        build_heads(HeadsConfig.for_base(model, "medusa3", 2), model)
    with pytest.raises(ValueError, match=r"recipe kind 'hydra3' is not known; use one of \['dflash', 'draft_model', 'dspark', 'eagle', 'eagle3', 'hydra', 'hydra_pp', 'medusa1', "
                       r"'medusa2'\]"):
        new_recipe(kind="hydra3")


def test_each_recipe_kind_has_its_own_fields_checked_when_made():
    """One dataclass per kind's needs: a field another kind has is refused, a bad value names the field, the value
    and what is accepted; a heads-only stage of Medusa-2 keeps the fields both kinds share."""
    from models.methods import make_recipe
    from models.methods.medusa.training import Medusa2Recipe
    from models.shared.autoregressive.training import AutoregressiveRecipe
    from models.shared.recipes import recast

    assert type(new_recipe(kind="hydra")) is Recipe and type(new_recipe(kind="medusa2")) is Medusa2Recipe
    assert type(make_recipe({"kind": "eagle3", "unroll": 3})) is AutoregressiveRecipe
    with pytest.raises(ValueError, match=r"recipe 'medusa1' \(Recipe\) takes no unroll; it takes head_decay"):
        new_recipe(kind="medusa1", unroll=2)
    with pytest.raises(ValueError, match=r"recipe 'eagle': unroll=0 is not accepted; unroll takes a whole number"):
        new_recipe(kind="eagle", unroll=0)
    with pytest.raises(ValueError, match=r"lambda_schedule='linear' is not accepted; lambda_schedule takes sine or"):
        new_recipe(kind="medusa2", lambda_schedule="linear")
    with pytest.raises(ValueError, match=r"warmup_ratio=1.5 is not accepted; warmup_ratio takes a number in \[0, 1\]"):
        new_recipe(kind="hydra", warmup_ratio=1.5)
    joint = new_recipe(kind="medusa2", lr=1e-4, head_lr_multiplier=4.0, weight_decay=0.1)
    heads_only = recast(joint, Recipe, "medusa1", lr=4e-4)
    assert type(heads_only) is Recipe and (heads_only.kind, heads_only.lr, heads_only.weight_decay) == ("medusa1", 4e-4, 0.1)


def test_a_recipe_plans_its_own_stages():
    from models.methods.hydra.training import HydraModule
    from models.methods.medusa.training import Medusa2Module
    from models.shared.schedules import plan_stages

    fit = plan_stages(HydraModule, new_recipe(kind="hydra", lr=1e-3), epochs=4)
    assert [(p.name, p.epochs, p.loader_kind, p.lora) for p in fit] == [("fit", 4, "hydra", None)]
    lora = {"r": 32, "alpha": 16, "dropout": 0.05}
    joint = new_recipe(kind="medusa2", lr=1e-4, head_lr_multiplier=4.0)
    s1, s2 = plan_stages(Medusa2Module, joint, epochs=3, stage1_fraction=0.67, lora=lora, joint_limit=192, joint_val_every=20)
    assert (s1.name, s1.epochs, s1.recipe.kind, s1.loader_kind, s1.lora) == ("stage1", 2, "medusa1", "medusa1", None)
    assert s1.recipe.lr == pytest.approx(4e-4)                         # the heads' learning rate when alone
    assert (s2.name, s2.epochs, s2.recipe, s2.limit, s2.val_every, s2.lora) == ("stage2", 1, joint, 192, 20, lora)
    assert [p.name for p in plan_stages(Medusa2Module, joint, epochs=2, lora=lora)] == ["stage2"]   # no heads-only
    with pytest.raises(ValueError, match="trains the backbone through LoRA"):
        plan_stages(Medusa2Module, joint, epochs=2)
