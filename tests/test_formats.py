"""Heads exported to the authors' Medusa and Hydra formats and vLLM's, and read back: the same weights, the same
drafts, the same greedy output; what a format cannot hold is refused with the reason."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models.engine.drafting import heads_drafter
from models.base import build_tiny_model
from models.engine.decoding import generate
from models.engine.trees import chain_tree
from models.shared import HeadsConfig
from models.methods import build_heads
from models.shared.formats import OUTSIDE_DRAFT_VOCAB
from models.methods import export_heads, import_heads
from pipelines.export import run_export
from tests.test_decoding import perturbed, prompt_ids


@pytest.fixture(scope="module")
def tiny():
    model, tok = build_tiny_model("llama", seed=0)
    return model.eval(), tok


def make_heads(model, family, *, shared, draft_vocab=None, num_layers=1, seed=0, shared_blocks=False):
    """Heads with every weight perturbed; own LM heads get a non-zero bias, as trained ones have."""
    draft_ids = None
    if draft_vocab:
        draft_ids = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(seed))[:draft_vocab]
    config = HeadsConfig.for_base(model, family, num_heads=3, num_layers=num_layers, share_lm_head=shared,
                                  draft_vocab_size=draft_vocab, shared_blocks=shared_blocks)
    heads = build_heads(config, model, draft_ids=draft_ids).eval()
    return perturbed(heads, seed)


def draft_distributions(heads, model):
    """Each head's distribution over the full vocabulary at a few hidden states (and paths, for Hydra)."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(5, model.config.hidden_size, generator=g)
    out = []
    with torch.no_grad():
        for k in range(heads.config.num_heads):
            path = torch.randint(0, model.config.vocab_size, (5, k + 1), generator=g) if heads.family.reads_path else None
            out.append(torch.softmax(heads.head_logits(k, h, path).float(), dim=-1))
    return out


