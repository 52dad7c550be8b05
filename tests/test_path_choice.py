"""pytest tests/test_path_choice.py: the CPU paths are chosen by timing them here, and every choice decodes the same.

measure_paths times every option in place and keeps the fastest of each; apply_paths puts a model on any choice,
and whatever it is the logits and the greedy tokens are the stock model's; the lean Llama layers give the stock
layers' hidden states bit for bit and hand over to them where they would not; a model too small to time keeps the
default paths; bf16 draft heads never pack a base LM head the choice left unpacked.
"""
import itertools

import pytest
import torch

from models.base import build_tiny_model
from models.engine import path_choice
from models.engine.decoding import generate
from models.engine.drafting import heads_drafter
from models.engine.fast_inference import GQA_FOLDED, is_packed, packing_available
from models.engine.lean_layers import has_lean_layers, stock_layers, use_lean_layers
from models.engine.path_choice import (DEFAULT, LM_FEW, LM_MANY, PathChoice, apply_paths, measure_paths,
                                      prepare_for_decoding)
from models.engine.projection import base_logits
from models.engine.trees import TreeSpec

needs_onednn = pytest.mark.skipif(not packing_available(), reason="no oneDNN linear in this torch build")
BRANCHY = TreeSpec("branchy", ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)), top_k=2)


def grouped_model(seed=1):
    return build_tiny_model("llama", num_attention_heads=4, num_key_value_heads=2, seed=seed)


@needs_onednn
def test_measure_paths_times_every_option_and_keeps_the_fastest():
    model, _ = grouped_model()
    choice = measure_paths(model, prefix=16, rows=4, repeats=2)
    ms = choice.timings_ms
    assert choice.measured
    assert {f"body_{p}_{n}" for p in ("stock", "packed") for n in (1, 4)} <= set(ms)
    assert {"attention_sdpa_4", "attention_folded_4"} <= set(ms)
    assert {f"lm_head_{k}_1" for k in LM_FEW} | {f"lm_head_{k}_8" for k in LM_MANY} <= set(ms)
    body = {(p, lean): ms[f"body_{p}{lean}_1"] + ms[f"body_{p}{lean}_4"] for p in ("stock", "packed")
            for lean in ("", "_lean")}
    assert min(body, key=body.get) == ("packed" if choice.packed_body else "stock",
                                       "_lean" if choice.lean_layers else "")
    assert choice.folded_attention == (ms["attention_folded_4"] < ms["attention_sdpa_4"])
    assert ms[f"lm_head_{choice.lm_head_few}_1"] == min(ms[f"lm_head_{k}_1"] for k in LM_FEW)
    assert ms[f"lm_head_{choice.lm_head_many}_8"] == min(ms[f"lm_head_{k}_8"] for k in LM_MANY)
    # measuring leaves the model as it found it: stock linears and layers, its own attention
    assert not any(is_packed(m) for m in model.modules()) and not has_lean_layers(model)
    assert model.config._attn_implementation == "sdpa"


def test_a_model_too_small_to_time_keeps_the_default_paths():
    model, _ = grouped_model()
    assert path_choice.weight_bytes(model) < path_choice.MIN_MEASURED_BYTES
    info = prepare_for_decoding(model)
    assert info["paths"] == DEFAULT.as_dict() and not info["paths"]["measured"]
    if packing_available():
        assert info["attention"] == GQA_FOLDED and is_packed(model.get_output_embeddings())


CHOICES = [PathChoice(packed, folded, few, many, lean_layers=lean)
           for packed, folded, few, many, lean in itertools.product((False, True), (False, True), LM_FEW, LM_MANY,
                                                                     (False, True))]


@needs_onednn
@pytest.mark.parametrize("choice", CHOICES, ids=lambda c: f"{c.packed_body}-{c.folded_attention}-{c.lm_head_few}-"
                                                        f"{c.lm_head_many}-{c.lean_layers}")
def test_every_choice_gives_the_stock_logits(choice):
    model, _ = grouped_model()
    ids = torch.randint(3, 250, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0]
        stock = torch.nn.functional.linear(hidden, model.get_output_embeddings().weight)
    info = apply_paths(model, choice)
    assert info["attention"] == (GQA_FOLDED if choice.folded_attention else "sdpa")
    with torch.inference_mode():
        hidden_fast = model.get_decoder()(input_ids=ids).last_hidden_state[0]
        logits = base_logits(model)
        for rows in (1, 3, 24):                  # one row, a few (the few-rows path), many
            torch.testing.assert_close(logits(hidden_fast[:rows]), stock[:rows], rtol=1e-4, atol=1e-4)


@needs_onednn
@pytest.mark.parametrize("choice", [PathChoice(False, False, "linear", "linear"),
                                    PathChoice(True, True, "columns", "onednn"),
                                    PathChoice(False, True, "linear", "packed"),
                                    PathChoice(True, True, "packed", "packed", lean_layers=True)],
                         ids=["stock", "mixed", "measured-amx", "lean-avx2"])
