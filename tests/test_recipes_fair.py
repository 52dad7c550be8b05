"""Recipes that treat every method alike (docs/protocol.md, the recipe table): the cpu profile departs from each
conf/heads/<name>.yaml only by the rules every method gets; Hydra++ is the authors' (one ResBlock shared by blocks
1..3 of a head, the teacher loss alone, dropout 0.2) and the project's variant is heads=hydra_pp_plus; EAGLE-1's
input noise is as wide as the authors' trainer makes it for each row's length; Medusa-2 is the authors' two-stage
recipe."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from models.shared import HeadsConfig
from models.methods import build_heads, load_heads
from models.methods.eagle.eagle import EagleModule
from models.methods import new_recipe, recipe_kind

FRESH_LR = 1e-3          # the lr rule: fresh drafter weights train at this at least


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _heads(compose_cfg, name: str, profile: str = "cpu"):
    from pipelines.common import apply_selection
    from pipelines.recipes import with_profile_heads

    raw = apply_selection(compose_cfg(f"+select.heads={name}", f"profile={profile}"))
    return raw, with_profile_heads(raw)


def test_the_cpu_profile_departs_from_each_recipe_only_by_the_rules_every_method_gets(compose_cfg):
    """Every change profile.train.heads_overrides makes is one of the table's rules: an lr below 1e-3 raised to
    1e-3, Medusa-2's stage split by the epoch cap, EAGLE-3's teacher term at every position. No dropout, loss
    weight or architecture is changed for one method."""
    from pipelines.common import heads_options
    from pipelines.recipes import make_recipe

    allowed = {"recipe.lr", "recipe.stage1_fraction", "recipe.draft_vocab_mask"}
    for name in heads_options():
        if name == "none":
            continue
        raw, merged = _heads(compose_cfg, name)
        before = _flat(OmegaConf.to_container(raw.heads, resolve=True))
        after = _flat(OmegaConf.to_container(merged.heads, resolve=True))
        changed = {k for k in after if before.get(k) != after[k]}
        assert changed <= allowed, (name, changed - allowed)
        if "recipe.lr" in changed:
            assert before["recipe.lr"] < FRESH_LR and after["recipe.lr"] == pytest.approx(FRESH_LR), name
        if "recipe.stage1_fraction" in changed:
            assert name == "medusa2"
        if "recipe.draft_vocab_mask" in changed:
            assert after["recipe.draft_vocab_mask"] is False
        recipe = make_recipe(merged)
        fresh_lr = recipe.lr * getattr(recipe, "head_lr_multiplier", 1.0)   # Medusa-2: its heads' lr
        if name != "sps":            # the draft model's layers start as the base's: not fresh weights
            assert fresh_lr >= FRESH_LR - 1e-12, (name, fresh_lr)


def test_hydra_pp_is_the_authors_and_the_projects_variant_has_its_own_name(compose_cfg):
    from pipelines.recipes import make_recipe

    _, pp = _heads(compose_cfg, "hydra_pp")
    r = make_recipe(pp)
    assert (pp.heads.dropout, pp.heads.shared_blocks, r.lm_loss_weight, r.teacher_loss_weight) == (0.2, True, 0.0, 1.0)
    assert r.lr == pytest.approx(1e-3) and r.weight_decay == pytest.approx(0.1)
    _, plus = _heads(compose_cfg, "hydra_pp_plus")
    r = make_recipe(plus)
    assert (plus.heads.dropout, plus.heads.shared_blocks, r.lm_loss_weight, r.teacher_loss_weight) == (0.1, False, 1.0, 1.0)
    assert r.lr == pytest.approx(1e-3) and plus.heads.family == "hydra_pp"
    _, paper = _heads(compose_cfg, "hydra_pp", profile="paper")
    assert make_recipe(paper).lr == pytest.approx(5e-4)                        # the published lr on the paper profile


def test_medusa2_is_the_authors_two_stage_recipe(compose_cfg):
    """lambda 0.2 constant, CE to the labels, lr 5e-4 with the heads at 4x; 2 + 2 epochs on the paper profile,
    2 heads-only + 1 joint under the cpu profile's cap of 3."""
    from models.shared.schedules import plan_stages
    from pipelines.recipes import effective_epochs, make_recipe

    for profile, epochs in (("paper", [2, 2]), ("cpu", [2, 1])):
        _, cfg = _heads(compose_cfg, "medusa2", profile=profile)
        r = make_recipe(cfg)
        assert (r.medusa_lambda, r.lambda_schedule, r.lm_loss) == (0.2, "constant", "ce")
        assert r.lr == pytest.approx(5e-4) and r.lr * r.head_lr_multiplier == pytest.approx(2e-3)
        plans = plan_stages(recipe_kind(r.kind).module, r, effective_epochs(cfg), float(cfg.heads.recipe.stage1_fraction),
                            lora=OmegaConf.to_container(cfg.heads.recipe.lora))
        assert [p.epochs for p in plans] == epochs and plans[0].recipe.lr == pytest.approx(2e-3), profile


