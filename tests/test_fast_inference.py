"""pytest tests/test_fast_inference.py: the CPU speed-ups change speed, not results.

Packed linears and the folded grouped-query attention give the same hidden states as the stock
model on tree verify steps (chain and branching trees), the same greedy tokens in the baseline and
speculative loops, and step aside when gradients are on (training is untouched).
"""
import pytest
import torch

from models.engine.drafting import heads_drafter
from models.base import build_tiny_model
from models.engine.decoding import generate, verify_tree
import copy

from models.engine.fast_inference import GQA_FOLDED, is_packed, pack_linears, unpack_linears
from models.engine.path_choice import prepare_for_decoding
from models.engine.kv_cache import cache_kwargs, new_cache
from models.engine.trees import TreeBuffers, TreeSpec, chain_tree

TREES = [chain_tree(5, top_k=2), TreeSpec("branchy", ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)), top_k=2)]


def verify_hidden(model, prompt, tokens, buf):
    decoder = model.get_decoder()
    cache = new_cache()
    with torch.inference_mode():
        decoder(input_ids=prompt, use_cache=True, **cache_kwargs(decoder, cache))
        return verify_tree(decoder, tokens, buf, cache, prompt.shape[1])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("tree", TREES, ids=lambda t: t.name)
def test_prepared_model_verifies_like_the_stock_model(arch, tree):
    model, _ = build_tiny_model(arch, num_attention_heads=4, num_key_value_heads=2, seed=1)   # 2 query heads per kv head
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 250, (1, 37), generator=g)
    buf = TreeBuffers.build(tree)
    tokens = torch.randint(3, 250, (buf.num_tokens,), generator=g)
    stock = verify_hidden(model, prompt, tokens, buf)
    info = prepare_for_decoding(model)
    assert info["attention"] == GQA_FOLDED and info["packed_linears"] > 0
    fast = verify_hidden(model, prompt, tokens, buf)
    torch.testing.assert_close(fast, stock, rtol=1e-4, atol=1e-5)


def test_greedy_tokens_unchanged_in_both_loops(tiny_model):
    from tests.test_decoding import random_heads      # heads built against the stock model, used after preparing

    model, tok = tiny_model
    prompt = list(range(10, 60))
    base_stock = generate(model, tok, prompt, max_new_tokens=40, stop_token_ids=[]).new_tokens
    heads = random_heads(model, "hydra")
    prepare_for_decoding(model)
    assert generate(model, tok, prompt, max_new_tokens=40, stop_token_ids=[]).new_tokens == base_stock
    spec = generate(model, tok, prompt, heads_drafter(heads, TREES[1]), max_new_tokens=40, stop_token_ids=[])
    assert spec.new_tokens == base_stock


def tiny_model_and_heads(family):
    """A tiny Llama and 3 heads of `family` on a 64-token draft vocabulary, nudged off the identity blocks a
    fresh head starts as."""
    from models.shared import HeadsConfig
    from models.methods import build_heads

    model, tok = build_tiny_model("llama", seed=2)
    config = HeadsConfig.for_base(model, family, 3, 1, share_lm_head=True, draft_vocab_size=64)
    heads = build_heads(config, model, torch.arange(3, 67)).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model, tok, heads


@pytest.mark.parametrize("family", ["medusa", "hydra", "hydra_pp"])
def test_prepared_heads_draft_the_same_tokens(family):
    """prepare_heads_for_decoding packs the blocks, the prefix layer and the frozen draft-vocabulary LM heads;
    the drafts, and so every step, stay the same."""
    from models.engine.fast_inference import prepare_heads_for_decoding

    model, tok, heads = tiny_model_and_heads(family)
    prompt = list(range(10, 70))
    stock = generate(model, tok, prompt, heads_drafter(heads, TREES[1]), max_new_tokens=30, stop_token_ids=[])
    prepare_for_decoding(model)
    n = prepare_heads_for_decoding(heads, bf16=False)       # float32 copies: the same products
    assert n >= 3 and all(is_packed(layer) for layer in heads.output_layers())
    fast = generate(model, tok, prompt, heads_drafter(heads, TREES[1]), max_new_tokens=30, stop_token_ids=[])
    assert fast.new_tokens == stock.new_tokens and fast.accept_lengths == stock.accept_lengths


needs_bf16_packing = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="oneDNN has no bf16 linear on this CPU")


@needs_bf16_packing
@pytest.mark.parametrize("family", ["medusa", "hydra", "hydra_pp"])
def test_bf16_draft_heads_stay_lossless_and_close(family):
    """bf16 copies of the heads' linears change the drafts' products by bf16 rounding only, and the output not
    at all: greedy speculative decoding still equals the baseline token for token."""
    from models.engine.fast_inference import prepare_heads_for_decoding

    model, tok, heads = tiny_model_and_heads(family)
    prompt = list(range(10, 70))
    base = generate(model, tok, prompt, max_new_tokens=40, stop_token_ids=[])
    layer = heads.output_layers()[0]
    x = torch.randn(3, layer.in_features)
    with torch.inference_mode():
        exact = torch.nn.functional.linear(x, layer.weight, layer.bias)
    prepare_for_decoding(model)
    assert prepare_heads_for_decoding(heads, bf16=True) >= 3
    with torch.inference_mode():
        rounded = layer(x)
    assert rounded.dtype == torch.float32 and not torch.equal(rounded, exact)      # the bf16 copy ran
    torch.testing.assert_close(rounded, exact, rtol=2e-2, atol=2e-2 * exact.abs().max().item())
    fast = generate(model, tok, prompt, heads_drafter(heads, TREES[1]), max_new_tokens=40, stop_token_ids=[])
    assert fast.new_tokens == base.new_tokens


@needs_bf16_packing
def test_bf16_heads_leave_a_shared_base_lm_head_in_float32():
    """With the full vocabulary a head's output layer IS the base LM head; its float32 copy (from
    prepare_for_decoding) must stay, since the base's logits decide the output."""
    from models.engine.fast_inference import prepare_heads_for_decoding
    from models.shared import HeadsConfig
    from models.methods import build_heads

    model, tok = build_tiny_model("llama", seed=2)
    heads = build_heads(HeadsConfig.for_base(model, "medusa", 2, 1, share_lm_head=True), model).eval()
    lm_head = model.get_output_embeddings()
    prepare_for_decoding(model)
    prepare_heads_for_decoding(heads, bf16=True)
    assert is_packed(lm_head)                            # still packed, and in float32 (the product below)
    x = torch.randn(2, lm_head.in_features)
    with torch.inference_mode():
        torch.testing.assert_close(lm_head(x), torch.nn.functional.linear(x, lm_head.weight), rtol=1e-5, atol=1e-5)


def test_packed_linear_steps_aside_for_training_and_changed_weights(tiny_model):
    model, _ = tiny_model
    lin = model.get_decoder().layers[0].mlp.up_proj
    assert pack_linears(model) > 0 and is_packed(lin)
    x = torch.randn(3, lin.in_features, requires_grad=True)
    lin(x).sum().backward()                            # autograd path: F.linear, gradients reach the weight
    assert lin.weight.grad is not None and x.grad is not None
    with torch.no_grad():
        lin.weight.mul_(2.0)                           # weights changed after packing: the stale copy is not used
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
    twin = copy.deepcopy(model)                        # a prepared model deep-copies (Hydra++ copies a layer)
    twin_lin = twin.get_decoder().layers[0].mlp.up_proj
    with torch.no_grad():
        torch.testing.assert_close(twin_lin(x), lin(x))
    unpack_linears(model)
    assert not is_packed(lin) and "forward" not in vars(lin)
