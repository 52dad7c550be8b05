"""EAGLE as a head family (models/methods/eagle/family.py Eagle, models/shared/autoregressive/training.py): it learns and
round-trips through load_heads with its draft vocabulary, decodes losslessly through the same drafters as the
other families (a tree, a tree cut per step by cost, prompt lookup merged in), calibration ranks it along its
own drafts, and the train stage trains it from conf/heads/eagle.yaml (tiny model, synthetic data)."""
from __future__ import annotations

import json

import pytest
import pytorch_lightning as pl
import torch

from models.base import build_tiny_model
from models.engine.decoding import generate
from models.engine.drafting import heads_drafter, make_drafter
from models.engine.fast_inference import prepare_heads_for_decoding
from models.shared import HeadsConfig
from models.methods import build_heads, load_heads
from models.shared.draft_vocab import most_frequent
from models.shared.fitting import fit_resumable
from models.measure.calibration import sequence_ranks
from models.methods import new_recipe, recipe_kind
from tests.test_decoding import TREES, cyclic_prompt
from tests.test_training import loaders, quiet_trainer_kwargs, stage_cfg  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def eagle_heads(model, depths=3, vocab=48, seed=0):
    """Eagle heads over the `vocab` lowest token ids (the tiny tokenizer's common ones come first)."""
    torch.manual_seed(seed)
    config = HeadsConfig.for_base(model, "eagle", num_heads=depths, share_lm_head=True, draft_vocab_size=vocab)
    counts = torch.arange(model.config.vocab_size, 0, -1)
    return build_heads(config, model, most_frequent(counts, vocab))


