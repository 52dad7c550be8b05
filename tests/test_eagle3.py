"""EAGLE-3 as a head family (models/methods/eagle/eagle3.py, models/engine/taps.py, family eagle3): the taps are transformers'
hidden states at EAGLE-3's layers; the module fuses them with fc, runs its layer as documented and reads out through
its own final norm; the decode step hands the drafter the same taps training and calibration read (every drafted
step's proposals equal unroll's along the decoded sequence); it learns every unrolled depth and reloads identically;
it decodes losslessly through the drafters every family uses; calibration ranks it along its own drafts; and the
train stage trains it from conf/heads/eagle3.yaml over a hidden cache of [final | taps] rows (tiny models).

Where the taps must be distinct layers, a 7-layer Llama (hidden 32) is used: eagle3_taps(7) = (2, 3, 4); the usual
2-layer tiny model clamps them to (2, 1, 1)."""
from __future__ import annotations

import json

import pytest
import pytorch_lightning as pl
import torch
from safetensors.torch import load_file

from models.base import build_tiny_model
from models.engine.decoding import SamplingConfig, decode_step, generate, prefill, time_step
from models.engine.drafting import heads_drafter, make_drafter
from models.engine.fast_inference import prepare_heads_for_decoding
from models.engine.path_choice import prepare_for_decoding
from models.engine.taps import LayerTaps, final_and_taps
from models.methods.eagle.eagle3 import eagle3_taps
from models.engine.trees import tree_from_config
from models.shared import HeadsConfig
from models.methods import build_heads, load_heads
from models.shared.draft_vocab import most_frequent
from models.methods.eagle.eagle3 import Eagle3Layer, Eagle3Module
from models.shared.fitting import fit_resumable
from models.shared.head_data import HeadsDataset, conversation_loader
from models.shared.hidden_cache import HiddenCache, cache_key
from models.shared.training import head_positions
from models.measure.calibration import sequence_ranks
from models.methods import method, new_recipe, recipe_kind
from tests.test_decoding import TREES, cyclic_prompt
from tests.lossless_rule import assert_greedy_lossless
from tests.test_eagle_heads import greedy_through, ranks_checked
from tests.test_training import examples, quiet_trainer_kwargs, stage_cfg  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

DEEP_TAPS = (2, 3, 4)              # eagle3_taps(7)


def deep_model(seed=0):
    """A 7-layer Llama as small as the tiny tokenizer allows: hidden 32, 2 heads of 16, one key/value head."""
    return build_tiny_model(num_layers=7, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                            intermediate_size=64, seed=seed)


def eagle3_heads(model, depths=3, vocab=48, seed=0, draft_ids=None, noise=0.0):
    """Eagle-3 heads (own LM head, as conf/heads/eagle3.yaml) over the `vocab` lowest token ids, or `draft_ids`;
    noise: every weight += noise * N(0, 1), so that the norms (all ones when fresh) are no mere rescaling."""
    torch.manual_seed(seed)
    if draft_ids is None:
        draft_ids = most_frequent(torch.arange(model.config.vocab_size, 0, -1), vocab)
    config = HeadsConfig.for_base(model, "eagle3", num_heads=depths, share_lm_head=False,
                                  draft_vocab_size=len(draft_ids))
    heads = build_heads(config, model, torch.as_tensor(draft_ids))
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(noise * torch.randn(p.shape))
    return heads


def hidden_states(model, ids):
    """transformers' own hidden states (output_hidden_states=True) of ids [1, T]: L + 1 tensors [1, T, h]."""
    with torch.no_grad():
        return model.get_decoder()(input_ids=ids, output_hidden_states=True).hidden_states


def draft_logits(heads, features, ids, depths):
    """[depths] x [T-1, Vd]: the heads' logits of unroll over `features` [1, T, w] along ids [1, T]."""
    module = heads.eagle3
    return [heads.lm_head(0, module.readout(p[0])) for p in module.unroll(features, ids, depths)]


# -- 1) the taps ----------------------------------------------------------------------------------------------------


