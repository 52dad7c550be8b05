"""models.methods.load_for_decoding: trained heads loaded for decoding in one call (the LoRA merged, on a copy when the
caller keeps its base, both packed), and the one factory that gives every head family its proposer."""
from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from models.base import build_tiny_model
from models.engine.decoding import generate
from models.engine.drafting import heads_drafter, proposer_for
from models.engine.fast_inference import is_packed
from models.shared import ADAPTER_DIR, HeadsConfig
from models.methods import build_heads
from models.shared.autoregressive.proposer import AutoregressiveProposer
from models.methods import load_for_decoding
from models.methods.hydra.proposer import HydraProposer
from models.methods.medusa.proposer import MedusaProposer
from tests.test_decoding import TREES, prompt_ids


def saved_heads(tmp_path, model, with_adapter: bool):
    heads = build_heads(HeadsConfig.for_base(model, "medusa", 4, 1, share_lm_head=True), model).eval()
    heads.save(tmp_path / "heads")
    if with_adapter:                                        # a Medusa-2 backbone: LoRA on its linears, moved
        torch.manual_seed(0)
        peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, lora_alpha=4, target_modules="all-linear",
                                                                init_lora_weights=False))
        peft.save_pretrained(str(tmp_path / "heads" / ADAPTER_DIR))
    return tmp_path / "heads"


@pytest.mark.parametrize("with_adapter", [False, True], ids=["heads", "heads+lora"])
def test_load_for_decoding_merges_on_a_copy_when_asked_and_packs_both(tmp_path, with_adapter):
    model, tok = build_tiny_model(seed=1)
    folder = saved_heads(tmp_path, model, with_adapter)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    decoded, heads, adapted = load_for_decoding(folder, model, keep_base=True)
    assert adapted == with_adapter and (decoded is not model) == with_adapter
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())          # the base kept as it was
    q = decoded.get_decoder().layers[0].self_attn.q_proj
    assert is_packed(q) or not torch.backends.mkldnn.is_available()
    changed = not torch.equal(q.weight, model.get_decoder().layers[0].self_attn.q_proj.weight)
    assert changed == with_adapter                                                        # the LoRA merged
    ids = prompt_ids(tok)
    base = generate(decoded, tok, ids, max_new_tokens=12, stop_token_ids=[])
    res = generate(decoded, tok, ids, heads_drafter(heads, TREES["chain4"]), max_new_tokens=12, stop_token_ids=[])
    assert res.new_tokens == base.new_tokens


@pytest.mark.parametrize("family,proposer", [("medusa", MedusaProposer), ("hydra", HydraProposer),
                                             ("hydra_pp", HydraProposer), ("eagle", AutoregressiveProposer),
                                             ("eagle3", AutoregressiveProposer),
                                             ("draft_model", AutoregressiveProposer)])
def test_every_head_family_gets_its_proposer(family, proposer):
    model, _ = build_tiny_model(num_layers=7, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                intermediate_size=64, seed=1)
    heads = build_heads(HeadsConfig.for_base(model, family, 2, 1, share_lm_head=family == "medusa"), model)
    assert type(proposer_for(heads)) is proposer


def test_heads_that_carry_no_method_are_refused_with_what_to_do():
    class Unknown:
        config = type("Config", (), {"family": "no_such_family"})()

    with pytest.raises(ValueError, match="Unknown carries no method.*models.methods.build_heads"):
        proposer_for(Unknown())