def test_eagle_heads_learn_every_depth_and_reload_identically(tmp_path):
    model, tok = build_tiny_model(seed=0)
    model.requires_grad_(False)
    train, val = loaders(tok, model, cache_dir=tmp_path / "cache")
    heads = eagle_heads(model, vocab=model.config.vocab_size // 2).requires_grad_(True)
    assert {k.split(".")[0] for k in heads.state_dict()} == {"eagle", "draft_ids"}     # base parts by reference
    recipe = new_recipe(kind="eagle", lr=1e-2, warmup_ratio=0.0, feature_loss_weight=1.0, teacher_loss_weight=0.1,
                    lm_loss_weight=0.0, feature_noise=0.2, unroll=2)
    module = recipe_kind("eagle").module(heads, model, recipe)
    batch = next(iter(val))

    def feature_errors():                    # per depth: SmoothL1 of the draft to the base's feature it predicts
        with torch.no_grad():
            preds = heads.eval().eagle.unroll(batch["hidden"], batch["input_ids"], 2)
        return [float(torch.nn.functional.smooth_l1_loss(p[:, :-k - 1], batch["hidden"][:, k + 1:-1]))
                for k, p in enumerate(preds)]

    before_errors = feature_errors()
    before = pl.Trainer(logger=False, **quiet_trainer_kwargs()).validate(module, val, verbose=False)[0]
    trainer, best = fit_resumable(module, train, val, tmp_path / "ckpt", "fp", max_epochs=6,
                                  trainer_kwargs=quiet_trainer_kwargs())
    after = trainer.validate(module, val, verbose=False)[0]
    assert after["val/loss"] < 0.8 * before["val/loss"]
    for k in range(3):                       # every depth measured
        assert 0.0 <= after[f"val/top1_head{k}"] <= after[f"val/top5_head{k}"] <= 1.0
    assert all(a < 0.8 * b for a, b in zip(feature_errors(), before_errors))    # both trained depths learned
    heads.save(tmp_path / "heads")
    _, loaded = load_heads(tmp_path / "heads", model)
    heads.eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    hidden = torch.randn(2, 9, model.config.hidden_size)
    with torch.no_grad():
        for a, b in zip(heads.eagle.unroll(hidden, ids, 3), loaded.eagle.unroll(hidden, ids, 3), strict=True):
            assert torch.equal(heads.lm_head(0, a), loaded.lm_head(0, b))
    assert torch.equal(loaded.draft_ids, heads.draft_ids)


@pytest.mark.parametrize("how", ["tree", "cut", "lookup", "packed"])
def test_greedy_eagle_heads_equal_the_baseline(how):
    """Through the drafters every family uses: a fixed tree, the tree cut per step by cost, prompt lookup's
    chain merged in (a repetitive prompt, so that lookups and drafts get accepted), and the tree with the
    layer's linears packed for decoding as the evaluation runs them."""
    model, tok = build_tiny_model(seed=3)
    heads = eagle_heads(model, depths=4).eval()
    if how == "packed":
        assert prepare_heads_for_decoding(heads) >= 7          # q, k, v, o, gate, up, down (and fc, LM head)
    res, base, _ = greedy_through(how, model, tok, heads)
    assert res.new_tokens == base.new_tokens


def greedy_through(how: str, model, tok, heads):
    """(the answer through `how`'s drafter, the baseline's, the drafter) on a repetitive prompt, 40 tokens: "tree" and
    "packed" the sparse64 tree, "cut" that tree cut per step by a CPU-like cost, "lookup" chain4 with prompt
    lookup's chain merged in."""
    ids = cyclic_prompt(model, tok)
    base = generate(model, tok, ids, max_new_tokens=40, stop_token_ids=[])
    costs = [1.0 + 0.02 * n for n in range(80)]
    drafter = {"tree": heads_drafter(heads, TREES["sparse64"]), "packed": heads_drafter(heads, TREES["sparse64"]),
               "cut": heads_drafter(heads, TREES["sparse64"], step_cost=costs),
               "lookup": make_drafter({"kind": "heads_lookup", "tree": TREES["chain4"], "lookup": {"num_tokens": 6}},
                                      heads=heads)}[how]
    return generate(model, tok, ids, drafter, max_new_tokens=40, stop_token_ids=[]), base, drafter


def test_calibration_ranks_eagle_along_its_own_drafts():
    """sequence_ranks for eagle heads: depth d at position t is the rank of the base's greedy token after t+d
    in the LM head of the draft d steps along the true path (EagleModule.unroll, tested against the layer)."""
    model, tok = build_tiny_model(seed=1)
    heads = eagle_heads(model, depths=3, vocab=model.config.vocab_size).eval()
    prompt = cyclic_prompt(model, tok, known=10)
    ids = prompt + generate(model, tok, prompt, max_new_tokens=12, stop_token_ids=[]).new_tokens   # greedy throughout
    start = len(prompt) - 1
    ranks = sequence_ranks(model, heads, ids, start, top_k=10)
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=torch.tensor([ids])).last_hidden_state
        drafts = heads.eagle.unroll(hidden, torch.tensor([ids]), 3)
        greedy = model.get_output_embeddings()(hidden[0]).argmax(-1).tolist()    # [T]: g_{s+1} at s
    assert greedy[start:-1] == ids[start + 1:]
    top10 = lambda d, t: heads.to_token_ids(heads.lm_head(0, drafts[d - 1][0, t]).topk(10).indices).tolist()  # noqa: E731
    assert ranks_checked(ranks, ids, start, greedy, top10, depths=3) > 20


def ranks_checked(ranks, ids: list[int], start: int, greedy: list[int], top10, depths: int) -> int:
    """Asserts that ranks[i, d - 1] (position t = start + i, depth d) is the rank of the base's greedy token after t+d
    among top10(d, t), the draft's 10 best token ids there (10 when it is not among them; -1 past the answer).
    -> how many ranks were checked."""
    checked = 0
    for i, t in enumerate(range(start, len(ids) - 1)):
        for d in range(1, depths + 1):
            if t + d >= len(ids):                        # the base's token after t+d is not known
                assert ranks[i, d - 1] == -1
                continue
            top = top10(d, t)
            want = top.index(greedy[t + d]) if greedy[t + d] in top else 10
            assert int(ranks[i, d - 1]) == want, (t, d)
            checked += 1
    return checked


def test_the_train_stage_trains_eagle_from_its_config(stage_cfg, tmp_path):  # noqa: F811
    from pipelines.train import run_train

    cfg = stage_cfg("eagle")
    assert cfg.heads.family == "eagle" and cfg.heads.recipe.kind == "eagle"
    metrics = run_train(cfg)
    assert set(metrics["val_top1"]) == {f"head{k}" for k in range(cfg.heads.num_heads)}
    saved = json.loads((tmp_path / "reports" / "metrics" / "train_eagle.json").read_text())
    assert saved["family"] == "eagle" and saved["recipe"]["feature_loss_weight"] == 1.0
    model, _ = build_tiny_model()
    _, heads = load_heads(tmp_path / "results" / "heads" / "eagle", model)
    assert heads.family.autoregressive and heads.draft_ids.numel() == 64


