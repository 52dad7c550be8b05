"""pytest tests/test_sliding_window.py: models whose attention slides over a window shorter than the
context stay lossless: the verify mask carries the window (one mask for Mistral, per layer type for a
Qwen2 model with sliding and full layers), and the baseline equals the model's own generate().
"""
import pytest
import torch

from models.engine.drafting import heads_drafter
from models.base import build_tiny_model
from models.engine.decoding import generate, verify_masks
from models.engine.trees import TreeBuffers, chain_tree
from tests.test_decoding import FAMILIES, TREES, random_heads

WINDOW = 24
MODELS = {
    "mistral": dict(arch="mistral", sliding_window=WINDOW),
    "qwen2_mixed": dict(arch="qwen2", num_layers=4, use_sliding_window=True, sliding_window=WINDOW,
                        layer_types=["full_attention", "sliding_attention"] * 2),
}


def windowed_model(name):
    return build_tiny_model(seed=3, **MODELS[name])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_baseline_equals_the_models_own_generate(name):
    model, tok = windowed_model(name)
    prompt = list(range(30, 70))                        # 40 tokens: past the window already
    ours = generate(model, tok, prompt, max_new_tokens=30, stop_token_ids=[]).new_tokens
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=None,
                             pad_token_id=0, min_new_tokens=30)[0, len(prompt):].tolist()
    assert ours == ref


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tree", ["sparse64", "chain4"])
def test_speculative_equals_baseline_past_the_window(name, family, tree):
    model, tok = windowed_model(name)
    prompt = list(range(40, 72))
    base = generate(model, tok, prompt, max_new_tokens=40, stop_token_ids=[]).new_tokens
    spec = generate(model, tok, prompt, heads_drafter(random_heads(model, family), TREES[tree]), max_new_tokens=40, stop_token_ids=[])
    assert spec.new_tokens == base


def test_window_mask_hides_keys_too_far_back():
    model, _ = windowed_model("mistral")
    buf = TreeBuffers.build(chain_tree(3))
    mask = verify_masks(model.config, buf, past=30, dtype=torch.float32, device="cpu")[0, 0]   # [4, 34]
    visible = mask == 0
    for i in range(4):                                  # query i at position 30 + i sees keys 30 + i - 23 .. 30 + i
        assert visible[i].nonzero().flatten().tolist() == list(range(30 + i - WINDOW + 1, 31 + i))
    qwen = windowed_model("qwen2_mixed")[0]
    assert qwen.model.has_sliding_layers
    mixed = verify_masks(qwen.config, buf, 30, torch.float32, "cpu")
    assert set(mixed) == {"full_attention", "sliding_attention"} and bool((mixed["full_attention"][0, 0, :, :30] == 0).all())