def test_shared_blocks_give_a_hydra_pp_head_two_distinct_blocks_that_save_and_load(tiny_model, tmp_path):
    """shared_blocks: blocks 1..3 of each 4-layer head are one module (the authors' `[ResBlock] * (L - 1)`), so a
    head has 2 distinct blocks; training one changes all three places, and a saved copy loads back shared and
    drafting the same logits."""
    model, _ = tiny_model
    config = HeadsConfig.for_base(model, "hydra_pp", num_heads=2, num_layers=4, shared_blocks=True)
    heads = build_heads(config, model).eval()
    distinct = build_heads(HeadsConfig.for_base(model, "hydra_pp", num_heads=2, num_layers=4), model)
    assert heads.blocks[0][1] is heads.blocks[0][2] is heads.blocks[0][3] and heads.blocks[0][0] is not heads.blocks[0][1]
    assert heads.blocks[0][1] is not heads.blocks[1][1]                          # shared within a head only
    h = model.config.hidden_size
    per_block = h * h + h
    assert sum(p.numel() for p in distinct.blocks.parameters()) - sum(p.numel() for p in heads.blocks.parameters()) \
        == 2 * 2 * per_block                                                     # 2 fewer blocks in each of 2 heads
    with torch.no_grad():
        heads.blocks[0][1].linear.weight.normal_(0, 0.05)
    hidden, path = torch.randn(3, h), torch.randint(0, model.config.vocab_size, (3, 1))
    heads.save(tmp_path)
    _, back = load_heads(tmp_path, model)
    assert back.config.shared_blocks and back.blocks[0][1] is back.blocks[0][3]
    torch.testing.assert_close(back.draft_logits(0, hidden, path), heads.draft_logits(0, hidden, path))


def test_a_shared_blocks_that_is_not_true_or_false_is_refused(tiny_model):
    model, _ = tiny_model
    with pytest.raises(ValueError, match=r"shared_blocks='yes' is not accepted; it takes true .* or false"):
        HeadsConfig.for_base(model, "hydra_pp", num_heads=2, num_layers=4, shared_blocks="yes")


def test_eagle_noise_is_as_wide_as_the_authors_make_it_at_each_length():
    """EAGLE's trainer: U(-0.5, 0.5) x 0.2 x 512 / T for a conversation of T tokens: width 0.4 at 256 tokens,
    0.2 at 512; a fixed width without noise_reference_length."""
    r = new_recipe(kind="eagle", feature_noise=0.2, noise_reference_length=512)
    assert r.noise_width(256) == pytest.approx(0.4) and r.noise_width(512) == pytest.approx(0.2)
    torch.testing.assert_close(r.noise_width(torch.tensor([256, 384])), torch.tensor([0.4, 0.2 * 512 / 384]))
    assert new_recipe(kind="eagle", feature_noise=0.2).noise_width(256) == 0.2


def test_unroll_adds_each_row_its_own_noise_width(tiny_model):
    """The noise unroll adds to the input features lies within +-width/2 of each row, and reaches near it."""
    model, _ = tiny_model
    eagle = EagleModule.from_base(model, seed=0)
    seen = []
    eagle.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
    T, h = 40, model.config.hidden_size
    widths = new_recipe(kind="eagle", feature_noise=0.2, noise_reference_length=512).noise_width(torch.tensor([256, 512]))
    torch.manual_seed(0)
    eagle.unroll(torch.zeros(2, T, h), torch.zeros(2, T, dtype=torch.long), depths=1, noise=widths)
    reach = seen[0].abs().amax(dim=(1, 2))                                       # [2]: each row's largest draw
    assert bool((reach <= widths / 2).all()) and bool((reach > 0.95 * widths / 2).all()), reach


def test_the_eagle_trainer_reads_each_rows_length(tiny_model, monkeypatch):
    """AutoregressiveFitModule passes recipe.noise_width(batch lengths) to unroll while training, no noise in eval;
    collate gives every row its own length."""
    from models.shared.autoregressive.training import AutoregressiveFitModule
    from models.shared.head_data import collate

    model, _ = tiny_model
    heads = build_heads(HeadsConfig.for_base(model, "eagle", num_heads=2, share_lm_head=True), model)
    recipe = new_recipe(kind="eagle", feature_noise=0.2, noise_reference_length=512, feature_loss_weight=1.0,
                    teacher_loss_weight=0.1, lm_loss_weight=0.0)
    fit = AutoregressiveFitModule(heads, model, recipe)
    batch = collate([{"input_ids": torch.arange(2, 2 + n), "labels": torch.arange(2, 2 + n)} for n in (8, 16)])
    assert batch["lengths"].tolist() == [8, 16]
    noises = []
    module = heads.draft_module
    unroll = module.unroll
    monkeypatch.setattr(module, "unroll", lambda *a: noises.append(a[3]) or unroll(*a))
    fit.train()
    fit.compute(batch)
    fit.eval()
    fit.compute(batch)
    torch.testing.assert_close(noises[0], torch.tensor([0.2 * 512 / 8, 0.2 * 512 / 16]))
    assert noises[1] == 0.0


@pytest.mark.parametrize("value,message", [
    (0, "noise_reference_length=0 is not accepted; noise_reference_length takes null"),
    (1.5, "noise_reference_length=1.5 is not accepted"),
    (True, "noise_reference_length=True is not accepted"),
])
def test_a_bad_noise_reference_length_is_refused_naming_it(value, message):
    with pytest.raises(ValueError, match=message):
        new_recipe(kind="eagle", feature_noise=0.2, noise_reference_length=value)


def test_noise_reference_length_belongs_to_the_autoregressive_recipes():
    with pytest.raises(ValueError, match="takes no noise_reference_length"):
        new_recipe(kind="hydra", noise_reference_length=512)
