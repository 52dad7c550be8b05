"""Every method on five base architectures whose decoder layers are not Llama's (tiny random models, float32):
Phi-3 (fused qkv_proj and gate_up_proj; here with partial rotary), OLMo-2 (norms after attention and MLP, none
before), Qwen3 (q/k norms), Gemma-2 (a sliding window shorter than the context, four norms a layer, GELU, soft-capped
logits) and Granite (scaled embeddings, residuals, attention and logits).

The taps (models/engine/taps.py) are each one's hidden states; EAGLE-3's layer is the same Llama layer on each, with
a Llama rotary embedding of its own; every method (Medusa-1, Medusa-2 over its merged adapter, Hydra, Hydra++,
EAGLE, EAGLE-3, the draft model) decodes greedily token for token as the base alone does, through the tree drafter
with prompt lookup merged in (so that several tokens are accepted at once); and every recipe trains on each (a
few optimiser steps lower its loss, every trainable weight gets a gradient)."""
from __future__ import annotations

import functools

import pytest
import torch

from models.base import build_tiny_model
from models.engine.decoding import generate
from models.engine.drafting import make_drafter
from models.engine.taps import LayerTaps
from models.shared import HeadsConfig
from models.methods import build_heads
from models.shared.draft_vocab import most_frequent
from models.methods.eagle.eagle3 import Eagle3Module
from models.shared.layer_config import layer_config
from models.shared.head_data import HeadsDataset, collate
from models.methods import new_recipe, recipe_kind
from tests.test_decoding import TREES, cyclic_prompt, perturbed
from tests.test_eagle3 import authors_init
from tests.test_training import examples

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 24                 # Gemma-2's sliding window: the prompts here are about 250 tokens
PHI3_ROPE = {"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.5}
ARCHS = {"phi3": dict(rope_parameters=PHI3_ROPE), "olmo2": {}, "qwen3": {}, "gemma2": dict(sliding_window=WINDOW),
         "granite": dict(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.2,
                         logits_scaling=2.0)}
# method -> (family, HeadsConfig options): the LM-head kinds and draft vocabularies the profiles use
METHODS = {"medusa1": ("medusa", dict(share_lm_head=True)), "medusa2": ("medusa", dict(share_lm_head=True)),
           "hydra": ("hydra", dict(share_lm_head=False)), "hydra_pp": ("hydra_pp", dict(share_lm_head=True)),
           "eagle": ("eagle", dict(share_lm_head=True)),
           "eagle3": ("eagle3", dict(share_lm_head=False, draft_vocab_size=64)),
           "sps": ("draft_model", dict(share_lm_head=True, num_layers=2))}


def base(arch, num_layers=2):
    return build_tiny_model(arch, seed=3, num_layers=num_layers, **ARCHS[arch])


def method_heads(model, method, num_heads=4, seed=0):
    """Fresh heads of `method` with every weight perturbed (so each code path matters)."""
    family, options = METHODS[method]
    vd = options.get("draft_vocab_size")
    ids = most_frequent(torch.arange(model.config.vocab_size, 0, -1), vd) if vd else None
    torch.manual_seed(seed)
    heads = build_heads(HeadsConfig.for_base(model, family, num_heads=num_heads, **options), model, ids)
    return perturbed(heads, seed)


def with_merged_adapter(model):
    """Medusa-2's base: a LoRA adapter on every linear (perturbed, so it changes the model), merged as load_heads
    merges a trained one."""
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return peft.merge_and_unload().eval()


# -- 1) the taps and EAGLE-3's layer --------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_the_taps_are_every_architectures_hidden_states(arch):
    """Hooks on the decoder layers by index give transformers' hidden_states[i]; the last tap, through the final
    norm, is the last hidden state."""
    model, _ = base(arch, num_layers=3)
    decoder = model.get_decoder()
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), LayerTaps(decoder, (2, 1, 3)) as tapped:
        hs = decoder(input_ids=ids, output_hidden_states=True).hidden_states
    h = model.config.hidden_size
    features = tapped.features()
    torch.testing.assert_close(features[..., :2 * h], torch.cat([hs[2], hs[1]], -1), rtol=0, atol=1e-6)
    torch.testing.assert_close(decoder.norm(features[..., 2 * h:]), hs[3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_eagle3s_layer_is_the_llama_layer_of_the_bases_sizes_with_its_own_rotary(arch):
    """The same parameter names and shapes as on a Llama base of the same sizes, the authors' init, the base's norm
    eps and rotary base; positions rotated by a Llama rotary of the layer's head_dim (Phi-3's own rotates half of
    it), so the layer's attention sees offsets only: the same rows at positions shifted by 7."""
    model, _ = base(arch)
    llama, _ = build_tiny_model("llama", seed=3)
    module, ref = Eagle3Module.from_base(model, seed=0), Eagle3Module.from_base(llama, seed=0)
    assert {k: v.shape for k, v in module.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
    authors_init(module)
    c = module.layer_config
    assert c.model_type == "llama" and c.hidden_act == "silu"
    assert (c.rms_norm_eps, c.rope_parameters["rope_theta"]) == (model.config.rms_norm_eps,
                                                                 model.config.rope_parameters["rope_theta"])
    assert c.to_dict() == layer_config(model.config).to_dict()
    g = torch.Generator().manual_seed(1)
    h = model.config.hidden_size
    taps, tokens = torch.randn(1, 6, 3 * h, generator=g), torch.randint(0, model.config.vocab_size, (1, 6), generator=g)
    pos = torch.arange(6)[None]
    cos, _ = module.rotary(taps, pos)
    assert cos.shape[-1] == c.head_dim
    if arch == "phi3":                                 # the base's rotary would not fit the layer's heads
        assert model.get_decoder().rotary_emb(taps, pos)[0].shape[-1] == c.head_dim // 2
    with torch.no_grad():
        torch.testing.assert_close(module(taps, tokens, pos + 7), module(taps, tokens, pos), rtol=1e-4, atol=1e-5)


# -- 2) lossless decoding -------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def decoding_setup(arch: str, merged: bool):
    """(model, tok, repetitive prompt, the base's greedy answer) of arch's tiny model (with a merged adapter)."""
    model, tok = base(arch)
    if merged:
        model = with_merged_adapter(model)
    prompt = cyclic_prompt(model, tok)
    return model, tok, prompt, generate(model, tok, prompt, max_new_tokens=40, stop_token_ids=[]).new_tokens


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_method_decodes_losslessly_on_every_architecture(arch, method):
    model, tok, prompt, want = decoding_setup(arch, method == "medusa2")
    assert len(prompt) > 8 * WINDOW
    heads = method_heads(model, method).eval()
    drafter = make_drafter({"kind": "heads_lookup", "tree": TREES["sparse64"], "lookup": {"num_tokens": 6}},
                           heads=heads)
    res = generate(model, tok, prompt, drafter, max_new_tokens=40, stop_token_ids=[])
    assert res.new_tokens == want
    assert len(res.new_tokens) == 1 + sum(res.accept_lengths)
    assert max(res.accept_lengths) > 1                 # steps that accepted drafts (and moved the caches by several)


# -- 3) training ----------------------------------------------------------------------------------------------------


RECIPES = {"medusa1": dict(), "medusa2": dict(lambda_schedule="constant"),
           "hydra": dict(), "hydra_pp": dict(teacher_loss_weight=1.0, lm_loss_weight=0.0),
           "eagle": dict(feature_loss_weight=1.0, teacher_loss_weight=0.1, lm_loss_weight=0.0, unroll=2),
           "eagle3": dict(teacher_loss_weight=1.0, lm_loss_weight=0.0, unroll=3),
           "sps": dict(teacher_loss_weight=1.0, lm_loss_weight=0.0)}


def training_module(model, method):
    heads = method_heads(model, method, num_heads=3).requires_grad_(True)
    model.requires_grad_(False)
    kind = {"sps": "draft_model"}.get(method, method)
    recipe = new_recipe(kind=kind, lr=1e-2, warmup_ratio=0.0, **RECIPES[method])
    if method == "medusa2":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    return recipe_kind(kind).module(heads, model, recipe)


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_recipe_trains_on_every_architecture(arch, method):
    """Five AdamW steps of the recipe's loss (computed from the base, as the train stage's uncached batches are) on
    one batch of pattern conversations: every trainable weight moves (Medusa-2's LoRA too) and the loss falls at
    every step (measured: by 3% for the draft model on Gemma-2 to 40% for Medusa-2, 15-22% for EAGLE-3)."""
    model, tok = base(arch)
    module = training_module(model, method).train()
    ids, labels = examples(tok, 4)
    batch = collate([HeadsDataset(ids, labels)[i] for i in range(4)], tok.pad_token_id)
    params = [p for group in module.param_groups() for p in group["params"]]
    before = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = module.compute(batch)[0]
        losses.append(float(loss.detach()))
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        losses.append(float(module.compute(batch)[0]))
    assert all(not torch.equal(p, b) for p, b in zip(params, before, strict=True)), method
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.98 * losses[0], losses