def test_eagle3_taps_are_low_middle_and_high_layers_clamped_on_small_bases():
    assert eagle3_taps(30) == (2, 15, 27) and eagle3_taps(32) == (2, 16, 29) and eagle3_taps(7) == DEEP_TAPS
    assert eagle3_taps(6) == (2, 3, 3) and eagle3_taps(5) == (2, 2, 2)
    assert eagle3_taps(2) == (2, 1, 1) and eagle3_taps(1) == (1, 1, 1)        # clamped to the layer outputs 1..L
    with pytest.raises(ValueError, match="0 decoder layers"):
        eagle3_taps(0)
    model, _ = build_tiny_model()
    deep, _ = deep_model()
    for m in (model, deep):
        L = m.config.num_hidden_layers
        assert method("eagle3").family.taps(m.config) == eagle3_taps(L) == Eagle3Module.from_base(m).taps
        assert all(method(f).family.taps(m.config) == () for f in ("medusa", "hydra", "hydra_pp", "eagle", "draft_model"))
    assert method("eagle3").family.taps(model.config) == (2, 1, 1)


def test_layer_taps_are_transformers_hidden_states_in_the_order_given():
    """Tap i is transformers' hidden_states[i] (the output of layer i-1) for every i < L, recorded during the forward
    the caller runs; tap L is the last layer's output before the final norm (hidden_states[L] is after it)."""
    model, _ = deep_model(seed=1)
    decoder, h, L = model.get_decoder(), model.config.hidden_size, model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    hs = hidden_states(model, ids)
    assert len(hs) == L + 1
    for taps in (DEEP_TAPS, (6, 1, 3), (5, 5)):
        with LayerTaps(decoder, taps) as tapped, torch.no_grad():
            out = decoder(input_ids=ids).last_hidden_state
        assert tapped.features().shape == (2, 11, len(taps) * h)
        torch.testing.assert_close(tapped.features(), torch.cat([hs[i] for i in taps], -1), rtol=0, atol=1e-6)
        torch.testing.assert_close(out, hs[L], rtol=0, atol=1e-6)              # the forward itself is unchanged
    both = final_and_taps(decoder, ids, DEEP_TAPS)
    assert both.shape == (2, 11, 4 * h)
    torch.testing.assert_close(both, torch.cat([hs[L], hs[2], hs[3], hs[4]], -1), rtol=0, atol=1e-6)
    torch.testing.assert_close(final_and_taps(decoder, ids), hs[L], rtol=0, atol=1e-6)
    # the taps of a prefix forward with a position offset: the same rows as the whole sequence's (causal)
    torch.testing.assert_close(final_and_taps(decoder, ids[:, :7], DEEP_TAPS, position_ids=torch.arange(7)[None]),
                               both[:, :7], rtol=1e-5, atol=1e-5)
    with LayerTaps(decoder, (L,)) as tapped, torch.no_grad():
        decoder(input_ids=ids)
    last = tapped.features()
    torch.testing.assert_close(decoder.norm(last), hs[L], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(last, hs[L], atol=1e-2)
    # its hooks live inside the context only (transformers keeps hooks of its own there); no taps: no hooks
    hooks = lambda: [len(layer._forward_hooks) for layer in decoder.layers]  # noqa: E731
    before = hooks()
    inside = list(before)
    inside[0], inside[5] = inside[0] + 1, inside[5] + 2                     # taps 1 and 6 (twice): layers 0 and 5
    with LayerTaps(decoder, (6, 1, 6)):
        assert hooks() == inside
    assert hooks() == before
    with LayerTaps(decoder, ()) as none:
        assert hooks() == before
    assert none.features() is None
    for bad in ((0,), (L + 1,), (2, -1)):
        with pytest.raises(ValueError, match=f"not layer outputs of a {L}-layer decoder"):
            LayerTaps(decoder, bad)
    with pytest.raises(RuntimeError, match=r"no forward ran through the layers of taps \[3\]"):
        with LayerTaps(decoder, (3,)) as idle:
            pass
        idle.features()


# -- 2) the module --------------------------------------------------------------------------------------------------


def authors_init(module) -> None:
    """Asserts the authors' initialisation: every RMSNorm weight one, every Linear nn.Linear's own (uniform within
    1/sqrt(fan_in), so std bound/sqrt(3)), none the base's initializer_range normal (0.2 on the tiny models)."""
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.Linear):
            bound = m.in_features ** -0.5
            w = m.weight.detach()
            assert float(w.abs().max()) <= bound and float(w.std()) > 0.9 * bound / 3 ** 0.5, name
        elif hasattr(m, "variance_epsilon"):                                    # an RMSNorm
            assert torch.equal(m.weight, torch.ones_like(m.weight)), name


