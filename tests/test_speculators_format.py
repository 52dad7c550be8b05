"""EAGLE-3 heads exported as a speculators checkpoint (models/methods/eagle/speculators_format.py), without the library: the
draft the library ran on a seeded export (tests/golden/speculators_interop.json, written by `make interop`) is ours
to 1e-5 with the same argmax; the file's names, shapes and tensors; every config field read back, with
norm_before_residual written out; and what is refused."""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from models.base import build_tiny_model
from models.methods import export_heads
from models.methods.eagle.interop import DEPTHS, DRAFT_VOCAB, draft_inputs, draft_logits, interop_base, seeded_eagle3_heads
from pipelines.common import REPO_ROOT
from pipelines.export import run_export
from pipelines.interop import checks, passed
from tests.test_formats import make_heads
from tests.tolerances import reduction_tolerance

pytestmark = pytest.mark.usefixtures("one_thread")
GOLDEN = REPO_ROOT / "tests" / "golden" / "speculators_interop.json"


@pytest.fixture(scope="module")
def base():
    return interop_base()[0]


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


def test_our_draft_gives_the_logits_the_speculators_library_gave(base, golden):
    """The seeded draft rebuilt here, on the golden inputs: the library's top-k values at its top-k ids within
    1e-5 and the same argmax at every row; the inputs are the base's taps on the golden tokens (within what the
    base's reductions in float32 allow)."""
    heads = seeded_eagle3_heads(base, golden["seed"])
    assert heads.draft_ids.tolist() == golden["draft_ids"]
    inputs = draft_inputs(base, heads, golden["seed"])
    assert inputs["input_ids"] == golden["tokens"]
    hidden = torch.tensor(golden["hidden_states"])
    # the taps went through the base's layers on the CPU that wrote the golden file: other kernels sum in other
    # orders there (2.8e-5 apart on an AVX2 CPU from a golden file written on an AVX512 one), so the bound is the
    # dtype's over those reductions; a wrong tap or layer is off by O(1)
    c = base.config
    torch.testing.assert_close(inputs["hidden_states"], hidden, **reduction_tolerance(
        torch.float32, max(c.hidden_size, c.intermediate_size), hidden.abs().max().item(), chained=c.num_hidden_layers))
    ours = draft_logits(heads, {"hidden_states": hidden, "next_tokens": torch.tensor(golden["tokens"][1:]),
                                "position_ids": torch.tensor(golden["position_ids"])})
    ids, values = torch.tensor(golden["topk_ids"]), torch.tensor(golden["topk_values"])
    assert ours.shape == (len(golden["tokens"]) - 1, DRAFT_VOCAB) and ids.shape[0] == ours.shape[0]
    torch.testing.assert_close(ours.gather(1, ids), values, atol=1e-5, rtol=0)
    assert torch.equal(ours.argmax(-1), ids[:, 0])


def test_the_file_is_eagle3s_tensors_under_layers_0_with_the_base_embedding(base, tmp_path):
    heads = seeded_eagle3_heads(base)
    export_heads(heads, base, tmp_path / "eagle3", "eagle3")
    export_heads(heads, base, tmp_path / "spec", "speculators")
    old = load_file(str(tmp_path / "eagle3" / "model.safetensors"))
    new = load_file(str(tmp_path / "spec" / "model.safetensors"))
    renamed = {k.replace("midlayer.", "layers.0.", 1): v for k, v in old.items()}
    assert set(new) == set(renamed) | {"embed_tokens.weight"}
    assert all(torch.equal(new[k], v) for k, v in renamed.items())
    assert sum(k.startswith("layers.0.") for k in new) == 10 and not any(k.startswith("midlayer.") for k in new)
    assert torch.equal(new["embed_tokens.weight"], base.get_input_embeddings().weight.detach())
    assert new["lm_head.weight"].shape == (DRAFT_VOCAB, base.config.hidden_size)
    assert torch.equal(new["d2t"] + torch.arange(DRAFT_VOCAB), heads.draft_ids)


