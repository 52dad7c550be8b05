"""pytest tests/test_logit_transforms.py: the engine's base logits are the model's own, its forward's transform
included (Granite's logits_scaling, Cohere's logit_scale, Gemma-2's final_logit_softcapping), checked against
model(input_ids).logits once per model; a model whose logits the engine cannot reproduce is refused.
(tests/test_sampling.py shows sampling from a Granite is lossless only with the transform.)
"""
import pytest
import torch

from models.engine.drafting import heads_drafter
from models.base import build_tiny_model
from models.engine.decoding import generate
from models.engine.projection import base_logits, project
from models.engine.trees import dense_tree
from models.shared import HeadsConfig
from models.methods import build_heads

pytestmark = pytest.mark.usefixtures("one_thread")

# strong settings: each changes the distribution a lot (tiny random logits are about +-5)
TRANSFORMS = {"granite": {"logits_scaling": 4.0}, "cohere": {"logit_scale": 0.25},
              "gemma2": {"final_logit_softcapping": 2.0}}
IDS = torch.tensor([[5, 60, 7, 200, 33]])


def last_hidden(model, ids=IDS):
    return model.get_decoder()(input_ids=ids).last_hidden_state[0]


@pytest.mark.parametrize("arch", sorted(TRANSFORMS))
@torch.inference_mode()
def test_engine_logits_are_the_models_own(arch):
    model, _ = build_tiny_model(arch=arch, seed=2, **TRANSFORMS[arch])
    fn = base_logits(model)
    assert [name for _, name, _ in fn.steps] == list(TRANSFORMS[arch])
    ref, hidden = model(IDS).logits[0], last_hidden(model)
    torch.testing.assert_close(fn(hidden), ref, rtol=1e-5, atol=1e-5)
    raw = project(model.get_output_embeddings(), hidden)
    assert (raw - ref).abs().max() > 1.0                     # lm_head alone is far from the model's logits


@torch.inference_mode()
def test_a_plain_lm_head_gets_no_extra_op(tiny_model):
    model, _ = tiny_model
    fn = base_logits(model)
    hidden = last_hidden(model)
    assert fn.steps == () and torch.equal(fn(hidden), project(model.get_output_embeddings(), hidden))


@pytest.mark.parametrize("arch", sorted(TRANSFORMS))
def test_greedy_decoding_of_a_transforming_model_is_its_own(arch):
    """The engine serves these architectures: the baseline is the model's own generate(), speculative = baseline."""
    model, tok = build_tiny_model(arch=arch, seed=4, **TRANSFORMS[arch])
    prompt = list(range(30, 50))
    ours = generate(model, tok, prompt, max_new_tokens=12, stop_token_ids=[]).new_tokens
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    heads = build_heads(HeadsConfig.for_base(model, "hydra", num_heads=2), model).eval()
    spec = generate(model, tok, prompt, heads_drafter(heads, dense_tree(2, 2)), max_new_tokens=12, stop_token_ids=[])
    assert ours == ref and spec.new_tokens == ours


def test_an_unknown_transform_is_refused(tiny_model):
    """A forward that scales its logits with no config setting saying so: refused, not decoded from lm_head."""
    model, tok = tiny_model

    def scale(module, args, out):
        out.logits = out.logits * 3.0
        return out

    model.register_forward_hook(scale)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM \(model_type 'llama'\).*no transform.*refusing"):
        base_logits(model)
    with pytest.raises(ValueError, match="refusing"):
        generate(model, tok, [1, 2, 3], max_new_tokens=2)


def test_a_setting_the_forward_ignores_is_refused_by_name(tiny_model):
    """Llama's forward ignores logit_scale: the engine would apply it, so the check names it and refuses."""
    model, _ = tiny_model
    model.config.logit_scale = 0.5
    with pytest.raises(ValueError, match=r"multiply by logit_scale=0\.5.*refusing"):
        base_logits(model)


def test_checked_once_per_model_and_again_when_its_setting_changes():
    model, _ = build_tiny_model(arch="granite", seed=2, logits_scaling=4.0)
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    fn = base_logits(model)
    assert base_logits(model) is fn and len(forwards) == 1      # the check's one forward, then the cache
    model.config.logits_scaling = 2.0                           # the model's forward reads it too
    assert base_logits(model).steps == (("divide", "logits_scaling", 2.0),) and len(forwards) == 2
