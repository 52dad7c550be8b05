"""EAGLE-1 (models/methods/eagle/eagle.py, models/shared/autoregressive/proposer.py) on tiny random models: greedy decoding equals
the baseline, the draft cache holds exactly the accepted pairs (equal to one run over the whole sequence), every
drafted node is what the draft layer run from scratch over its path proposes, rewinding restores the state, and a
sampled draft's q covers the full vocabulary."""
from __future__ import annotations

import pytest
import torch

from models.base import build_tiny_model
from models.engine.decoding import SamplingConfig, decode_step, generate, prefill, time_step
from models.engine.drafting import DraftContext
from models.methods.eagle.drafter import EagleDrafter
from models.engine.trees import TreeBuffers, tree_from_config
from models.methods.eagle.eagle import EagleModule
from tests.lossless_rule import assert_greedy_lossless
from tests.test_decoding import TREES, cyclic_prompt, prompt_ids
from tests.tolerances import reduction_tolerance

SMALL_TREE = tree_from_config({"kind": "paths", "top_k": 3, "paths": [[0], [1], [2], [0, 0], [0, 1], [1, 0],
                                                                      [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]]})


def eagle_for(arch="llama", seed=4, eagle_seed=1):
    model, tok = build_tiny_model(arch=arch, seed=seed)
    return model, tok, EagleModule.from_base(model, seed=eagle_seed)


def sequence(model, ids):
    """The base's final hidden states [T, h] of ids (a list)."""
    with torch.inference_mode():
        return model.get_decoder()(input_ids=torch.tensor([ids])).last_hidden_state[0]


def test_the_module_fuses_embedding_and_feature_and_saves_only_its_own_weights():
    model, _, eagle = eagle_for()
    h = model.config.hidden_size
    assert eagle.fc.in_features == 2 * h and eagle.fc.out_features == h and eagle.fc.bias is not None
    assert isinstance(eagle.layers[0].input_layernorm, torch.nn.Identity)
    assert type(eagle.layers[0]) is type(model.get_decoder().layers[-1])
    keys = set(eagle.state_dict())
    assert keys and all(k.startswith(("fc.", "layers.0.")) for k in keys)          # base parts by reference only
    assert eagle.lm_head is model.get_output_embeddings()
    again = EagleModule.from_base(model, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(eagle.state_dict().values(), again.state_dict().values()))
    base_q = model.get_decoder().layers[-1].self_attn.q_proj.weight
    assert not torch.equal(eagle.layers[0].self_attn.q_proj.weight, base_q)         # re-initialised, not the base's
    feats, toks = torch.randn(2, 5, h), torch.randint(0, model.config.vocab_size, (2, 5))
    with torch.inference_mode():
        out = eagle(feats, toks, torch.arange(5).expand(2, 5))
        assert out.shape == (2, 5, h) and eagle.logits(out).shape == (2, 5, model.config.vocab_size)
        # causal: a position does not see later ones; the embedding of the token matters
        torch.testing.assert_close(eagle(feats[:, :3], toks[:, :3], torch.arange(3).expand(2, 3)), out[:, :3],
                                   rtol=1e-4, atol=1e-5)
        other = eagle(feats, (toks + 1) % model.config.vocab_size, torch.arange(5).expand(2, 5))
    assert not torch.allclose(other, out)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_greedy_eagle_equals_baseline(arch):
    model, tok, eagle = eagle_for(arch, seed=3)
    ids = prompt_ids(tok)
    base = generate(model, tok, ids, max_new_tokens=24, stop_token_ids=[])
    for name in ("chain4", "sparse64"):
        res = generate(model, tok, ids, EagleDrafter(eagle, TREES[name]),
                       max_new_tokens=24, stop_token_ids=[])
        assert res.new_tokens == base.new_tokens, (arch, name)
        assert len(res.new_tokens) == 1 + sum(res.accept_lengths)



def test_greedy_eagle_equals_baseline_on_short_prompts_and_a_bf16_base():
    """A 1-token prompt (no accepted pair at the start: an empty draft cache) and a bf16 base (the module
    computes in float32, the logits come from the bf16 LM head)."""
    model, tok, eagle = eagle_for(seed=3)
    for ids in ([5], [5, 6]):
        base = generate(model, tok, ids, max_new_tokens=8, stop_token_ids=[])
        res = generate(model, tok, ids, EagleDrafter(eagle, SMALL_TREE),
                       max_new_tokens=8, stop_token_ids=[])
        assert res.new_tokens == base.new_tokens
    model = model.to(torch.bfloat16)
    eagle = EagleModule.from_base(model, seed=1)
    assert eagle.dtype == torch.float32
    ids = prompt_ids(tok)
    base = generate(model, tok, ids, max_new_tokens=12, stop_token_ids=[])
    res = generate(model, tok, ids, EagleDrafter(eagle, TREES["sparse64"]),
                   max_new_tokens=12, stop_token_ids=[])
    assert_greedy_lossless(model, ids, base, res)          # bf16: equal, or apart first at a bf16 tie

