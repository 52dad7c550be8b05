"""DFlash's mask token (heads.mask_token_id): by default the drafter's own token, id vocab_size, embedded by a learned
row that starts at the mean of the base's rows and is trained; an id of the base takes the base's frozen row; a bad
id is refused by name; the heads save and load it; decoding stays lossless; the formats that embed the mask with the
base's table refuse the own token."""
from __future__ import annotations

import json

import pytest
import torch

from models.base import build_tiny_model
from models.engine.decoding import generate
from models.engine.drafting import heads_drafter
from models.engine.trees import chain_tree
from models.methods import build_heads, export_heads, load_heads
from models.shared import HeadsConfig
from tests.test_decoding import cyclic_prompt
from tests.test_dflash import TREE, dflash_heads

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_default_mask_is_the_drafters_own_token_at_the_mean_of_the_base_rows():
    model, _ = build_tiny_model(seed=0)
    V, module = model.config.vocab_size, dflash_heads(model).dflash
    table = model.get_input_embeddings().weight
    assert module.mask_token_id == V and module.own_mask
    torch.testing.assert_close(module.mask_embedding.detach(), table.mean(0))
    assert "mask_embedding" in dict(module.named_parameters())
    ids = torch.tensor([[4, V, V, 7]])
    x = module.embed(ids)
    torch.testing.assert_close(x[0, 1], module.mask_embedding.detach())
    torch.testing.assert_close(x[0, [0, 3]], table[[4, 7]])


def test_the_gradient_reaches_the_mask_embedding_and_not_the_base_rows():
    model, _ = build_tiny_model(seed=0)
    module = dflash_heads(model).dflash.train()
    V, bs = model.config.vocab_size, module.block_size
    feats = torch.randn(1, 5, module.fc.in_features, generator=torch.Generator().manual_seed(0))
    block = torch.tensor([[9] + [V] * (bs - 1)])
    out = module(feats, block, torch.arange(5 + bs)[None])
    (out * torch.randn_like(out)).sum().backward()
    assert module.mask_embedding.grad is not None and module.mask_embedding.grad.abs().sum() > 0
    assert model.get_input_embeddings().weight.grad is None


def test_a_base_id_takes_the_bases_frozen_row():
    model, _ = build_tiny_model(seed=0)
    module = dflash_heads(model, mask_token_id=5).dflash
    assert module.mask_token_id == 5 and not module.own_mask
    assert not any("mask" in n for n, _ in module.named_parameters())
    torch.testing.assert_close(module.embed(torch.tensor([[5]]))[0, 0], model.get_input_embeddings().weight[5])


@pytest.mark.parametrize("bad", [-1, 10 ** 9, 2.5, True])
def test_a_mask_id_outside_the_vocabulary_is_refused_naming_it(bad):
    model, _ = build_tiny_model(seed=0)
    V = model.config.vocab_size
    with pytest.raises(ValueError, match=rf"heads.mask_token_id={bad!r} is not accepted; it takes null .* to {V - 1}"):
        HeadsConfig.for_base(model, "dflash", num_heads=3, share_lm_head=True, mask_token_id=bad)
    with pytest.raises(ValueError, match=r"heads.mask_token_id=.* is not accepted"):
        HeadsConfig.for_base(model, "dflash", num_heads=3, share_lm_head=True, mask_token_id=V)


def test_a_family_without_a_block_refuses_the_block_settings():
    model, _ = build_tiny_model(seed=0)
    for extra in ({"mask_token_id": 3}, {"sample_from_anchor": True}):
        config = HeadsConfig.for_base(model, "medusa", num_heads=2, **extra)
        with pytest.raises(ValueError, match="block drafter's .* family 'medusa' takes neither"):
            build_heads(config, model)


def test_the_heads_save_and_load_their_mask(tmp_path):
    model, _ = build_tiny_model(seed=0)
    heads = dflash_heads(model)
    with torch.no_grad():
        heads.dflash.mask_embedding.normal_()                     # as trained: off its start
    heads.save(tmp_path / "own")
    _, loaded = load_heads(tmp_path / "own", model)
    assert loaded.dflash.mask_token_id == model.config.vocab_size
    assert torch.equal(loaded.dflash.mask_embedding, heads.dflash.mask_embedding)
    dflash_heads(model, mask_token_id=5).save(tmp_path / "base")
    _, loaded = load_heads(tmp_path / "base", model)
    assert loaded.dflash.mask_token_id == 5 and not loaded.dflash.own_mask
    # a folder from before the setting: its drafter was trained on the base's last id
    config = json.loads((tmp_path / "base" / "heads_config.json").read_text())
    del config["mask_token_id"], config["sample_from_anchor"]
    (tmp_path / "base" / "heads_config.json").write_text(json.dumps(config))
    _, loaded = load_heads(tmp_path / "base", model)
    assert loaded.dflash.mask_token_id == model.config.vocab_size - 1


@pytest.mark.parametrize("tree", [chain_tree(7), TREE], ids=["chain", "tree"])
def test_greedy_decoding_with_the_own_mask_equals_the_baseline(tree):
    model, tok = build_tiny_model(seed=0)
    heads = dflash_heads(model)
    with torch.no_grad():
        heads.dflash.mask_embedding.normal_(0.0, 3.0)             # a mask that moves the drafts
    ids = cyclic_prompt(model, tok, known=12)
    base = generate(model, tok, ids, max_new_tokens=24, stop_token_ids=[])
    assert generate(model, tok, ids, heads_drafter(heads, tree), max_new_tokens=24,
                    stop_token_ids=[]).new_tokens == base.new_tokens


@pytest.mark.parametrize("fmt", ["dflash", "speculators"])
def test_the_formats_refuse_the_own_mask_naming_the_setting(tmp_path, fmt):
    model, _ = build_tiny_model("llama", num_layers=8, seed=0)
    heads = dflash_heads(model, block=16)
    with pytest.raises(ValueError, match=rf"export.format={fmt} embeds the mask .*heads.mask_token_id=null"):
        export_heads(heads, model, tmp_path / fmt, fmt)
    assert not (tmp_path / fmt / "model.safetensors").exists()