def assert_same_drafts(a, b, model, tok):
    for pa, pb in zip(draft_distributions(a, model), draft_distributions(b, model)):
        torch.testing.assert_close(pa, pb, atol=1e-5, rtol=1e-4)
        assert torch.equal(pa.topk(3).indices, pb.topk(3).indices)
    if a.family.prefix_layer:
        h = torch.randn(1, 6, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            torch.testing.assert_close(a.read_hidden(h, torch.arange(6)[None]), b.read_hidden(h, torch.arange(6)[None]))
    ids = prompt_ids(tok)
    base = generate(model, tok, ids, max_new_tokens=24, stop_token_ids=[])
    runs = [generate(model, tok, ids, heads_drafter(x, chain_tree(3)), max_new_tokens=24, stop_token_ids=[]) for x in (a, b)]
    assert runs[0].new_tokens == runs[1].new_tokens == base.new_tokens           # lossless, both
    assert runs[0].accept_lengths == runs[1].accept_lengths                       # the same drafts accepted


@pytest.mark.parametrize("fmt,family,shared,draft_vocab,num_layers", [
    ("medusa", "medusa", True, None, 1),
    ("vllm", "medusa", True, 48, 1),
    ("vllm", "medusa", True, None, 2),
    ("hydra", "hydra", False, None, 1),
    ("hydra", "hydra", True, 48, 2),
    ("hydra", "hydra_pp", False, 48, 2),
])
def test_round_trip_keeps_weights_drafts_and_output(tiny, tmp_path, fmt, family, shared, draft_vocab, num_layers):
    model, tok = tiny
    heads = make_heads(model, family, shared=shared, draft_vocab=draft_vocab, num_layers=num_layers)
    report = export_heads(heads, model, tmp_path / fmt, fmt)
    config = json.loads((tmp_path / fmt / "config.json").read_text())
    back = import_heads(tmp_path / fmt, model, fmt)
    assert back.config.family == family and back.config.num_heads == 3 and back.config.num_layers == num_layers
    for k in range(3):   # the blocks' weights come back exactly
        for a, b in zip(heads.blocks[k].parameters(), back.blocks[k].parameters()):
            assert torch.equal(a, b)
    assert_same_drafts(heads, back, model, tok)
    if fmt == "vllm":
        assert config["num_heads"] == 3 and config["truncated_vocab_size"] == (draft_vocab or model.config.vocab_size)
        assert config["original_lm_head"] is True
        if draft_vocab:
            assert torch.equal(back.draft_ids, heads.draft_ids)
    if fmt == "hydra":
        assert config["hydra_head_arch"] == ("prefix-mlp" if family == "hydra_pp" else "mlp")
        assert any("draft vocabulary" in n for n in report["notes"]) == bool(draft_vocab)
        weights = torch.load(tmp_path / fmt / "hydra_lm_head.pt", weights_only=True)
        lm = "hydra_lm_head.0.1" if family == "hydra_pp" else "hydra_lm_head.0"
        assert weights[f"{lm}.weight"].shape == (model.config.vocab_size, model.config.hidden_size)
        if draft_vocab:
            assert (weights[f"{lm}.bias"] == OUTSIDE_DRAFT_VOCAB).sum() == model.config.vocab_size - draft_vocab
    if fmt == "medusa":
        assert config == {"medusa_num_heads": 3, "medusa_num_layers": 1, "base_model_name_or_path": heads.config.base_model}
        weights = torch.load(tmp_path / fmt / "medusa_lm_head.pt", weights_only=True)
        assert sorted(weights) == sorted(f"{k}.{p}" for k in range(3) for p in ("0.linear.weight", "0.linear.bias", "1.weight"))


def test_the_authors_four_layer_hydra_pp_round_trips_with_its_shared_block(tiny, tmp_path):
    """Hydra++ as the authors build it (shared_blocks: blocks 1..3 of a head one module) exports to their format,
    which the 4 distinct blocks of shared_blocks=false cannot, and comes back with the same 2 distinct blocks."""
    model, tok = tiny
    heads = make_heads(model, "hydra_pp", shared=False, draft_vocab=48, num_layers=4, shared_blocks=True)
    export_heads(heads, model, tmp_path, "hydra")
    weights = torch.load(tmp_path / "hydra_lm_head.pt", weights_only=True)
    assert torch.equal(weights["hydra_mlp.0.3.linear.weight"], weights["hydra_mlp.0.7.linear.weight"])
    back = import_heads(tmp_path, model, "hydra")
    assert back.config.shared_blocks and back.blocks[0][1] is back.blocks[0][3]
    assert len(list(back.blocks[0].parameters())) == len(list(heads.blocks[0].parameters())) == 5
    for a, b in zip(heads.blocks[0].parameters(), back.blocks[0].parameters()):
        assert torch.equal(a, b)
    assert_same_drafts(heads, back, model, tok)


def test_official_medusa_format_drops_the_draft_vocabulary_and_says_so(tiny, tmp_path):
    model, _ = tiny
    report = export_heads(make_heads(model, "medusa", shared=True, draft_vocab=48), model, tmp_path, "medusa")
    assert any("draft vocabulary not carried" in n and "format=vllm" in n for n in report["notes"])


@pytest.mark.parametrize("fmt,family,kwargs,message", [
    ("medusa", "hydra", {"shared": True}, "format=medusa holds medusa heads, not 'hydra' heads; export them with format=hydra"),
    ("vllm", "hydra_pp", {"shared": True}, "not 'hydra_pp' heads; export them with format=hydra"),
    ("hydra", "medusa", {"shared": True}, "export them with format=medusa or format=vllm"),
    ("medusa", "medusa", {"shared": False}, "own LM heads"),
    ("vllm", "medusa", {"shared": False}, "bias"),
    ("medusa", "medusa", {"shared": True, "num_layers": 2}, "one module repeated"),
    ("hydra", "hydra_pp", {"shared": False, "num_layers": 4}, "more than 2 distinct blocks"),
    ("onnx", "medusa", {"shared": True}, "accepted: medusa, vllm, hydra, eagle"),
    ("eagle", "hydra", {"shared": True}, "format=eagle holds eagle heads, not 'hydra' heads; export them with format=hydra"),
])
def test_what_a_format_cannot_hold_is_refused(tiny, tmp_path, fmt, family, kwargs, message):
    model, _ = tiny
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        export_heads(make_heads(model, family, **kwargs), model, tmp_path, fmt)


def test_heads_trained_with_adapters_are_refused(tiny, tmp_path):
    model, _ = tiny
    with pytest.raises(ValueError, match="LoRA adapters"):
        export_heads(make_heads(model, "medusa", shared=True), model, tmp_path, "vllm", has_adapter=True)


def test_import_refuses_a_file_that_does_not_fit(tiny, tmp_path):
    model, _ = tiny
    export_heads(make_heads(model, "medusa", shared=True), model, tmp_path, "medusa")
    meta = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**meta, "medusa_num_heads": 5}))
    with pytest.raises(ValueError, match="holds 3 heads but config.json says medusa_num_heads=5"):
        import_heads(tmp_path, model, "medusa")
    (tmp_path / "config.json").write_text(json.dumps(meta))
    state = torch.load(tmp_path / "medusa_lm_head.pt", weights_only=True)
    state["0.0.linear.weight"] = state["0.0.linear.weight"][:, :-1]
    torch.save(state, tmp_path / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match=r"blocks.0.0.linear.weight has shape"):
        import_heads(tmp_path, model, "medusa")
    del state["0.1.weight"]
    torch.save(state, tmp_path / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match="missing"):
        import_heads(tmp_path, model, "medusa")
    with pytest.raises(FileNotFoundError, match="hydra_lm_head.pt"):
        import_heads(tmp_path, model, "hydra")