# -- a small draft model (family draft_model, conf/heads/sps.yaml) ----------------------------------------------


def test_a_draft_model_of_every_base_layer_is_the_base_model_one_position_down():
    """DraftModel reads the pair (f_t, x_{t+1}) as the token x_{t+1} at position t: with all the base's layers it
    computes what the base computes over the sequence without its first token (rotary attention sees offsets)."""
    from models.methods.draft_model.draft_model import DraftModel, spread_layers

    model, tok = build_tiny_model(seed=2)
    L = model.config.num_hidden_layers
    assert spread_layers(L, L) == list(range(L)) and spread_layers(30, 2) == [0, 29] and spread_layers(30, 1) == [29]
    with pytest.raises(ValueError, match=f"1 to {L}"):
        spread_layers(L, L + 1)
    draft = DraftModel.from_base(model, num_layers=L)
    ids = torch.tensor([cyclic_prompt(model, tok, known=4)])
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state
        shifted = model.get_decoder()(input_ids=ids[:, 1:]).last_hidden_state
        torch.testing.assert_close(draft.unroll(hidden, ids, 1)[0], shifted, rtol=1e-4, atol=1e-4)


def test_draft_model_heads_distil_and_decode_losslessly(tmp_path):
    model, tok = build_tiny_model(seed=0)
    model.requires_grad_(False)
    train, val = loaders(tok, model, cache_dir=tmp_path / "cache")
    torch.manual_seed(0)
    config = HeadsConfig.for_base(model, "draft_model", num_heads=4, num_layers=1, share_lm_head=True)
    heads = build_heads(config, model).requires_grad_(True)
    assert {k.split(".")[0] for k in heads.state_dict()} == {"draft_model"}
    recipe = new_recipe(kind="draft_model", lr=1e-2, warmup_ratio=0.0, teacher_loss_weight=1.0, lm_loss_weight=0.0)
    module = recipe_kind("draft_model").module(heads, model, recipe)
    before = pl.Trainer(logger=False, **quiet_trainer_kwargs()).validate(module, val, verbose=False)[0]["val/loss"]
    trainer, _ = fit_resumable(module, train, val, tmp_path / "ckpt", "fp", max_epochs=4,
                               trainer_kwargs=quiet_trainer_kwargs())
    assert trainer.validate(module, val, verbose=False)[0]["val/loss"] < before   # soft CE to a random teacher
    heads.save(tmp_path / "heads")
    _, loaded = load_heads(tmp_path / "heads", model)
    ids = cyclic_prompt(model, tok)
    base = generate(model, tok, ids, max_new_tokens=30, stop_token_ids=[])
    for tree in ("chain4", "sparse64"):
        res = generate(model, tok, ids, heads_drafter(loaded.eval(), TREES[tree]), max_new_tokens=30, stop_token_ids=[])
        assert res.new_tokens == base.new_tokens


def test_the_draft_models_transformers_twin_drafts_for_assisted_generation():
    """to_causal_lm: the same layers as a transformers model (every token at its own position) — with all the
    base's layers it is the base; transformers' assisted generation with it reproduces greedy decoding, and the
    counted steps account for every new token after the prefill's."""
    from models.methods.draft_model.draft_model import DraftModel
    from models.measure.peers import assisted_generate

    model, tok = build_tiny_model(seed=2)
    full = DraftModel.from_base(model, num_layers=model.config.num_hidden_layers).to_causal_lm(model)
    ids = cyclic_prompt(model, tok, known=4)
    with torch.no_grad():
        torch.testing.assert_close(full(torch.tensor([ids])).logits, model(torch.tensor([ids])).logits,
                                   rtol=1e-4, atol=1e-4)
    small = DraftModel.from_base(model, num_layers=1).to_causal_lm(model)
    base = generate(model, tok, ids, max_new_tokens=20, stop_token_ids=[])
    for assistant in (full, small):
        res = assisted_generate(model, assistant, ids, max_new_tokens=20, num_tokens=3)
        assert res.new_tokens == base.new_tokens
        assert sum(res.accept_lengths) == len(res.new_tokens) - 1 and res.steps == len(res.accept_lengths)
    assert res.steps > 1
