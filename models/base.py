"""Base-model loading: a local transformers folder, a hub id, or a tiny random model.

    model, tok = load_base_model("artifacts/models/SmolLM2-135M-Instruct")
    model, tok = build_tiny_model(arch="qwen2", seed=0)
"""
from __future__ import annotations

import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, AutoTokenizer, CohereConfig, Gemma2Config, GraniteConfig,
                          LlamaConfig, MistralConfig, Olmo2Config, Phi3Config, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen3Config)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# granite, cohere and gemma2 transform their logits (models/engine/projection.py LOGIT_TRANSFORMS)
# phi3 (fused qkv_proj and gate_up_proj), olmo2 (norms after attention and MLP, none before) and qwen3 (q/k norms)
# have decoder layers unlike Llama's (tests/test_base_architectures.py)
TINY_ARCHS = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "granite": GraniteConfig,
              "cohere": CohereConfig, "gemma2": Gemma2Config, "phi3": Phi3Config, "olmo2": Olmo2Config,
              "qwen3": Qwen3Config}
# ChatML, the template SmolLM2 and Qwen2 use; the tiny tokenizer gets it too.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def load_base_model(source: str, dtype: str = "float32", device: str = "cpu", chat_template: str | None = None,
                    tiny: dict | None = None):
    """Return (model in eval mode, tokenizer) from a folder, a hub id, or `tiny` settings."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    if tiny:
        model, tok = build_tiny_model(**tiny)
    else:
        if source.startswith(("artifacts/", "./", "/")) and not os.path.isdir(source):
            raise FileNotFoundError(f"base model folder {source!r} does not exist; run `dvc repro assets` "
                                    "(or `python -m pipelines.assets`) first, or pass model.source=<hub id or folder>")
        tok = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[dtype])
    if chat_template:
        tok.chat_template = chat_template
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model.to(device).eval(), tok


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer (256 bytes + ChatML specials): offline, deterministic, any text round-trips."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(TINY_SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(TINY_SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    tok.chat_template = CHATML_TEMPLATE
    return tok


def build_tiny_model(arch: str = "llama", hidden_size: int = 64, num_layers: int = 2, num_attention_heads: int = 4,
                     num_key_value_heads: int = 2, intermediate_size: int = 128, max_position_embeddings: int = 512,
                     seed: int = 0, **config_overrides):
    """A randomly initialised causal LM of the given architecture with the tiny byte tokenizer.

    config_overrides go to the architecture's config (e.g. sliding_window=24, use_sliding_window=True).
    """
    if arch not in TINY_ARCHS:
        raise ValueError(f"tiny model arch {arch!r} is not known; use one of {sorted(TINY_ARCHS)}")
    tok = build_tiny_tokenizer()
    config = TINY_ARCHS[arch](
        vocab_size=len(tok), hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False, initializer_range=0.2,
    )
    if arch == "mistral":
        config.sliding_window = None
    if arch in ("gemma2", "qwen3"):                  # their default head_dim (256, 128) ignores the hidden size
        config.head_dim = hidden_size // num_attention_heads
    for key, value in config_overrides.items():
        setattr(config, key, value)
    config.name_or_path = f"tiny-random-{arch}"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.config.name_or_path = config.name_or_path
    return model.eval(), tok


def model_name(model) -> str:
    """The name a heads checkpoint records for its base model."""
    return getattr(model.config, "name_or_path", "") or model.config.model_type
