"""The tiny random models (llama, mistral, qwen2) load and run; the tiny tokenizer round-trips text."""
from __future__ import annotations

import pytest
import torch

from models.base import TINY_ARCHS, build_tiny_model

ARCHS = ["llama", "mistral", "qwen2"]


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_forward_pass(arch):
    model, tok = build_tiny_model(arch, seed=0)
    assert model.config.model_type == arch and not model.training
    input_ids = torch.randint(0, len(tok), (2, 7), generator=torch.Generator().manual_seed(0))  # [B=2, T=7]
    with torch.no_grad():
        out = model(input_ids=input_ids, output_hidden_states=True)
    assert out.logits.shape == (2, 7, len(tok))               # [B, T, V]
    assert out.hidden_states[-1].shape == (2, 7, model.config.hidden_size)
    assert torch.isfinite(out.logits).all()
    assert sum(p.numel() for p in model.parameters()) < 200_000  # stays tiny


def test_tiny_model_is_seeded():
    a, _ = build_tiny_model("llama", seed=0)
    b, _ = build_tiny_model("llama", seed=0)
    c, _ = build_tiny_model("llama", seed=1)
    wa, wb, wc = (m.get_input_embeddings().weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_unknown_arch_names_the_known_ones():
    with pytest.raises(ValueError, match="gpt2.*" + ".*".join(sorted(TINY_ARCHS))):
        build_tiny_model("gpt2")


def test_tiny_model_from_the_config_group(compose_cfg):
    from pipelines.common import load_model

    cfg = compose_cfg("model=tiny_random")
    model, tok = load_model(cfg)
    assert model.config.hidden_size == cfg.model.tiny.hidden_size
    assert model.config.num_hidden_layers == cfg.model.tiny.num_layers
    assert tok.pad_token_id is not None


@pytest.mark.parametrize("text", ["plain ascii", "café 日本語 🎉\n\ttabs  and  spaces ", "",
                                  "<|im_start|>user\nhi<|im_end|>\n"])
def test_tiny_tokenizer_round_trips(tiny_tokenizer, text):
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.decode(ids) == text
    assert len(ids) <= len(text.encode("utf-8"))


def test_tiny_tokenizer_specials_and_chat_template(tiny_tokenizer):
    ids = tiny_tokenizer("<|im_start|><|im_end|>", add_special_tokens=False)["input_ids"]
    assert ids == [tiny_tokenizer.bos_token_id, tiny_tokenizer.eos_token_id]
    text = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                              add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_model_fixture(tiny_model):
    model, tok = tiny_model
    assert model.config.model_type == "llama" and len(tok) == model.config.vocab_size
