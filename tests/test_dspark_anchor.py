"""heads.sample_from_anchor, as the speculators library defines it: slot k of a block drafts the token k + 1 after the
anchor (every slot drafts), its Markov input is the token at k, and training weights slot k by exp(-k / gamma) from
slot 0. Decoding stays lossless; the proposer, training's blocks, calibration's unroll and the speculators export
follow it; the authors' DFlash format, which has no such field, refuses it."""
from __future__ import annotations

import json
import math

import pytest
import torch

from models.base import build_tiny_model
from models.engine.decoding import generate
from models.engine.drafting import heads_drafter
from models.engine.drafters.proposer import proposer_for
from models.engine.trees import chain_tree
from models.methods import build_heads, export_heads
from models.methods.dflash.training import draw_blocks
from models.shared import HeadsConfig
from tests.test_decoding import cyclic_prompt
from tests.test_dspark import TREE, assert_ranks_replay_as_decoded

pytestmark = pytest.mark.usefixtures("one_thread")


def anchored(model, family="dspark", depths=6, bias_scale=0.5, seed=0):
    torch.manual_seed(seed)
    config = HeadsConfig.for_base(model, family, num_heads=depths, num_layers=2, share_lm_head=True,
                                  sample_from_anchor=True)
    heads = build_heads(config, model).eval()
    if getattr(heads, "markov", None) is not None:
        with torch.no_grad():
            heads.markov.w2.weight.normal_(0.0, bias_scale)
    return heads


def test_every_slot_drafts_a_block_of_num_heads():
    model, _ = build_tiny_model(seed=0)
    module = anchored(model, depths=7).dflash
    assert (module.block_size, module.first_slot, module.depths) == (7, 0, 7)
    with pytest.raises(ValueError, match="heads.sample_from_anchor='yes' is not accepted; it takes true"):
        HeadsConfig.for_base(model, "dspark", num_heads=7, sample_from_anchor="yes")


@pytest.mark.parametrize("family", ["dflash", "dspark", "dspark_gated", "dspark_rnn"])
@pytest.mark.parametrize("tree", [chain_tree(6), TREE], ids=["chain", "tree"])
def test_greedy_decoding_with_sample_from_anchor_equals_the_baseline(family, tree):
    model, tok = build_tiny_model(seed=0)
    heads = anchored(model, family)
    ids = cyclic_prompt(model, tok, known=12)
    base = generate(model, tok, ids, max_new_tokens=24, stop_token_ids=[])
    assert generate(model, tok, ids, heads_drafter(heads, tree), max_new_tokens=24,
                    stop_token_ids=[]).new_tokens == base.new_tokens


@pytest.mark.parametrize("family", ["dspark", "dspark_rnn"])
def test_depth_one_is_slot_zero_and_a_nodes_children_carry_its_own_tokens_bias(family):
    from models.engine.acceptance import SamplingConfig
    from models.engine.drafters.base import DraftContext
    from models.engine.drafters.proposer import Frontier
    from models.engine.taps import final_and_taps

    model, tok = build_tiny_model(seed=0)
    heads = anchored(model, family)
    module = heads.dflash
    ids = torch.tensor(cyclic_prompt(model, tok, known=12))
    proposer = proposer_for(heads)
    feats = final_and_taps(model.get_decoder(), ids[None], module.taps)[0, :, model.config.hidden_size:]
    proposer.start(DraftContext(ids, feats, SamplingConfig()))
    root = int(ids[-1])
    proposer.begin(root, 3)
    block = torch.tensor([[root] + [module.mask_token_id] * (module.block_size - 1)])
    with torch.no_grad():
        out = module(feats[None], block, torch.arange(len(ids) + module.block_size)[None])[0]
        torch.testing.assert_close(proposer.rows, heads.lm_head(0, out[:3]), rtol=1e-4, atol=1e-5)
        paths = torch.tensor([[root, 7, 9], [root, 8, 11]])                                 # two nodes at depth 2
        frontier = Frontier(2, torch.tensor([3, 4]), torch.tensor([1, 2]), paths,
                            torch.ones(2, 5, dtype=torch.bool), torch.zeros(5, dtype=torch.long))
        got = proposer.scores(frontier)
        want = heads.block_logits(out[:3][None].expand(2, -1, -1), paths)[:, -1]   # slot k's input: the token at k
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got[0], got[1])
    proposer.end()


def test_training_blocks_start_at_slot_zero_one_token_later():
    """draw_blocks with sample_from_anchor: slot k's target is x_{a+k+1}, its Markov input x_{a+k}, its weight
    exp(-k / gamma) where the target is an assistant token; no anchor in the last block_size positions."""
    model, _ = build_tiny_model(seed=0)
    module = anchored(model, depths=4).dflash
    T, bs, gamma = 14, 4, 2.0
    ids = torch.arange(10, 10 + T)[None]
    mask = torch.ones(1, T, dtype=torch.bool)
    mask[0, 6] = False
    blocks = draw_blocks(ids, mask, module, 64, gamma)
    anchors = blocks.anchors[0][blocks.keep[0]].tolist()
    assert anchors == [a for a in range(T - bs) if mask[0, a]]
    for n, a in enumerate(blocks.anchors[0].tolist()):
        assert blocks.ids[0, n].tolist() == [10 + a] + [module.mask_token_id] * (bs - 1)
        assert blocks.target[0, n].tolist() == [10 + a + k + 1 for k in range(bs)]
        assert blocks.prev[0, n].tolist() == [10 + a + k for k in range(bs)]
        want = [math.exp(-k / gamma) * bool(mask[0, a + k + 1]) for k in range(bs)]
        assert blocks.weight[0, n].tolist() == pytest.approx(want)


def test_calibrations_ranks_replay_as_the_decoder_accepts_with_sample_from_anchor():
    model, tok = build_tiny_model(seed=1)
    heads = anchored(model, "dspark_rnn", depths=4, bias_scale=2.0)
    assert_ranks_replay_as_decoded(model, tok, heads, [[0], [1], [0, 0], [0, 0, 0], [0, 0, 0, 0]])


def test_the_speculators_export_writes_it_and_the_authors_format_refuses_it(tmp_path):
    model, _ = build_tiny_model("llama", num_layers=8, seed=0)
    torch.manual_seed(0)
    config = HeadsConfig.for_base(model, "dspark", num_heads=7, num_layers=2, share_lm_head=True,
                                  mask_token_id=model.config.vocab_size - 1, sample_from_anchor=True)
    heads = build_heads(config, model).eval()
    export_heads(heads, model, tmp_path / "spec", "speculators")
    written = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert written["sample_from_anchor"] is True and written["block_size"] == 7
    assert written["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 7
    dflash = build_heads(HeadsConfig.for_base(model, "dflash", num_heads=7, num_layers=2, share_lm_head=True,
                                              mask_token_id=3, sample_from_anchor=True), model)
    with pytest.raises(ValueError, match="authors' DFlash format has no sample_from_anchor"):
        export_heads(dflash, model, tmp_path / "authors", "dflash")