def test_the_module_fuses_taps_with_fc_runs_its_layer_as_documented_and_reads_out_through_its_norm():
    model, _ = deep_model(seed=2)
    h, V = model.config.hidden_size, model.config.vocab_size
    base_layer, base_norm = model.get_decoder().layers[-1], model.get_decoder().norm
    with torch.no_grad():                      # base norms unlike one, so that a copy of them would show
        for p in model.get_decoder().parameters():
            if p.ndim == 1:
                p.fill_(2.0)
    module = Eagle3Module.from_base(model, seed=1)
    layer = module.layers[0]
    assert isinstance(layer, Eagle3Layer) and len(module.layers) == 1 and module.dtype == torch.float32
    assert (module.fc.in_features, module.fc.out_features, module.fc.bias) == (3 * h, h, None)
    assert all(getattr(layer.self_attn, n).in_features == 2 * h for n in ("q_proj", "k_proj", "v_proj"))
    assert layer.self_attn.o_proj.in_features == base_layer.self_attn.o_proj.in_features
    # the authors' init (norms at one, not the base's; nn.Linear's own init), reproducibly
    authors_init(module)
    assert module.out_norm is not base_norm and float(base_norm.weight[0]) == 2.0
    again = Eagle3Module.from_base(model, seed=1)
    assert all(torch.equal(a, b)
               for a, b in zip(module.state_dict().values(), again.state_dict().values(), strict=True))
    assert not torch.equal(Eagle3Module.from_base(model, seed=2).fc.weight, module.fc.weight)
    assert module.lm_head is model.get_output_embeddings()
    assert all(k.startswith(("fc.", "layers.0.", "out_norm.")) for k in module.state_dict())   # no base parts

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():                      # distinct norms, so that a swapped or skipped norm shows
        for norm in (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm, module.out_norm):
            norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=g))
    taps, tokens = torch.randn(2, 5, 3 * h, generator=g), torch.randint(0, V, (2, 5), generator=g)
    own = torch.randn(2, 5, h, generator=g)
    with torch.no_grad():
        emb = model.get_input_embeddings()(tokens)
        # fc applies to 3h-wide inputs (the base's taps) only; h-wide ones (its own predictions) go in as they are
        torch.testing.assert_close(module.inputs(taps, tokens), torch.cat([emb, module.fc(taps)], -1))
        assert torch.equal(module.inputs(own, tokens), torch.cat([emb, own], -1))
        # the layer at one position (attention over one key: o_proj of its values), as the module docstring writes
        f = module.fc(taps[:, :1])
        a = torch.cat([layer.input_layernorm(emb[:, :1]), layer.hidden_norm(f)], -1)
        attn = layer.self_attn
        v = attn.v_proj(a).unflatten(-1, (-1, attn.head_dim))                       # [2, 1, H_kv, d]
        v = v.repeat_interleave(attn.num_key_value_groups, dim=2).flatten(-2)        # [2, 1, H * d]
        f2 = f + attn.o_proj(v)
        want = f2 + layer.mlp(layer.post_attention_layernorm(f2))
        pos = torch.arange(5).expand(2, 5)
        pred = module(taps, tokens, pos)
        torch.testing.assert_close(pred[:, :1], want, rtol=1e-4, atol=1e-5)
        # causal, and the token's embedding matters; the prediction is read out through the module's own norm
        torch.testing.assert_close(module(taps[:, :3], tokens[:, :3], pos[:, :3]), pred[:, :3], rtol=1e-4, atol=1e-5)
        assert not torch.allclose(module(taps, (tokens + 1) % V, pos), pred, atol=1e-3)
        torch.testing.assert_close(module.readout(pred), module.out_norm(pred))
        assert not torch.allclose(module.readout(pred), base_norm(pred), atol=1e-3)
        torch.testing.assert_close(module.logits(pred), model.get_output_embeddings()(module.out_norm(pred)))


def test_eagle3_heads_save_their_module_and_one_lm_head_without_bias():
    model, _ = deep_model()
    heads = eagle3_heads(model, depths=4, vocab=40)
    attn = ("q_proj", "k_proj", "v_proj", "o_proj")
    want = ({"eagle3.fc.weight", "eagle3.out_norm.weight", "lm_heads.0.weight", "draft_ids"}
            | {f"eagle3.layers.0.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
            | {f"eagle3.layers.0.self_attn.{n}.weight" for n in attn}
            | {f"eagle3.layers.0.mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")})
    assert set(heads.state_dict()) == want                       # no base parts, no blocks, no bias, one LM head
    assert len(heads.lm_heads) == 1 and heads.lm_heads[0].bias is None
    assert all(heads.output_layer(k) is heads.lm_heads[0] for k in range(4))
    # a fresh LM head (the authors'), not the base's draft-vocabulary rows
    lm = heads.lm_heads[0].weight
    assert not torch.allclose(lm, model.get_output_embeddings().weight[heads.draft_ids], atol=1e-2)
    assert float(lm.abs().max()) <= model.config.hidden_size ** -0.5
    assert heads.family.autoregressive and heads.draft_module is heads.eagle3
    assert heads.eagle3.taps == DEEP_TAPS


