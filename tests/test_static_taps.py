"""EAGLE-3 under the static step (models/engine/static_step.py, models/engine/taps.py step_taps): the StaticDecoder
writes the drafter's taps into its tap_buffer inside the fixed-shape forward (on the CPU run eagerly, mode
"static_eager"), the engine reads them through step_taps, and they are LayerTaps' features of the same forward; so
greedy decoding drafts and emits exactly what the eager step does (float32), on a 7-layer base (taps (2, 3, 4)) and
on the 2-layer tiny one (taps (2, 1, 1): tap 2 = L is the last layer's output before the final norm)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from models.base import build_tiny_model
from models.engine.acceptance import SamplingConfig
from models.engine.decoding import generate, prefill, verify_tree
from models.engine.drafting import make_drafter
from models.engine.kv_cache import cache_kwargs
from models.engine.static_step import StaticDecoder, attach_static
from models.engine.taps import LayerTaps, WrittenTaps, step_taps
from models.engine.trees import TreeBuffers, tree_from_config
from tests.test_decoding import TREES, cyclic_prompt
from tests.test_eagle3 import DEEP_TAPS, deep_model, eagle3_heads

pytestmark = pytest.mark.usefixtures("one_thread")

BASES = {"deep": (lambda: deep_model(seed=3), DEEP_TAPS), "tiny": (lambda: build_tiny_model(seed=3), (2, 1, 1))}


def eagle3_lookup(heads):
    """EAGLE-3's sparse64 tree with prompt lookup's chain merged in: on a repetitive prompt it accepts paths of up to
    7 tokens, so verify steps of many tokens go through the static taps. Its drafts are recorded (`seen`): the
    EAGLE-3 part of each follows the taps it was handed."""
    drafter = make_drafter({"kind": "heads_lookup", "tree": TREES["sparse64"], "lookup": {"num_tokens": 6}},
                           heads=heads)
    drafter.seen, draft = [], drafter.draft

    def recorded(root, max_depth):
        out = draft(root, max_depth)
        drafter.seen.append(None if out is None else out.tokens.tolist())
        return out
    drafter.draft = recorded
    return drafter


@pytest.mark.parametrize("base", list(BASES))
def test_eagle3_under_the_static_step_drafts_and_decodes_what_the_eager_step_does(base):
    make, taps = BASES[base]
    model, tok = make()
    heads = eagle3_heads(model, depths=4, noise=0.2).eval()
    ids = cyclic_prompt(model, tok)
    eager, static = eagle3_lookup(heads), eagle3_lookup(heads)
    assert eager.taps == taps
    want = generate(model, tok, ids, eager, max_new_tokens=40, stop_token_ids=[], static=False)
    got = generate(model, tok, ids, static, max_new_tokens=40, stop_token_ids=[], static=True)
    assert got.new_tokens == want.new_tokens
    assert got.accept_lengths == want.accept_lengths and max(got.accept_lengths) > 2
    assert static.seen == eager.seen                         # every draft read the same taps
    with torch.inference_mode():                            # the kept StaticDecoder's buffers are generate()'s
        state = prefill(model, torch.tensor([ids]), SamplingConfig(), drafter=eagle3_lookup(heads))
        kept = attach_static(state, static, max_new_tokens=40)
    assert isinstance(kept, StaticDecoder) and state.decoder is kept and kept.static_taps == taps
    assert kept.tap_buffer.shape == (1, kept.buckets[-1], 3 * model.config.hidden_size)


def tree_step(tokens_of: int):
    """A 6-token tree step (the root and 5 nodes, two branches) whose tokens start at `tokens_of`."""
    tree = tree_from_config({"name": "t", "kind": "paths", "top_k": 10,
                             "paths": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]})
    buf = TreeBuffers.build(tree)
    return torch.arange(tokens_of, tokens_of + buf.num_tokens), buf


def forward(decoder, cache, past, step):
    """A tree step (tree_step) through verify_tree, or with step None a plain 1-token step."""
    if step is None:
        decoder(input_ids=torch.tensor([[7]]), position_ids=torch.tensor([[past]]), use_cache=True,
                **cache_kwargs(decoder, cache))
    else:
        verify_tree(decoder, *step, cache, past, torch.float32)


@pytest.mark.parametrize("base", list(BASES))
def test_the_static_taps_of_a_step_are_layer_taps_of_the_same_forward(base):
    """Two tree steps (the same verify size: the buffer rewritten) and a plain one through the StaticDecoder under
    step_taps: LayerTaps' hooks on the same layers record the same rows of the same forward, and the eager decoder's
    forward of the step the same up to the padded shapes' rounding; what was handed out are copies."""
    make, taps = BASES[base]
    model, _ = make()
    h = model.config.hidden_size
    ids = torch.randint(0, model.config.vocab_size, (1, 17), generator=torch.Generator().manual_seed(0))
    eager, state = prefill(model, ids, SamplingConfig()), prefill(model, ids, SamplingConfig())
    static = attach_static(state, SimpleNamespace(taps=taps), max_new_tokens=16, capture=False)
    assert static.mode == "static_eager"
    kept = []
    with torch.no_grad():
        for step in (tree_step(3), tree_step(40), None):
            with LayerTaps(eager.decoder, taps) as plain:
                forward(eager.decoder, eager.cache, eager.past, step)
            with step_taps(state.decoder, taps) as written, LayerTaps(state.decoder, taps) as hooked:
                forward(state.decoder, state.cache, state.past, step)
            assert isinstance(written, WrittenTaps) and written.taps == taps
            got, n = written.features(), 1 if step is None else 6
            assert got.shape == (1, n, 3 * h) and hooked.features().shape == (1, static.bucket(n), 3 * h)
            torch.testing.assert_close(got, hooked.features()[:, :n], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(got, plain.features(), rtol=1e-4, atol=1e-4)
            kept.append((got, got.clone()))
            eager.past = state.past = state.cache.get_seq_length()
    for got, copy in kept:                                    # later steps did not overwrite what was handed out
        assert torch.equal(got, copy)
    torch.testing.assert_close(static.tap_features((taps[2], taps[0])), torch.cat([got[..., 2 * h:], got[..., :h]], -1))
    assert step_taps(state.decoder, ()).features() is None
    with pytest.raises(RuntimeError, match="no step ran"):
        step_taps(state.decoder, taps).features()


def test_a_model_keeps_one_static_decoder_for_drafters_reading_its_taps_or_fewer():
    """A drafter reading some of a kept StaticDecoder's taps, or none, reuses it (its graphs); one reading a layer it
    does not write gets a new one, writing that drafter's taps."""
    model, _ = deep_model(seed=0)
    ids = torch.tensor([list(range(5, 25))])

    def attached(taps):
        state = prefill(model, ids, SamplingConfig())
        return attach_static(state, SimpleNamespace(taps=taps), max_new_tokens=8, capture=False)
    first = attached(DEEP_TAPS)
    assert attached(()) is first and attached((4, 2)) is first
    other = attached((5,))
    assert other is not first and other.static_taps == (5,) and attached(None) is other