def test_the_config_carries_every_field_norm_before_residual_written_out(base, tmp_path):
    heads = seeded_eagle3_heads(base)
    report = export_heads(heads, base, tmp_path, "speculators")
    meta = json.loads((tmp_path / "config.json").read_text())
    c = base.config
    assert meta["architectures"] == ["Eagle3Speculator"] and meta["speculators_model_type"] == "eagle3"
    assert meta["speculators_version"] == "0.9.0" and meta["draft_vocab_size"] == DRAFT_VOCAB
    assert "norm_before_residual" in meta and meta["norm_before_residual"] is False     # vLLM's default is true
    assert meta["eagle_aux_hidden_state_layer_ids"] == list(heads.eagle3.taps) == [2, 4, 5]
    assert not (meta["norm_before_fc"] or meta["fc_norm"] or meta["norm_output"] or meta["embed_requires_grad"])
    layer = meta["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rms_norm_eps", "max_position_embeddings"):
        assert layer[key] == getattr(c, key), key
    assert layer["rope_parameters"] == {"rope_theta": c.rope_parameters["rope_theta"], "rope_type": "default"}
    assert layer["rope_theta"] == c.rope_parameters["rope_theta"] and layer["hidden_act"] == "silu"
    assert layer["attn_implementation"] in ("eager", "sdpa") and layer["attention_bias"] is False
    spec = meta["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": DEPTHS,
                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}]
    assert spec["verifier"] == {"name_or_path": "tiny-random-llama", "architectures": ["LlamaForCausalLM"]}
    assert report["format"] == "speculators" and len(report["files"]) == 2


def test_a_full_vocabulary_draft_has_no_vocabulary_maps(base, tmp_path):
    heads = make_heads(base, "eagle3", shared=False)
    export_heads(heads, base, tmp_path, "speculators")
    assert not {"d2t", "t2d"} & set(load_file(str(tmp_path / "model.safetensors")))
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == base.config.vocab_size


@pytest.mark.parametrize("family, formats", [("medusa", "format=medusa or format=vllm"),
                                             ("hydra", "format=hydra"), ("hydra_pp", "format=hydra"),
                                             ("eagle", "format=eagle")])
def test_families_speculators_has_no_layout_for_are_refused_naming_their_formats(base, tmp_path, family, formats):
    heads = make_heads(base, family, shared=family != "hydra")
    with pytest.raises(ValueError, match=re.escape(f"(speculators 0.9 has no layout for them); export them with "
                                                   f"{formats}")):
        export_heads(heads, base, tmp_path, "speculators")
    assert list(tmp_path.iterdir()) == []


def test_a_non_empty_folder_or_a_base_with_repeated_taps_is_refused(base, tmp_path):
    (tmp_path / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="is not empty"):
        export_heads(seeded_eagle3_heads(base), base, tmp_path, "speculators")
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    small, _ = build_tiny_model("llama", num_layers=2)                  # taps (2, 1, 1)
    with pytest.raises(ValueError, match=r"taps \[2, 1, 1\] on a 2-layer base.*format=eagle3"):
        export_heads(seeded_eagle3_heads(small), small, tmp_path / "new", "speculators")
    assert not (tmp_path / "new").exists()                             # the refused export left no folder


def test_the_export_command_writes_the_speculators_format(compose_cfg):
    cfg = compose_cfg("heads=eagle3", "export.format=speculators", "model.tiny.num_layers=8")
    from pipelines.common import load_model

    model, _ = load_model(cfg)
    seeded_eagle3_heads(model).save(f"{cfg.paths.results}/heads/eagle3")
    report = run_export(cfg)
    assert report["files"][0].endswith("results/export/eagle3-speculators/model.safetensors")
    with pytest.raises(FileExistsError):
        run_export(cfg)


def test_the_interop_verdict_fails_on_a_stray_key_or_a_logit_difference():
    """pipelines.interop's verdict on the library's result: clean, then each way it must fail."""
    ours = torch.tensor([[0.0, 1.0], [2.0, 0.5]])
    good = {"logits": ours.tolist(), "keys_not_in_file": [], "file_keys_not_in_model": [], "nan_parameters": [],
            "file_tensors_loaded_unchanged": True,
            "loading_report": {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}}
    assert passed(checks(good, ours))
    for bad in ({**good, "loading_report": {**good["loading_report"], "missing_keys": ["embed_tokens.weight"]}},
                {**good, "loading_report": {**good["loading_report"], "unexpected_keys": ["midlayer.fc.weight"]}},
                {**good, "nan_parameters": ["lm_head.weight"]}, {**good, "file_tensors_loaded_unchanged": False},
                {**good, "logits": (ours + 2e-5).tolist()}, {**good, "logits": [[0.0, 1.0], [0.4, 0.5]]}):
        assert not passed(checks(bad, ours))