def test_the_draft_cache_holds_exactly_the_accepted_pairs():
    """After start + advances (and drafts in between) the draft cache equals the layer run once, causally, over
    every accepted pair (f_t, x_{t+1}), and the kept feature is the last accepted position's."""
    model, tok, eagle = eagle_for()
    ids = prompt_ids(tok)[:20]
    hidden = sequence(model, ids)                                               # [20, h]
    with torch.inference_mode():
        drafter = EagleDrafter(eagle, SMALL_TREE)
        drafter.start(DraftContext(torch.tensor(ids[:9]), hidden[:9], SamplingConfig()))
        assert drafter.cache.get_seq_length() == 8
        drafter.draft(ids[9], 4)
        drafter.advance(hidden[9:10], ids[9:10], 9)
        drafter.draft(ids[10], 4)
        drafter.advance(hidden[10:20], ids[10:20], 10)
        drafter.draft(5, 2)
        ref_cache = type(drafter.cache)()
        full = eagle(hidden[None, :19], torch.tensor([ids[1:20]]), torch.arange(19)[None], cache=ref_cache)
    assert drafter.cache.get_seq_length() == 19
    for got, want in zip(drafter.cache.layers, ref_cache.layers, strict=True):
        torch.testing.assert_close(got.keys, want.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.values, want.values, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(drafter.feature, hidden[19])
    assert not torch.allclose(full[0, -1], hidden[-1], atol=1e-2)             # the layer is not the identity
    with pytest.raises(ValueError, match="cannot advance from position 12"):
        drafter.advance(hidden[12:14], ids[12:14], 12)


def oracle_features(eagle, prefix_feats, prefix_tokens, feature, buf, tokens):
    """Each node's predicted feature, from scratch: the layer run causally, without a cache, over the accepted
    pairs and then the node's path, the root's pair (f_{P-1}, root), each deeper node's (parent's prediction,
    its token). -> {node: [h]}"""
    parent = buf.parent.tolist()
    pred = {}
    for node in range(buf.num_tokens):
        path = [node]
        while parent[path[0]] >= 0:
            path.insert(0, parent[path[0]])
        feats = torch.stack([feature] + [pred[parent[j]] for j in path[1:]])
        f = torch.cat([prefix_feats, feats])[None]
        t = torch.cat([prefix_tokens, tokens[path]])[None]
        pred[node] = eagle(f, t, torch.arange(f.shape[1])[None])[0, -1]
    return pred


@pytest.mark.parametrize("tree", ["chain4", "small", "sparse64"])
def test_every_drafted_node_is_the_layers_top_rank_over_its_path(tree):
    """The batched per-depth draft with its tree mask proposes, below every node, the ranks the layer gives when
    run from scratch over the accepted pairs and that node's path; node_probs are the products of the draft's
    softmax probabilities along the path."""
    model, tok, eagle = eagle_for()
    ids = prompt_ids(tok)[:16]
    hidden = sequence(model, ids)
    spec = SMALL_TREE if tree == "small" else TREES[tree]
    with torch.inference_mode():
        drafter = EagleDrafter(eagle, spec, want_probs=True)
        drafter.start(DraftContext(torch.tensor(ids[:12]), hidden[:12], SamplingConfig()))
        drafter.advance(hidden[12:16], ids[12:16], 12)
        d = drafter.draft(7, 10)
        buf, tokens = d.buf, d.tokens
        pred = oracle_features(eagle, hidden[:15], torch.tensor(ids[1:16]), hidden[15], buf, tokens)
        assert drafter.cache.get_seq_length() == 15                            # drafted rows cropped off
        assert tokens[0] == 7 and buf.num_tokens == spec.num_nodes + 1
        for i in range(1, buf.num_tokens):
            p = int(buf.parent[i])
            logits = eagle.logits(pred[p])
            rank = int(buf.ranks[i])
            assert int(tokens[i]) == int(torch.topk(logits, rank + 1).indices[rank]), i
            q = torch.softmax(logits.double(), -1)[tokens[i]]
            torch.testing.assert_close(float(d.node_probs[i]), float(d.node_probs[p] * q), rtol=1e-4, atol=1e-7)
    assert float(d.node_probs[0]) == 1.0 and d.draft_q is None


def test_rewind_restores_the_state_and_the_drafts():
    model, tok, eagle = eagle_for()
    ids = prompt_ids(tok)[:24]
    hidden = sequence(model, ids)
    with torch.inference_mode():
        drafter = EagleDrafter(eagle, TREES["sparse64"], want_probs=True)
        drafter.start(DraftContext(torch.tensor(ids[:10]), hidden[:10], SamplingConfig()))
        drafter.advance(hidden[10:13], ids[10:13], 10)
        keys = [layer.keys.clone() for layer in drafter.cache.layers]
        before = drafter.draft(ids[13], 4)
        drafter.advance(hidden[13:14], ids[13:14], 13)
        drafter.advance(hidden[14:20], ids[14:20], 14)
        drafter.rewind(13)
        assert drafter.cache.get_seq_length() == 12
        assert all(torch.equal(layer.keys, k) for layer, k in zip(drafter.cache.layers, keys))
        torch.testing.assert_close(drafter.feature, hidden[12])
        after = drafter.draft(ids[13], 4)
        assert torch.equal(after.tokens, before.tokens) and torch.equal(after.node_probs, before.node_probs)
        with pytest.raises(ValueError, match="not to position 15"):
            drafter.rewind(15)


def test_time_step_rewinds_the_eagle_drafter():
    """time_step takes real steps and rewinds base and drafter: decoding after it emits the same tokens, with the
    same accepted lengths, as decoding without it."""
    model, tok, eagle = eagle_for(seed=3)
    ids = cyclic_prompt(model, tok)
    spec = SMALL_TREE
    want = generate(model, tok, ids, EagleDrafter(eagle, spec), max_new_tokens=12,
                    stop_token_ids=[])
    with torch.inference_mode():
        drafter = EagleDrafter(eagle, spec)
        state = prefill(model, torch.tensor([ids]), SamplingConfig(), drafter=drafter)
        got, lengths = [state.root], []
        tokens, _ = decode_step(state, drafter, max_depth=4)
        got, lengths = got + tokens, lengths + [len(tokens)]
        past, root, rows = state.past, state.root, drafter.cache.get_seq_length()
        parts = time_step(state, drafter, max_depth=4, repeats=3)
        assert len(parts) == 3 and all(p["step"] > 0 for p in parts)
        assert (state.past, state.root, drafter.cache.get_seq_length()) == (past, root, rows) and rows == past - 1
        while len(got) < 12:
            tokens, _ = decode_step(state, drafter, max_depth=min(4, 12 - len(got) - 1))
            got, lengths = got + tokens, lengths + [len(tokens)]
    assert got[:12] == want.new_tokens and lengths == want.accept_lengths


def test_a_bare_eagle_drafters_sampled_draft_covers_the_full_vocabulary():
    model, _, eagle = eagle_for()
    drafter = EagleDrafter(eagle, TreeBuffers.build(TREES["chain4"]))
    assert isinstance(drafter, EagleDrafter) and drafter.buf.spec == TREES["chain4"]
    sampled = SamplingConfig(temperature=0.7, top_k=5, acceptance="sampling", draft="sample")   # sampled drafts: q
    drafter.start(DraftContext(torch.arange(4), torch.randn(4, model.config.hidden_size), sampled,
                               torch.Generator().manual_seed(0)))
    draft = drafter.draft(5, 4)
    q = draft.draft_q(0)                                                     # the root's q over the full vocabulary
    assert q.shape == (model.config.vocab_size,) and abs(float(q.sum()) - 1) < 1e-5 and int((q > 0).sum()) == 5
    assert bool((q[draft.tokens[draft.buf.children[0]]] > 0).all())


def test_unroll_is_every_positions_chain_along_its_true_tokens():
    """unroll(depths=3) row r of depth k equals the layer run from scratch over the true pairs up to r and then
    the chain (previous prediction, next true token): what the drafter computes when every parent is right."""
    model, tok, eagle = eagle_for()
    ids = prompt_ids(tok)[:14]
    hidden = sequence(model, ids)
    with torch.inference_mode():
        preds = eagle.unroll(hidden[None], torch.tensor([ids]), depths=3)
        assert [tuple(p.shape) for p in preds] == [(1, 13, hidden.shape[-1])] * 3
        for r in (0, 5, 10):
            feats, toks = list(hidden[:r + 1]), list(ids[1:r + 2])
            for k in range(3):
                out = eagle(torch.stack(feats)[None], torch.tensor([toks]), torch.arange(len(feats))[None])[0, -1]
                # k + 1 chained layers, each summing at most max(2h, intermediate) terms
                tol = reduction_tolerance(out.dtype, max(2 * hidden.shape[-1], model.config.intermediate_size),
                                          out.abs().max(), chained=k + 1)
                torch.testing.assert_close(preds[k][0, r], out, **tol)
                if r + k + 2 < len(ids):
                    feats.append(out)
                    toks.append(ids[r + k + 2])
