"""EAGLE-3 heads exported to the layout vLLM's and SGLang's EAGLE-3 loaders read (models/methods/eagle/eagle3_format.py):
the exact key names and shapes, the config fields, d2t/t2d against the draft vocabulary, one position computed from
the file as those loaders compute it, the round trip (the same logits, the same drafts) and what is refused."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from models.engine.decoding import generate
from models.engine.drafting import heads_drafter
from models.engine.trees import chain_tree
from models.shared import HeadsConfig
from models.methods import build_heads
from models.shared.draft_vocab import most_frequent
from models.methods import export_heads, import_heads
from pipelines.export import run_export
from tests.test_decoding import perturbed, prompt_ids
from tests.test_formats import make_heads, tiny  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
VD = 48


def eagle3_heads(model, vocab: str = "frequent", seed: int = 0):
    """eagle3 heads with every weight perturbed (the norms too, so no two of them are equal). vocab: "frequent"
    (the lowest ids, as most_frequent gives them here), "shuffled" (ids in random order) or "full" (none)."""
    V = model.config.vocab_size
    ids = {"frequent": most_frequent(torch.arange(V, 0, -1), VD),
           "shuffled": torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:VD], "full": None}[vocab]
    config = HeadsConfig.for_base(model, "eagle3", num_heads=3, share_lm_head=False,
                                  draft_vocab_size=None if ids is None else VD)
    heads = build_heads(config, model, ids).eval()
    return perturbed(heads, seed)


def expected_shapes(model, vd: int) -> dict[str, tuple[int, ...]]:
    c = model.config
    h, hd, inter = c.hidden_size, c.head_dim, c.intermediate_size
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    layer = {"input_layernorm": (h,), "hidden_norm": (h,), "self_attn.q_proj": (q, 2 * h),
             "self_attn.k_proj": (kv, 2 * h), "self_attn.v_proj": (kv, 2 * h), "self_attn.o_proj": (h, q),
             "post_attention_layernorm": (h,), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
             "mlp.down_proj": (h, inter)}
    return {"fc.weight": (h, 3 * h), **{f"midlayer.{k}.weight": v for k, v in layer.items()}, "norm.weight": (h,),
            "lm_head.weight": (vd, h), "d2t": (vd,), "t2d": (c.vocab_size,)}


@pytest.mark.parametrize("vocab", ["frequent", "shuffled", "full"])
def test_the_file_has_the_loaders_names_shapes_and_config(tiny, tmp_path, vocab):
    """Names and shapes exactly as the loaders map them (midlayer. -> the layer, d2t/t2d), each tensor the heads'
    own, d2t = draft ids - arange and t2d their mask, and config.json's fields for this base."""
    model, _ = tiny
    heads = eagle3_heads(model, vocab)
    report = export_heads(heads, model, tmp_path, "eagle3")
    state = load_file(str(tmp_path / "model.safetensors"))
    V, vd = model.config.vocab_size, VD if vocab != "full" else model.config.vocab_size
    assert {k: tuple(v.shape) for k, v in state.items()} == expected_shapes(model, vd)
    module = heads.eagle3
    for name, tensor in [("fc.weight", module.fc.weight), ("norm.weight", module.out_norm.weight),
                         ("lm_head.weight", heads.lm_heads[0].weight),
                         *[(f"midlayer.{k}", v) for k, v in module.layers[0].state_dict().items()]]:
        assert torch.equal(state[name], tensor.detach()), name
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    ids = torch.arange(V) if vocab == "full" else heads.draft_ids
    assert torch.equal(state["d2t"] + torch.arange(vd), ids)
    assert torch.equal(state["t2d"].nonzero().flatten(), ids.sort().values)
    meta = json.loads((tmp_path / "config.json").read_text())
    c = model.config
    assert meta["architectures"] == ["LlamaForCausalLMEagle3"] and meta["model_type"] == "llama"
    assert meta["num_hidden_layers"] == 1 and meta["tie_word_embeddings"] is False
    assert meta["vocab_size"] == V and meta["draft_vocab_size"] == vd and meta["torch_dtype"] == "float32"
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "max_position_embeddings"):
        assert meta[key] == getattr(c, key), key
    assert meta["rope_theta"] == float(c.rope_parameters["rope_theta"]) and meta["rope_scaling"] is None
    taps = list(module.taps)                       # (2, 1, 1): a 2-layer base clamps (2, L // 2, L - 3)
    assert meta["eagle_aux_hidden_state_layer_ids"] == taps                           # vLLM: hidden_states indices
    assert meta["eagle_config"] == {"use_aux_hidden_state": True,
                                    "eagle_aux_hidden_state_layer_ids": [i - 1 for i in taps]}   # SGLang adds 1
    assert "target_hidden_size" not in meta and not meta.get("bias") and meta["norm_before_residual"] is False
    assert any("eagle_config.eagle_aux_hidden_state_layer_ids" in n for n in report["notes"])
    assert any("full vocabulary" in n for n in report["notes"]) == (vocab == "full")


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def loader_logits(state, meta, taps_feature, embedding):
    """One position (nothing cached) from the file alone, as the loaders' layer runs it: fc, [normed embedding ;
    normed feature] into q/k/v, residual = fc's output; with one key the attention output is o_proj(v). -> the
    logits over the full vocabulary (-inf outside the draft vocabulary, placed by d2t)."""
    eps, groups = meta["rms_norm_eps"], meta["num_attention_heads"] // meta["num_key_value_heads"]
    w = {k.removeprefix("midlayer."): v for k, v in state.items()}
    f = F.linear(taps_feature, w["fc.weight"])
    a = torch.cat([rms(embedding, w["input_layernorm.weight"], eps), rms(f, w["hidden_norm.weight"], eps)], -1)
    v = F.linear(a, w["self_attn.v_proj.weight"]).unflatten(-1, (meta["num_key_value_heads"], -1))
    h = f + F.linear(v.repeat_interleave(groups, dim=-2).flatten(-2), w["self_attn.o_proj.weight"])
    n = rms(h, w["post_attention_layernorm.weight"], eps)
    pred = h + F.linear(F.silu(F.linear(n, w["mlp.gate_proj.weight"])) * F.linear(n, w["mlp.up_proj.weight"]),
                        w["mlp.down_proj.weight"])
    draft = F.linear(rms(pred, w["norm.weight"], eps), w["lm_head.weight"])
    full = draft.new_full((*draft.shape[:-1], meta["vocab_size"]), float("-inf"))
    full[..., state["d2t"] + torch.arange(draft.shape[-1])] = draft
    return full