# -- 3) the drafter reads what training reads -----------------------------------------------------------------------


def one_token_per_draft_vocabulary_tree(vd: int):
    """Every draft-vocabulary token at depth 1 and one child below each: whatever the base's next token is (inside
    the draft vocabulary), it is a depth-1 node, accepted, and its child is drafted along the true path."""
    return tree_from_config({"kind": "paths", "top_k": vd,
                             "paths": [[r] for r in range(vd)] + [[r, 0] for r in range(vd)]})


@pytest.mark.parametrize("kind", ["heads", "heads_lookup"])
def test_every_decode_step_drafts_what_unroll_computes_over_the_same_taps(kind):
    """At each step of greedy decoding (past P, root x_P) the drafter's depth-1 logits (root pair (f_{P-1}, x_P))
    equal the heads' LM head over unroll's depth 0 at row P-1, and its depth-2 logits below the node x_{P+1} equal
    unroll's depth 1 at row P-1, unroll reading final_and_taps' taps of the decoded sequence: the features the
    drafter got from the prefill, from the tree verify forwards and from plain 1-token steps are the taps that
    training and calibration read; with prompt lookup merged in too. Features of the wrong layers or the final
    states must not pass."""
    model, tok = deep_model(seed=3)
    prompt = cyclic_prompt(model, tok, known=6)
    base = generate(model, tok, prompt, max_new_tokens=40, stop_token_ids=[]).new_tokens   # the last step overshoots 32
    seen = sorted(set(prompt + base))
    draft_ids = seen + [i for i in range(model.config.vocab_size) if i not in seen][:56 - len(seen)]
    heads = eagle3_heads(model, depths=2, draft_ids=draft_ids, noise=0.2).eval()
    drafter = make_drafter({"kind": kind, "tree": one_token_per_draft_vocabulary_tree(len(draft_ids)),
                            "lookup": {"num_tokens": 4}}, heads=heads)
    assert drafter.taps == DEEP_TAPS
    tree = drafter if kind == "heads" else drafter.tree                 # the tree drafter (uncut, before lookup)
    proposer, calls, drafts = tree.proposer, [], []
    scores, draft = proposer.scores, tree.draft

    def recording(frontier):                                           # each depth's parents and their logits
        logits = scores(frontier)
        calls.append((frontier.tokens[frontier.nodes].tolist(), logits.clone()))
        return logits

    def kept(root, max_depth):                                         # the drafted tree: which child is which
        d = draft(root, max_depth)
        drafts.append(d)
        return d

    proposer.scores, tree.draft = recording, kept
    steps, out = [], []
    with torch.inference_mode():
        state = prefill(model, torch.tensor([prompt]), SamplingConfig(), drafter=drafter)
        out.append(state.root)
        while len(out) < 32:
            past, root = state.past, state.root
            calls.clear()
            drafts.clear()
            tokens, drafted = decode_step(state, drafter, 0 if len(steps) % 3 == 2 else 2)   # every third: plain
            steps.append((past, root, list(calls), drafted, drafts[-1] if drafts else None))
            out += tokens
    assert out == base[:len(out)]
    assert sum(1 for s in steps if not s[2]) >= 3                      # plain steps, each followed by a drafted one
    assert all(s[3] >= 1 for s in steps if s[2])                       # the true token is always drafted: accepted
    full = torch.tensor([prompt + out])
    T = full.shape[1]
    with torch.inference_mode():
        taps = final_and_taps(model.get_decoder(), full, DEEP_TAPS)[..., model.config.hidden_size:]
        ref = draft_logits(heads, taps, full, 2)                                          # [T-1, Vd] per depth
    checked = 0
    for past, root, calls_, _, d in steps:
        if not calls_:
            continue
        assert full[0, past] == root
        (parents0, logits0), (parents1, logits1) = calls_
        children = lambda node: d.tokens[d.buf.children[node]].tolist()         # noqa: E731  (rank order)
        tokens0 = children(0)
        assert parents0 == [root] and len(logits0) == 1
        torch.testing.assert_close(logits0[0], ref[0][past - 1], rtol=1e-4, atol=1e-4)
        assert sorted(tokens0) == sorted(draft_ids)                               # every rank, mapped to token ids
        assert tokens0[0] == int(heads.to_token_ids(ref[0][past - 1].argmax()))
        if past + 1 < T:
            row = parents1.index(int(full[0, past + 1]))                          # the node on the true path
            torch.testing.assert_close(logits1[row], ref[1][past - 1], rtol=1e-4, atol=1e-4)
            node = d.buf.children[0][tokens0.index(int(full[0, past + 1]))]
            child = children(node)[0]
            assert child == int(heads.to_token_ids(ref[1][past - 1].argmax()))
            checked += 1
    assert checked >= 8
    # the same check fails on features that are not the module's taps
    first_past, first_calls = next((p, c) for p, _, c, _, _ in steps if c)
    with torch.inference_mode():
        for wrong in (final_and_taps(model.get_decoder(), full, (1, 2, 3))[..., model.config.hidden_size:],
                      final_and_taps(model.get_decoder(), full, (3, 4, 5))[..., model.config.hidden_size:],
                      final_and_taps(model.get_decoder(), full)):
            other = draft_logits(heads, wrong, full, 1)[0][first_past - 1]
            assert not torch.allclose(first_calls[0][1][0], other, rtol=1e-2, atol=1e-2)