def test_the_export_command_writes_and_imports(tiny, compose_cfg):
    cfg = compose_cfg("heads=medusa1", "export.format=vllm")
    from pipelines.common import load_model
    model, tok = load_model(cfg)
    heads = make_heads(model, "medusa", shared=True, draft_vocab=48)
    heads.save(f"{cfg.paths.results}/heads/medusa1")
    report = run_export(cfg)
    assert report["files"][0].endswith("results/export/medusa1-vllm/model.safetensors")
    back = run_export(compose_cfg("export.format=vllm", f"export.import_from={cfg.paths.results}/export/medusa1-vllm"))
    assert back["heads_dir"].endswith("results/heads/imported-vllm") and back["family"] == "medusa"
    from models.methods import load_heads
    _, loaded = load_heads(back["heads_dir"], model)
    assert_same_drafts(heads, loaded, model, tok)
    with pytest.raises(ValueError, match="export.format='onnx': accepted medusa, vllm, hydra"):
        run_export(compose_cfg("heads=medusa1", "export.format=onnx"))


def test_eagle_heads_round_trip_through_the_authors_format(tiny, tmp_path):
    """format=eagle: the authors' file names (fc, layers.0 without an input norm, embed_tokens) and a one-layer
    config; reading it back gives the same layer, which drafts the same tokens over the full vocabulary."""
    model, tok = tiny
    torch.manual_seed(0)
    config = HeadsConfig.for_base(model, "eagle", num_heads=4, share_lm_head=True, draft_vocab_size=64)
    heads = build_heads(config, model, torch.arange(64)).eval()
    report = export_heads(heads, model, tmp_path / "eagle", "eagle")
    state = torch.load(tmp_path / "eagle" / "pytorch_model.bin", weights_only=True)
    assert {"fc.weight", "fc.bias", "embed_tokens.weight", "layers.0.self_attn.q_proj.weight",
            "layers.0.post_attention_layernorm.weight"} <= set(state)
    assert not any("input_layernorm" in k for k in state) and all(k.startswith(("fc.", "layers.0.", "embed_tokens."))
                                                                  for k in state)
    meta = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert meta["num_hidden_layers"] == 1 and meta["hidden_size"] == model.config.hidden_size
    assert "draft vocabulary (64 tokens) is not carried" in report["notes"][0]
    back = import_heads(tmp_path / "eagle", model, "eagle")
    assert back.config.family == "eagle" and back.draft_ids is None
    for key, value in heads.eagle.state_dict().items():
        assert torch.equal(back.eagle.state_dict()[key], value), key
    state["layers.0.mlp.up_proj.weight"] = state["layers.0.mlp.up_proj.weight"][:-1]
    torch.save(state, tmp_path / "eagle" / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"misshapen \['layers.0.mlp.up_proj.weight'\]"):
        import_heads(tmp_path / "eagle", model, "eagle")


def test_a_bare_eagle_module_exports_as_eagle_llm_reads_it(tiny, tmp_path):
    """write_eagle_module: the names and shapes eagle-llm 1.2.1's cnets.Model holds (strict load: fc with bias,
    layers.0 without input_layernorm, embed_tokens), a one-layer LlamaConfig of the base's sizes with the rotary
    base under rope_theta, and the same layer read back."""
    from models.methods.eagle.eagle import EagleModule
    from models.methods.eagle.eagle_format import write_eagle_module

    model, _ = tiny
    eagle = EagleModule.from_base(model, seed=2)
    files = write_eagle_module(eagle, model, tmp_path / "ea")
    assert sorted(Path(f).name for f in files) == ["config.json", "pytorch_model.bin"]
    state = torch.load(tmp_path / "ea" / "pytorch_model.bin", weights_only=True)
    c = model.config
    h = c.hidden_size
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    want = {"fc.weight": (h, 2 * h), "fc.bias": (h,), "embed_tokens.weight": (c.vocab_size, h),
            "layers.0.self_attn.q_proj.weight": (h, h), "layers.0.self_attn.k_proj.weight": (kv, h),
            "layers.0.self_attn.v_proj.weight": (kv, h), "layers.0.self_attn.o_proj.weight": (h, h),
            "layers.0.mlp.gate_proj.weight": (c.intermediate_size, h),
            "layers.0.mlp.up_proj.weight": (c.intermediate_size, h),
            "layers.0.mlp.down_proj.weight": (h, c.intermediate_size),
            "layers.0.post_attention_layernorm.weight": (h,)}
    assert {k: tuple(v.shape) for k, v in state.items()} == want
    meta = json.loads((tmp_path / "ea" / "config.json").read_text())
    assert meta["num_hidden_layers"] == 1 and meta["bias"] is True and meta["architectures"] == ["LlamaForCausalLM"]
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "rms_norm_eps"):
        assert meta[key] == getattr(c, key), key
    theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", None))
    assert meta["rope_theta"] == float(theta)
    back = import_heads(tmp_path / "ea", model, "eagle").eagle
    for key, value in eagle.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