def test_the_file_computes_what_the_heads_compute(tiny, tmp_path):
    """The file read as the loaders read it (names, concatenation order, residual, final norm, d2t) gives the
    heads' own first-depth logits: a renaming that swapped two norms or misplaced the draft ids would not."""
    model, _ = tiny
    heads = eagle3_heads(model, "shuffled")
    export_heads(heads, model, tmp_path, "eagle3")
    state, meta = load_file(str(tmp_path / "model.safetensors")), json.loads((tmp_path / "config.json").read_text())
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(4, 1, 3 * model.config.hidden_size, generator=g)          # taps [B, 1, 3h]
    tokens = torch.randint(0, model.config.vocab_size, (4, 1), generator=g)
    with torch.no_grad():
        pred = heads.eagle3(feats, tokens, torch.zeros(4, 1, dtype=torch.long))
        draft = heads.lm_head(0, heads.eagle3.readout(pred))
        ours = torch.full((4, 1, model.config.vocab_size), float("-inf")).index_copy_(-1, heads.draft_ids, draft)
        theirs = loader_logits(state, meta, feats, model.get_input_embeddings()(tokens))
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("vocab", ["frequent", "shuffled", "full"])
def test_round_trip_gives_the_same_logits_and_drafts(tiny, tmp_path, vocab):
    """Read back: every weight and the draft vocabulary equal, the same logits at every unrolled depth, and the
    same greedy output and accepted drafts through the drafter."""
    model, tok = tiny
    heads = eagle3_heads(model, vocab)
    export_heads(heads, model, tmp_path, "eagle3")
    back = import_heads(tmp_path, model, "eagle3")
    assert back.config.family == "eagle3" and back.config.share_lm_head is False
    assert back.config.draft_vocab_size == (None if vocab == "full" else VD)
    assert (back.draft_ids is None) == (vocab == "full")
    if vocab != "full":
        assert torch.equal(back.draft_ids, heads.draft_ids)
    for key, value in heads.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(2, 9, 3 * model.config.hidden_size, generator=g)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=g)
    with torch.no_grad():
        for a, b in zip(heads.eagle3.unroll(feats, ids, 3), back.eagle3.unroll(feats, ids, 3), strict=True):
            assert torch.equal(heads.lm_head(0, heads.eagle3.readout(a)), back.lm_head(0, back.eagle3.readout(b)))
    prompt = prompt_ids(tok)
    base = generate(model, tok, prompt, max_new_tokens=16, stop_token_ids=[])
    runs = [generate(model, tok, prompt, heads_drafter(x, chain_tree(3)), max_new_tokens=16, stop_token_ids=[])
            for x in (heads, back)]
    assert runs[0].new_tokens == runs[1].new_tokens == base.new_tokens
    assert runs[0].accept_lengths == runs[1].accept_lengths