# -- 4) learning and reloading --------------------------------------------------------------------------------------


def taps_loaders(tok, model, cache_dir, n_train=8, n_val=4):
    """test_training's pattern conversations with a hidden cache of [final | taps] rows, as the train stage builds."""
    taps = method("eagle3").family.taps(model.config)
    out = []
    for name, n, seed, shuffle in (("train", n_train, 0, True), ("val", n_val, 1, False)):
        ids, labels = examples(tok, n, seed)
        cache = HiddenCache.build(model, ids, cache_dir / name, batch_tokens=200, shard_size=5, taps=taps)
        data = HeadsDataset(ids, labels, cache)
        out.append(conversation_loader(data, 100, tok.pad_token_id, shuffle=shuffle, seed=0))
    return out


def per_depth(heads, batch, depths):
    """Per depth k, at every assistant target t+k+2 of the batch: (the heads' logits [N, Vd] over the readout of
    unroll's depth k at t, the base's logits over the draft vocabulary at t+k+1, which predict the same token)."""
    h = heads.config.hidden_size
    final, features = batch["hidden"][..., :h], batch["hidden"][..., h:]
    out = []
    for k, pred in enumerate(heads.eagle3.unroll(features, batch["input_ids"], depths)):
        b, t = (batch["labels"][:, k + 2:] != -100).nonzero(as_tuple=True)
        out.append((heads.lm_head(0, heads.eagle3.readout(pred[b, t])), heads.base_draft_logits(final[b, t + k + 1])))
    return out


def depth_kl(heads, batch, depths):
    """Per depth: the mean KL(base || draft) (the recipe's soft cross-entropy less the teacher's entropy)."""
    with torch.no_grad():
        return [float(torch.nn.functional.kl_div(draft.log_softmax(-1), base.log_softmax(-1), log_target=True,
                                                 reduction="batchmean"))
                for draft, base in per_depth(heads, batch, depths)]