def test_greedy_tokens_unchanged_on_any_choice(choice):
    from tests.test_decoding import random_heads

    model, tok = grouped_model(seed=3)
    prompt = list(range(10, 50))
    base = generate(model, tok, prompt, max_new_tokens=32, stop_token_ids=[]).new_tokens
    heads = random_heads(model, "hydra")
    apply_paths(model, choice)
    assert generate(model, tok, prompt, max_new_tokens=32, stop_token_ids=[]).new_tokens == base
    assert generate(model, tok, prompt, heads_drafter(heads, BRANCHY), max_new_tokens=32,
                    stop_token_ids=[]).new_tokens == base


@needs_onednn
@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="oneDNN packs bfloat16 weights only on AVX512 or AVX-NE-CONVERT CPUs")
def test_bf16_heads_leave_an_unpacked_base_lm_head_alone():
    """A head sharing the base LM head (full vocabulary) must not pack it in bfloat16 where the choice left it
    unpacked: the base's logits decide the output."""
    from models.engine.fast_inference import prepare_heads_for_decoding
    from models.methods import build_heads
    from models.shared import HeadsConfig

    model, _ = build_tiny_model("llama", seed=2)
    heads = build_heads(HeadsConfig.for_base(model, "medusa", 2, 1, share_lm_head=True), model).eval()
    lm_head = model.get_output_embeddings()
    prepare_for_decoding(model, PathChoice(False, True, "linear", "linear"))
    prepare_heads_for_decoding(heads, bf16=True)
    assert not is_packed(lm_head)
    x = torch.randn(2, lm_head.in_features)
    with torch.inference_mode():
        torch.testing.assert_close(lm_head(x), torch.nn.functional.linear(x, lm_head.weight))


@pytest.mark.parametrize("packed", [False, True], ids=["stock-linears", "packed-linears"])
def test_lean_layers_give_the_stock_layers_hidden_states_bit_for_bit(packed):
    """A prefill, a masked 4-token tree step and a padded batch of two, through the engine's cache: the same bits as
    the stock layers; with gradients on, or the static step's cache, the stock forward runs (no lean output)."""
    from models.engine.fast_inference import pack_linears, unpack_linears
    from models.engine.kv_cache import cache_kwargs, new_cache

    model, _ = grouped_model(seed=4)
    decoder = model.get_decoder()
    (pack_linears if packed and packing_available() else unpack_linears)(decoder)
    g = torch.Generator().manual_seed(0)
    ids, pair = torch.randint(3, 250, (1, 20), generator=g), torch.randint(3, 250, (2, 9), generator=g)
    block = torch.full((4, 4), torch.finfo(torch.float32).min).triu(1)
    tree_mask = torch.cat([torch.zeros(4, 20), block], 1)[None, None]
    pad = torch.zeros(2, 1, 9, 9).masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril(), float("-inf"))
    pad[1, ..., :3] = float("-inf")                                # row 1 left-padded by 3
    pad[1, 0, :3, :3] = 0.0                                        # a pad query sees the pads only

    def run():
        with torch.inference_mode():
            cache = new_cache()
            first = decoder(input_ids=ids, use_cache=True, **cache_kwargs(decoder, cache)).last_hidden_state
            tree = decoder(input_ids=ids[:, :4], position_ids=torch.arange(20, 24)[None], attention_mask=tree_mask,
                           use_cache=True, **cache_kwargs(decoder, cache)).last_hidden_state
            batch = decoder(input_ids=pair, attention_mask=pad, use_cache=True,
                            **cache_kwargs(decoder, new_cache())).last_hidden_state
        return first, tree, batch

    stock = run()
    assert use_lean_layers(model) and has_lean_layers(model)
    lean = run()
    assert all(torch.equal(a, b) for a, b in zip(stock, lean))
    calls = []
    original = type(decoder.layers[0]).forward
    type(decoder.layers[0]).forward = lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
    try:
        decoder(input_ids=ids[:, :3])                             # gradients on: the stock forward, every layer
        assert len(calls) == len(decoder.layers)
    finally:
        type(decoder.layers[0]).forward = original
    copy_ = __import__("copy").deepcopy(decoder.layers[0])        # a draft's copy of a lean layer, a norm dropped
    copy_.input_layernorm = torch.nn.Identity()
    x = torch.randn(1, 3, model.config.hidden_size)
    rotary = decoder.rotary_emb(x, torch.arange(3)[None])
    with torch.inference_mode():
        torch.testing.assert_close(copy_(x, position_embeddings=rotary),
                                   type(copy_).forward(copy_, x, position_embeddings=rotary))
    stock_layers(model)
    assert not has_lean_layers(model)


def test_lean_layers_leave_other_architectures_and_taps_alone():
    """Only plain Llama layers get the lean forward (Qwen2 and Mistral keep their own), and forward hooks still run
    on lean layers (EAGLE-3's taps read them)."""
    from models.engine.taps import final_and_taps

    for arch in ("qwen2", "mistral"):
        other, _ = build_tiny_model(arch, seed=0)
        assert not use_lean_layers(other) and not has_lean_layers(other)
    model, _ = grouped_model(seed=5)
    ids = torch.randint(3, 250, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        stock = final_and_taps(model.get_decoder(), ids, (1, 2))
        use_lean_layers(model)
        lean = final_and_taps(model.get_decoder(), ids, (1, 2))
    assert torch.equal(stock, lean)
