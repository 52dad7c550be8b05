"""pytest tests/test_cache_argument.py: the engine hands the KV cache to transformers under the name the installed
version takes (`cache` from 5.24 on, `past_key_values` before), so no step passes a deprecated argument.

Every drafter kind that runs layers of its own (EAGLE's and EAGLE-3's layers, the draft model, Hydra++'s prefix
layer, DFlash) decodes a few steps, batched and not, with every warning recorded: none may name
`past_key_values`.
"""
import inspect
import warnings

import pytest
import torch

from models.engine.batch import generate_batch
from models.engine.decoding import generate
from models.engine.kv_cache import cache_kwargs, given_cache
from tests.test_batch import DRAFTERS, NEW


def test_the_name_is_one_the_forward_takes(tiny_model):
    model, _ = tiny_model
    for module in (model, model.get_decoder(), model.get_decoder().layers[0]):
        (name,) = cache_kwargs(module, None)
        assert name in inspect.signature(type(module).forward).parameters
    assert given_cache({"cache": 1}) == 1 and given_cache({"past_key_values": 2}) == 2 and given_cache({}) is None


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
def test_no_step_passes_a_deprecated_cache_argument(tiny_model, kind):
    model, tok = tiny_model
    make = DRAFTERS[kind](model)
    prompts = [list(range(10, 30)), list(range(40, 52))]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        generate(model, tok, prompts[0], make() if make else None, max_new_tokens=NEW, stop_token_ids=[])
        generate_batch(model, tok, prompts, [make() for _ in prompts] if make else None, max_new_tokens=NEW,
                       stop_token_ids=[])
    named = [str(w.message) for w in seen if "past_key_values" in str(w.message)]
    assert not named, named[:3]