def test_the_eagle3_recipe_is_a_decayed_soft_cross_entropy_per_unrolled_depth(tmp_path):
    """The training-time test: depth k (k < unroll) is the heads' LM head over the readout of the module's k-th
    prediction along the true tokens, trained by soft cross-entropy to the base's distribution over the draft
    vocabulary, weighted 0.8^k, no feature loss; training runs `unroll` depths, validation measures all of them.
    The cached [final | taps] rows give the loss the module computes from the base itself (final_and_taps)."""
    model, tok = build_tiny_model(seed=0)
    _, val = taps_loaders(tok, model, tmp_path / "cache", n_train=1)
    batch = next(iter(val))
    assert batch["hidden"].shape[-1] == 4 * model.config.hidden_size           # [final | 3 taps]
    heads = eagle3_heads(model, depths=4, vocab=model.config.vocab_size // 2, noise=0.05)
    with torch.no_grad():
        ref = per_depth(heads, batch, 4)
        soft_ce = [float(-(base.softmax(-1) * draft.log_softmax(-1)).sum(-1).mean()) for draft, base in ref]
    for unroll in (1, 3):
        recipe = new_recipe(kind="eagle3", feature_loss_weight=0.0, teacher_loss_weight=1.0, lm_loss_weight=0.0,
                        feature_noise=0.0, unroll=unroll)
        module = recipe_kind("eagle3").module(heads, model, recipe)
        want = sum(0.8 ** k * soft_ce[k] for k in range(unroll))
        for training in (True, False):
            module.train(training)
            with torch.no_grad():
                loss, per_head, extra = module.compute(batch)
                direct, _, _ = module.compute({k: v for k, v in batch.items() if k != "hidden"})
            assert extra == {}                                                  # no feature loss
            torch.testing.assert_close(float(loss), want, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(direct, loss, rtol=1e-5, atol=1e-6)
            for k, item in enumerate(per_head):
                if training and k >= unroll:
                    assert item is None, (unroll, k)                            # training runs `unroll` depths
                    continue
                torch.testing.assert_close(item[1], ref[k][0], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(float(item[0]), soft_ce[k] if k < unroll else 0.0, rtol=1e-5, atol=1e-6)


def test_the_draft_vocab_mask_drops_labels_outside_the_draft_vocabulary_from_the_loss_only(tmp_path):
    """recipe.draft_vocab_mask (the authors' EAGLE-3): in training, depth k's soft cross-entropy averages only the
    positions whose label the draft vocabulary holds; validation and the per-depth logits count every position."""
    model, tok = build_tiny_model(seed=0)
    _, val = taps_loaders(tok, model, tmp_path / "cache", n_train=1)
    batch = next(iter(val))
    heads = eagle3_heads(model, depths=3, vocab=model.config.vocab_size // 4, noise=0.05)
    with torch.no_grad():
        ref = per_depth(heads, batch, 3)
    ce = [-(base.softmax(-1) * draft.log_softmax(-1)).sum(-1) for draft, base in ref]           # per row
    inside = [heads.to_draft_index(head_positions(batch["labels"], k)[2]) >= 0 for k in range(3)]
    assert all(0 < int(m.sum()) < len(m) for m in inside)                       # both kinds of rows in every depth
    recipe = new_recipe(kind="eagle3", feature_loss_weight=0.0, teacher_loss_weight=1.0, lm_loss_weight=0.0,
                    feature_noise=0.0, unroll=3, draft_vocab_mask=True)
    module = recipe_kind("eagle3").module(heads, model, recipe)
    for training, keep in ((True, inside), (False, [torch.ones_like(m) for m in inside])):
        module.train(training)
        with torch.no_grad():
            loss, per_head, _ = module.compute(batch)
        want = sum(0.8 ** k * float(ce[k][keep[k]].mean()) for k in range(3))
        torch.testing.assert_close(float(loss), want, rtol=1e-5, atol=1e-6)
        assert all(item[1].shape[0] == len(inside[k]) for k, item in enumerate(per_head))   # metrics: every row


def test_eagle3_heads_learn_every_unrolled_depth_and_reload_identically(tmp_path):
    model, tok = build_tiny_model(seed=0)
    model.requires_grad_(False)
    train, val = taps_loaders(tok, model, tmp_path / "cache")
    batch = next(iter(val))
    h = model.config.hidden_size
    heads = eagle3_heads(model, depths=3, vocab=model.config.vocab_size // 2).requires_grad_(True)
    recipe = new_recipe(kind="eagle3", lr=1e-2, warmup_ratio=0.0, feature_loss_weight=0.0, teacher_loss_weight=1.0,
                    lm_loss_weight=0.0, feature_noise=0.0, unroll=3)
    module = recipe_kind("eagle3").module(heads, model, recipe)
    before_kl = depth_kl(heads.eval(), batch, 3)
    before = pl.Trainer(logger=False, **quiet_trainer_kwargs()).validate(module, val, verbose=False)[0]
    trainer, _ = fit_resumable(module, train, val, tmp_path / "ckpt", "fp", max_epochs=4,
                               trainer_kwargs=quiet_trainer_kwargs())
    after = trainer.validate(module, val, verbose=False)[0]
    after_kl = depth_kl(heads.eval(), batch, 3)
    assert after["val/loss"] < before["val/loss"]
    # every depth, the deeper ones read the module's own predictions (best epoch's weights: about 0.6x here)
    assert all(a < 0.75 * b for a, b in zip(after_kl, before_kl, strict=True)), (before_kl, after_kl)
    for k in range(3):
        assert 0.0 <= after[f"val/top1_head{k}"] <= after[f"val/top5_head{k}"] <= 1.0
    heads.save(tmp_path / "heads")
    _, loaded = load_heads(tmp_path / "heads", model)
    assert isinstance(loaded.eagle3, Eagle3Module) and loaded.eagle3.taps == heads.eagle3.taps
    assert set(loaded.state_dict()) == set(heads.state_dict())
    assert all(torch.equal(a, loaded.state_dict()[k]) for k, a in heads.state_dict().items())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=g)
    feats = torch.randn(2, 9, 3 * h, generator=g)
    with torch.no_grad():
        for a, b in zip(heads.eagle3.unroll(feats, ids, 3), loaded.eagle3.unroll(feats, ids, 3), strict=True):
            assert torch.equal(heads.lm_head(0, heads.eagle3.readout(a)), loaded.lm_head(0, loaded.eagle3.readout(b)))


# -- 5) lossless decoding -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["tree", "cut", "lookup", "packed"])
def test_greedy_eagle3_heads_equal_the_baseline(how):
    """A fixed tree, the tree cut per step by cost, prompt lookup's chain merged in (a repetitive prompt, so that
    lookups get accepted and several taps rows advance at once), and the base's and the module's linears packed for
    decoding (the base's attention folded), the taps still hooked on its layers."""
    model, tok = build_tiny_model(seed=3)
    heads = eagle3_heads(model, depths=4, noise=0.2).eval()
    if how == "packed":                                        # as the evaluation runs: the base prepared too
        assert prepare_for_decoding(model)["packed_linears"] > 0
        assert prepare_heads_for_decoding(heads) == 9          # fc, q, k, v, o, gate, up, down and the LM head
    res, base, drafter = greedy_through(how, model, tok, heads)
    assert drafter.taps == (2, 1, 1)
    assert res.new_tokens == base.new_tokens
    assert len(res.new_tokens) == 1 + sum(res.accept_lengths)
    if how == "lookup":
        assert max(res.accept_lengths) > 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_eagle3_heads_equal_the_baseline_on_a_deep_base_with_a_short_prompt(dtype):
    """Distinct taps, a 1-token prompt (no accepted pair at the start: an empty draft cache), and a bf16 base (taps
    in bf16, the module in float32). In bf16 the baseline's 1-token steps and the tree's verify forward round
    apart, and this base meets exact ties of two logits (on the 1-token prompt everywhere, on the cyclic one on
    some CPUs' kernels): compared under the evaluation's tie rule (tests/lossless_rule.py), exact in float32."""
    model, tok = deep_model(seed=4)
    model = model.to(dtype)
    heads = eagle3_heads(model, depths=4, noise=0.2).eval()
    assert heads.eagle3.dtype == torch.float32
    for ids in [cyclic_prompt(model, tok, known=8), [5]]:
        base = generate(model, tok, ids, max_new_tokens=16, stop_token_ids=[])
        res = generate(model, tok, ids, heads_drafter(heads, TREES["sparse64"]), max_new_tokens=16, stop_token_ids=[])
        if dtype == torch.float32:
            assert res.new_tokens == base.new_tokens
        else:
            assert_greedy_lossless(model, ids, base, res)


def test_time_step_rewinds_the_eagle3_drafter_to_the_same_taps_state():
    """time_step (calibration's step timings) takes real steps and rewinds base and drafter: the draft cache and the
    kept taps row come back, and decoding after it emits what decoding without it emits."""
    model, tok = deep_model(seed=3)
    heads = eagle3_heads(model, depths=4, noise=0.2).eval()
    ids = cyclic_prompt(model, tok, known=8)
    want = generate(model, tok, ids, heads_drafter(heads, TREES["sparse64"]), max_new_tokens=12, stop_token_ids=[])
    with torch.inference_mode():
        drafter = heads_drafter(heads, TREES["sparse64"])
        state = prefill(model, torch.tensor([ids]), SamplingConfig(), drafter=drafter)
        got, lengths = [state.root], []
        tokens, _ = decode_step(state, drafter, max_depth=4)
        got, lengths = got + tokens, lengths + [len(tokens)]
        proposer = drafter.proposer
        past, root, rows, feature = state.past, state.root, proposer.cache.get_seq_length(), proposer.feature.clone()
        assert feature.shape == (3 * model.config.hidden_size,) and rows == past - 1
        parts = time_step(state, drafter, max_depth=4, repeats=2)
        assert len(parts) == 2 and all(p["step"] > 0 for p in parts)
        assert (state.past, state.root, proposer.cache.get_seq_length()) == (past, root, rows)
        assert torch.equal(proposer.feature, feature)
        while len(got) < 12:
            tokens, _ = decode_step(state, drafter, max_depth=min(4, 12 - len(got) - 1))
            got, lengths = got + tokens, lengths + [len(tokens)]
    assert got[:12] == want.new_tokens and lengths == want.accept_lengths


# -- 6) calibration -------------------------------------------------------------------------------------------------


def test_calibration_ranks_eagle3_along_its_own_drafts_over_the_taps():
    """sequence_ranks for eagle3 heads: depth d at position t is the rank of the base's greedy token after t+d in the
    heads' LM head over the readout of the draft d steps along the true path, the drafts read from the taps
    (here taken from transformers' hidden_states, independently of models/engine/taps.py)."""
    model, tok = deep_model(seed=1)
    prompt = cyclic_prompt(model, tok, known=6)
    ids = prompt + generate(model, tok, prompt, max_new_tokens=16, stop_token_ids=[]).new_tokens   # greedy throughout
    start = len(prompt) - 1
    answer = sorted(set(ids[start:]))              # a small draft vocabulary holding every answer token: ranks vary
    draft_ids = answer + [i for i in range(model.config.vocab_size) if i not in answer][:16 - len(answer)]
    heads = eagle3_heads(model, depths=3, draft_ids=draft_ids, noise=0.2).eval()
    ranks = sequence_ranks(model, heads, ids, start, top_k=10)
    hs = hidden_states(model, torch.tensor([ids]))
    with torch.no_grad():
        logits = draft_logits(heads, torch.cat([hs[i] for i in DEEP_TAPS], -1), torch.tensor([ids]), 3)
        greedy = model.get_output_embeddings()(hs[-1][0]).argmax(-1).tolist()           # [T]: g_{s+1} at s
    assert greedy[start:-1] == ids[start + 1:]
    top10 = lambda d, t: heads.to_token_ids(logits[d - 1][t].topk(10).indices).tolist()  # noqa: E731
    checked = ranks_checked(ranks, ids, start, greedy, top10, depths=3)
    assert checked > 30 and len(set(ranks[ranks >= 0].tolist())) >= 5      # many ranks, not all K: a real check


# -- 7) the train stage ---------------------------------------------------------------------------------------------


def test_the_train_stage_trains_eagle3_from_its_config_over_final_and_taps(stage_cfg, tmp_path):  # noqa: F811
    from pipelines.common import load_model
    from pipelines.train import run_train
    from pipelines.train_inputs import load_examples, pipeline_taps

    cfg = stage_cfg("eagle3")
    assert cfg.heads.family == "eagle3" and cfg.heads.recipe.kind == "eagle3" and cfg.heads.share_lm_head is False
    metrics = run_train(cfg)
    assert set(metrics["val_top1"]) == {f"head{k}" for k in range(cfg.heads.num_heads)}
    saved = json.loads((tmp_path / "reports" / "metrics" / "train_eagle3.json").read_text())
    assert saved["family"] == "eagle3" and saved["kind"] == "eagle3"
    assert saved["recipe"]["feature_loss_weight"] == 0.0 and saved["recipe"]["unroll"] == cfg.heads.recipe.unroll > 1
    model, _ = load_model(cfg)                          # the stage's own model (its fingerprint is in the cache key)
    _, heads = load_heads(tmp_path / "results" / "heads" / "eagle3", model)
    assert heads.family.name == "eagle3" and heads.draft_ids.numel() == 64
    assert isinstance(heads.eagle3, Eagle3Module) and len(heads.lm_heads) == 1 and heads.lm_heads[0].bias is None
    # the hidden cache: [final | taps] rows for the union of every pipeline family's taps (EAGLE-3's 2, 1, 1 and
    # DFlash's 2, 1 on this 2-layer base: 1, 2; 3h wide) under a key of their own, no final-only cache beside it
    h, taps = model.config.hidden_size, pipeline_taps(cfg, model.config)
    assert taps == (1, 2) and set(eagle3_taps(model.config.num_hidden_layers)) <= set(taps)
    root = tmp_path / "results" / "cache" / "hidden" / cfg.model.name
    data = load_examples(cfg)
    for split, (ids, _) in data.items():
        key = cache_key(model, ids, taps=taps)
        assert key != cache_key(model, ids)
        shards = sorted((root / key).glob("shard-*.safetensors"))
        assert shards, split
        shard = load_file(str(shards[0]))
        assert shard["hidden"].shape[-1] == 3 * h
        first = int(shard["index"][0])                  # the shard's first sequence: its rows come first
        want = final_and_taps(model.get_decoder(), torch.tensor([ids[first]]), taps)[0]
        torch.testing.assert_close(shard["hidden"][:len(ids[first])], want, rtol=1e-5, atol=1e-5)
    keys = sorted(cache_key(model, ids, taps=taps) for ids, _ in data.values())
    assert sorted(p.name for p in root.iterdir()) == keys
