"""pytest tests/test_fused.py: the static step's element-wise parts compiled (models/engine/fused.py). On the CPU the
wiring runs under torch.compile's aot_eager backend (traced, not code-generated: no compiler needed); on CUDA the
inductor backend, captured in the graphs, decodes what the eager step decodes."""
from __future__ import annotations

import pytest
import torch

from models.base import build_tiny_model
from models.engine.acceptance import SamplingConfig
from models.engine.decoding import decode_step, generate, prefill
from models.engine.fused import FusedParts
from models.engine.static_step import attach_static, static_summaries
from tests.test_static_step import PROMPT, exact_drafter


def decode(model, drafter, n: int, fuse):
    """n greedy tokens through the static step with the element-wise parts fused by `fuse` -> (tokens, decoder)."""
    with torch.inference_mode():
        device = next(model.parameters()).device
        state = prefill(model, torch.tensor([PROMPT], device=device), SamplingConfig(), drafter=drafter,
                        static_drafts=True)
        static = attach_static(state, drafter, n + 8, fuse=fuse)
        out = [state.root]
        while len(out) < n:
            out += decode_step(state, drafter, 8)[0]
    return out[:n], static


@pytest.mark.parametrize("tree_name", [None, "sparse64"])
def test_the_fused_step_decodes_what_the_eager_step_decodes(tiny_model, tree_name):
    model, _ = tiny_model
    eager = generate(model, None, PROMPT, max_new_tokens=24, stop_token_ids=[], static=False).new_tokens
    tokens, static = decode(model, exact_drafter(model, tree_name) if tree_name else None, 24, fuse="aot_eager")
    assert tokens == eager
    assert static.fused.summary() == {"backend": "aot_eager", "error": None,
                                      "parts": ["input_layernorm", "mlp", "norm", "post_attention_layernorm"]}
    assert static_summaries()[-1]["fused"]["parts"] == static.fused.parts


def test_the_model_is_untouched_outside_the_static_forward(tiny_model):
    model, _ = tiny_model
    keys = list(model.state_dict())
    fused = FusedParts(model.get_decoder(), "aot_eager")
    with fused.applied():
        assert type(model.get_decoder().layers[0].mlp).__name__ == "OptimizedModule"
    assert list(model.state_dict()) == keys and type(model.get_decoder().layers[0].mlp).__name__ != "OptimizedModule"


def test_a_backend_that_fails_leaves_the_parts_unfused_and_says_why(tiny_model):
    model, _ = tiny_model
    fused = FusedParts(model.get_decoder(), "no_such_backend")
    assert fused.parts == [] and "no_such_backend" in fused.error
    with fused.applied():
        assert type(model.get_decoder().layers[0].mlp).__name__ != "OptimizedModule"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tree_name", [None, "sparse64"])
def test_on_cuda_the_fused_captured_step_decodes_what_the_eager_step_decodes(tiny_model, tree_name):
    model, _ = tiny_model
    model = model.to("cuda")
    eager = generate(model, None, PROMPT, max_new_tokens=32, stop_token_ids=[], static=False).new_tokens
    drafter = exact_drafter(model, tree_name) if tree_name else None
    tokens, static = decode(model, drafter, 32, fuse="inductor")
    assert static.fused.error is None and static.mode == "cuda_graphs" and not static.fallback
    assert tokens == eager
