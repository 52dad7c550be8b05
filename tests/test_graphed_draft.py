"""Drafts replayed as CUDA graphs (models/engine/drafters/graphed.py): which drafters may, what they rely on (the
proposer's state overwritten in place), that the host settings ask for them, and on a GPU that the replayed draft
is the eager walk's and a decode with it the autoregressive one, token for token in float32."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from models.engine import decoding
from models.engine.acceptance import SamplingConfig
from models.engine.decoding import generate, prefill
from models.engine.drafting import make_drafter
from models.engine.drafters.graphed import GraphedDraft, why_not_capturable
from models.engine.drafters.proposer import draft_tree
from models.engine.trees import TreeBuffers, tree_from_config
from models.shared import HeadsConfig
from models.methods import build_heads
from pipelines.common import CONF_DIR

PROMPT = torch.randint(200, (40,), generator=torch.Generator().manual_seed(1)).tolist()
SPARSE64 = tree_from_config(OmegaConf.load(f"{CONF_DIR}/tree/sparse64.yaml"))


def drafter_of(model, family: str, tree=SPARSE64, **spec):
    torch.manual_seed(0)
    heads = build_heads(HeadsConfig.for_base(model, family, 4, 1), model).to(next(model.parameters()).device).eval()
    return make_drafter({"kind": "heads", "tree": tree, **spec}, heads=heads)


@pytest.mark.parametrize("family", ["medusa", "hydra", "hydra_pp"])
def test_the_heads_keep_h_t_in_one_storage_through_advance_and_rewind(tiny_model, family):
    """What a replayed graph reads must not move: h_t is overwritten in place, and rewinding restores its value."""
    model, _ = tiny_model
    drafter = drafter_of(model, family)
    with torch.inference_mode():
        state = prefill(model, torch.tensor([PROMPT]), SamplingConfig(), drafter=drafter, static_drafts=True)
        (h,) = drafter.proposer.static_inputs()
        address, before = h.data_ptr(), h.clone()
        past, root = state.past, state.root
        decoding.decode_step(state, drafter, 8)
        assert drafter.proposer.static_inputs()[0].data_ptr() == address and not torch.equal(h, before)
        drafter.rewind(past)
        state.rewind(past, root)
        assert drafter.proposer.static_inputs()[0].data_ptr() == address and torch.equal(h, before)


def test_which_drafts_may_be_replayed(tiny_model):
    model, _ = tiny_model
    heads = drafter_of(model, "medusa").proposer
    eagle = drafter_of(model, "eagle").proposer
    assert why_not_capturable(heads, SamplingConfig(), cutting=False, want_probs=False) is None
    assert why_not_capturable(eagle, SamplingConfig(), cutting=False, want_probs=False) is None
    assert "not capturable" in why_not_capturable(object(), SamplingConfig(), False, False)
    assert "sampled" in why_not_capturable(heads, SamplingConfig(temperature=0.7, acceptance="sampling", draft="sample"), False, False)
    assert "host" in why_not_capturable(heads, SamplingConfig(), cutting=True, want_probs=True)


def test_the_drafter_says_why_its_drafts_stay_eager(tiny_model):
    """Not asked for (no static drafts), cut by cost (the probabilities are read on the host), and on a CPU the
    capture itself fails over to the eager walk, which drafts what draft_tree drafts."""
    model, _ = tiny_model
    plain, asked = drafter_of(model, "hydra"), drafter_of(model, "hydra")
    cut = drafter_of(model, "hydra", step_cost=[1.0] * 64)
    with torch.inference_mode():
        prefill(model, torch.tensor([PROMPT]), SamplingConfig(), drafter=plain)
        assert plain.graph_summary()["fallback"].startswith("fixed-shape drafts not asked for")
        prefill(model, torch.tensor([PROMPT]), SamplingConfig(), drafter=cut, static_drafts=True)
        assert "read on the host" in cut.graph_summary()["fallback"]
        state = prefill(model, torch.tensor([PROMPT]), SamplingConfig(), drafter=asked, static_drafts=True)
        draft = asked.draft(state.root, 64)
        summary = asked.graph_summary()
        assert summary["mode"] == "eager" and "CUDA graphs capture CUDA work" in summary["fallback"]
        reference = draft_tree(asked.proposer, state.root, TreeBuffers.build(SPARSE64), SamplingConfig())[0]
        assert torch.equal(draft.tokens, reference) and summary["nodes"] == 63


def test_static_drafts_follow_the_static_step_the_caller_asks_for(tiny_model, monkeypatch):
    """generate(static=..., static_drafts=None): drafts are asked to be static with the static step, and not when the
    caller keeps them eager (static_drafts=False); the host settings' record is not read (set to the opposite, the
    CUDA check stubbed, the static step itself left out)."""
    from models import hardware

    model, _ = tiny_model
    asked = []
    real = decoding.prefill_rows
    monkeypatch.setattr(decoding, "prefill_rows", lambda *a, **k: asked.append(a[-1]) or real(*a, **k))
    monkeypatch.setattr(decoding, "attach_static", lambda state, drafter, n: None)
    monkeypatch.setattr(hardware, "is_cuda", lambda device: True)
    drafter = drafter_of(model, "medusa")
    for static, static_drafts in ((False, None), (True, None), (True, False)):
        monkeypatch.setattr(hardware, "HOST_SETTINGS", {"static_step": not static})
        generate(model, None, PROMPT, drafter, max_new_tokens=3, stop_token_ids=[], static=static,
                 static_drafts=static_drafts)
    assert asked == [False, True, False]


@pytest.mark.parametrize("family", ["eagle", "eagle3", "draft_model"])
def test_a_static_draft_cache_drafts_and_decodes_what_the_growing_one_does(tiny_model, family, monkeypatch):
    """The autoregressive drafters with their draft cache at fixed shapes (run eagerly on a CPU, the walk a graph
    would replay): every draft equals the growing cache's, through accepted paths, rewinds and the cache growing
    to a new capacity (made small here so that it grows), and the decode equals the autoregressive one."""
    from models.shared.autoregressive import static_cache as static_draft_cache

    monkeypatch.setattr(static_draft_cache, "ROOM", 16)
    monkeypatch.setattr(static_draft_cache, "CAPACITY_STEP", 8)
    model, _ = tiny_model
    static, growing = drafter_of(model, family), drafter_of(model, family)
    with torch.inference_mode():
        a = prefill(model, torch.tensor([PROMPT]), SamplingConfig(), drafter=static, static_drafts=True)
        b = prefill(model, torch.tensor([PROMPT]), SamplingConfig(), drafter=growing)
        assert static.proposer.static is not None and growing.proposer.static is None
        capacities = {static.proposer.static.capacity}
        for step in range(12):
            assert torch.equal(static.draft(a.root, 64).tokens, growing.draft(b.root, 64).tokens), step
            if step % 4 == 3:                                   # a step taken and undone, as time_step does
                past, root = a.past, a.root
                decoding.decode_step(a, static, 64)
                a.rewind(past, root)
                static.rewind(past)
            decoding.decode_step(a, static, 64)
            decoding.decode_step(b, growing, 64)
            assert a.root == b.root and a.past == b.past
            capacities.add(static.proposer.static.capacity)
        assert len(capacities) > 1                              # it grew, and drafted the same after
    reference = generate(model, None, PROMPT, max_new_tokens=40, stop_token_ids=[])
    decoded = generate(model, None, PROMPT, static, max_new_tokens=40, stop_token_ids=[], static=True)
    assert decoded.new_tokens == reference.new_tokens


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["medusa", "hydra", "hydra_pp", "eagle", "eagle3", "draft_model"])
def test_on_cuda_a_replayed_draft_is_the_eager_walk_and_decodes_losslessly(tiny_model, family):
    model, _ = tiny_model
    model = model.to("cuda")
    reference = generate(model, None, PROMPT, max_new_tokens=40, stop_token_ids=[], static=False)
    drafter = drafter_of(model, family)
    graphed = generate(model, None, PROMPT, drafter, max_new_tokens=40, stop_token_ids=[], static=True)
    assert drafter.graph_summary() == {"mode": "cuda_graph", "tree": SPARSE64.name, "nodes": 63, "fallback": None}
    assert graphed.new_tokens == reference.new_tokens
    with torch.inference_mode():                           # the replay against the eager walk, state by state
        state = prefill(model, torch.tensor([PROMPT], device="cuda"), SamplingConfig(), drafter=drafter,
                        static_drafts=True)
        for _ in range(6):
            replayed = drafter.draft(state.root, 64).tokens
            walked = draft_tree(drafter.proposer, state.root, drafter.buf, SamplingConfig())[0]
            assert torch.equal(replayed, walked)
            decoding.decode_step(state, drafter, 64)
    assert isinstance(drafter.graphed, GraphedDraft) and drafter.graphed.graph is not None