@pytest.mark.parametrize("family,fmt,message", [
    ("eagle", "eagle3", "format=eagle3 holds eagle3 heads, not 'eagle' heads; export them with format=eagle"),
    ("medusa", "eagle3", "format=eagle3 holds eagle3 heads, not 'medusa' heads; export them with format=medusa or "
                         "format=vllm"),
    ("eagle3", "eagle", "format=eagle holds eagle heads, not 'eagle3' heads; export them with format=eagle3"),
    ("eagle3", "vllm", "format=vllm holds medusa heads, not 'eagle3' heads; export them with format=eagle3"),
])
def test_other_families_are_refused(tiny, tmp_path, family, fmt, message):
    model, _ = tiny
    heads = eagle3_heads(model) if family == "eagle3" else make_heads(model, family, shared=True)
    with pytest.raises(ValueError, match=message):
        export_heads(heads, model, tmp_path, fmt)


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "olmo2", "gemma2", "granite"])
def test_any_base_exports_what_a_llama_base_of_its_sizes_exports(tmp_path, arch):
    """The layer is a Llama layer of the base's sizes whatever the base (Qwen3's q/k norms, Phi-3's fused projections
    and partial rotary, OLMo-2's post-norms, Gemma-2's extra norms and GELU), so the file has exactly the names and
    shapes of a Llama base's export of the same sizes and the same config.json, but for the norm eps and rotary base
    its base sets; it reads back to the same heads."""
    from models.base import build_tiny_model
    from tests.test_base_architectures import ARCHS

    model, _ = build_tiny_model(arch, seed=0, **ARCHS[arch])
    llama, _ = build_tiny_model("llama", seed=0)
    files, heads = {}, {}
    for name, base in (("llama", llama), (arch, model)):
        heads[name] = eagle3_heads(base)
        report = export_heads(heads[name], base, tmp_path / name, "eagle3")
        files[name] = (load_file(str(tmp_path / name / "model.safetensors")),
                       json.loads((tmp_path / name / "config.json").read_text()), report["notes"])
    (ours, meta, notes), (theirs, llama_meta, _) = files[arch], files["llama"]
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    assert {k: v.shape for k, v in ours.items()} == expected_shapes(llama, VD)
    assert set(meta) == set(llama_meta)
    base_set = {"rms_norm_eps": model.config.rms_norm_eps, "rope_theta": float(model.config.rope_parameters["rope_theta"])}
    assert {k: v for k, v in meta.items() if k not in base_set} == \
        {k: v for k, v in llama_meta.items() if k not in base_set}
    assert {k: meta[k] for k in base_set} == base_set and meta["rope_scaling"] is None and meta["hidden_act"] == "silu"
    assert any(f"base model_type '{arch}'" in n for n in notes)
    back = import_heads(tmp_path / arch, model, "eagle3")
    assert all(torch.equal(back.state_dict()[k], v) for k, v in heads[arch].state_dict().items())


def test_import_refuses_a_folder_that_does_not_fit(tiny, tmp_path):
    """Taps other than ours, a wrong architecture, a misshapen tensor and a d2t that does not fit t2d: each an
    error naming the field."""
    model, _ = tiny
    export_heads(eagle3_heads(model, "shuffled"), model, tmp_path, "eagle3")
    meta = json.loads((tmp_path / "config.json").read_text())
    state = load_file(str(tmp_path / "model.safetensors"))

    def refused(message, meta_=meta, state_=state):
        (tmp_path / "config.json").write_text(json.dumps(meta_))
        save_file(state_, str(tmp_path / "model.safetensors"))
        with pytest.raises(ValueError, match=message):
            import_heads(tmp_path, model, "eagle3")

    refused(r"eagle_aux_hidden_state_layer_ids = \[2, 1, 0\]", {**meta, "eagle_aux_hidden_state_layer_ids": [2, 1, 0]})
    refused(r"eagle_config.eagle_aux_hidden_state_layer_ids \+ 1 = \[1, 1, 1\]",
            {**meta, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 0, 0]}})
    refused("accepted: LlamaForCausalLMEagle3", {**meta, "architectures": ["LlamaForCausalLM"]})
    refused("num_hidden_layers=2", {**meta, "num_hidden_layers": 2})
    refused("rope_theta=500000.0; eagle3 heads here need rope_theta=10000.0", {**meta, "rope_theta": 500000.0})
    up = state["midlayer.mlp.up_proj.weight"]
    refused(r"misshapen \['midlayer.mlp.up_proj.weight'\]", state_={**state, "midlayer.mlp.up_proj.weight": up[:-1]})
    refused(r"unexpected \['fc.bias'\]", state_={**state, "fc.bias": torch.zeros(model.config.hidden_size)})
    t2d = state["t2d"].clone()
    t2d[state["d2t"][0]] = ~t2d[state["d2t"][0]]
    refused("t2d does not mark exactly", state_={**state, "t2d": t2d})
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        import_heads(tmp_path, model, "eagle3")


def test_the_export_command_writes_and_imports_eagle3(tiny, compose_cfg):
    """pipelines.export: heads=eagle3 export.format=eagle3 writes the folder, export.import_from reads it back."""
    cfg = compose_cfg("heads=eagle3", "export.format=eagle3")
    from pipelines.common import load_model

    model, _ = load_model(cfg)
    heads = eagle3_heads(model)
    heads.save(f"{cfg.paths.results}/heads/eagle3")
    report = run_export(cfg)
    assert report["files"][0].endswith("results/export/eagle3-eagle3/model.safetensors")
    back = run_export(compose_cfg("export.format=eagle3",
                                  f"export.import_from={cfg.paths.results}/export/eagle3-eagle3"))
    assert back["family"] == "eagle3" and back["heads_dir"].endswith("results/heads/imported-eagle3")
