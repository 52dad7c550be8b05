"""The static decode step (models/engine/static_step.py) on the CPU: the fixed-shape forward it would capture as
CUDA graphs runs eagerly here, so these check its buffers, its cache and that greedy output equals the eager
step's token for token (float32), with the graph capture failing over to the eager forward where it cannot run."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from models.base import build_tiny_model
from models.engine import decoding
from models.engine import static_step
from models.engine.acceptance import SamplingConfig
from models.engine.decoding import generate, prefill, verify_masks
from models.engine.drafting import make_drafter
from models.engine.static_step import StaticDecoder, attach_static
from models.engine.trees import TreeBuffers, tree_from_config
from models.shared import HeadsConfig
from models.methods import build_heads
from pipelines.common import CONF_DIR

PROMPT = torch.randint(200, (40,), generator=torch.Generator().manual_seed(0)).tolist()


def exact_drafter(model, tree_name: str):
    """A draft model that is the tiny base itself (copies of both its layers): its drafts are nearly always
    accepted, so steps accept long and branching paths and the cache is pruned to non-prefix paths."""
    heads = build_heads(HeadsConfig.for_base(model, "draft_model", 4, 2, share_lm_head=True), model).eval()
    return make_drafter({"kind": "heads", "tree": tree_from_config(OmegaConf.load(f"{CONF_DIR}/tree/{tree_name}.yaml"))},
                        heads=heads)


@pytest.mark.parametrize("tree_name", [None, "sparse64", "chain4"])
def test_static_step_decodes_what_the_eager_step_decodes(tiny_model, tree_name):
    model, _ = tiny_model
    eager = generate(model, None, PROMPT, max_new_tokens=30, stop_token_ids=[], static=False)
    drafter = exact_drafter(model, tree_name) if tree_name else None
    static = generate(model, None, PROMPT, drafter, max_new_tokens=30, stop_token_ids=[], static=True)
    assert static.new_tokens == eager.new_tokens
    if tree_name == "sparse64":
        assert static.mean_accepted_length > 2                 # long accepted paths went through the static cache


def test_capture_that_cannot_run_falls_back_to_the_eager_forward(tiny_model):
    """Graphs asked for on a CPU: every size's capture fails, is recorded, and the step runs eagerly."""
    model, _ = tiny_model
    ids = torch.tensor([PROMPT])
    state = prefill(model, ids, SamplingConfig())
    static = attach_static(state, None, max_new_tokens=8, capture=True)
    assert isinstance(state.decoder, StaticDecoder) and static.mode == "cuda_graphs"
    tokens = [decoding.decode_step(state)[0][0] for _ in range(4)]
    assert tokens == generate(model, None, PROMPT, max_new_tokens=5, stop_token_ids=[], static=False).new_tokens[1:]
    assert list(static.fallback) == [(1, static_step.SPAN_STEP)] and static.graphs == {}
    assert static_step.static_summaries()[-1]["fallback"][0][:2] == [1, static_step.SPAN_STEP]


def test_buffers_hold_the_tree_mask_positions_and_padding(tiny_model):
    model, _ = tiny_model
    state = prefill(model, torch.tensor([PROMPT]), SamplingConfig())
    static = attach_static(state, None, max_new_tokens=16, buckets=(1, 4, 8))
    past = state.past
    tree = tree_from_config({"name": "t", "kind": "paths", "top_k": 10, "paths": [[0], [1], [0, 0], [0, 1]]})
    buf = TreeBuffers.build(tree)
    n = buf.num_tokens                                                        # 5 with the root: padded to 8
    mask = verify_masks(model.config, buf, past, torch.float32, "cpu")
    ids = torch.arange(1, n + 1).unsqueeze(0)
    b, span = static.fill(ids, mask, (buf.depth + past).unsqueeze(0), past)
    lowest = torch.finfo(torch.float32).min
    assert b == 8 and span == static_step.SPAN_STEP and static.bucket(1) == 1 and static.bucket(9) == 9
    assert static.ids[0, :b].tolist() == [1, 2, 3, 4, 5, 0, 0, 0]
    assert static.position_ids[0, :n].tolist() == (buf.depth + past).tolist()
    assert static.positions[:b].tolist() == list(range(past, past + b))       # the cache slots each row writes
    assert torch.equal(static.mask[0, 0, :n, :past + n], mask[0, 0])          # the engine's own mask, unchanged
    assert (static.mask[0, 0, :n, past + n:] == lowest).all()                  # padding and unfilled slots hidden
    for r in range(n, b):                                                     # a padding row sees its own slot only
        assert (static.mask[0, 0, r] == 0).nonzero().flatten().tolist() == [past + r]
    with pytest.raises(ValueError, match="does not fit"):
        static.fill(ids, mask, (buf.depth + past).unsqueeze(0), static.cache.capacity - 4)


def test_sliding_window_models_stay_eager():
    """Their per-layer masks do not fit the static step's one mask buffer (EAGLE-3's taps do: test_static_taps.py)."""
    model, _ = build_tiny_model("mistral", sliding_window=24)
    state = prefill(model, torch.tensor([PROMPT]), SamplingConfig())
    assert attach_static(state, None, max_new_tokens=8) is None and not isinstance(state.decoder, StaticDecoder)


def test_the_static_step_is_taken_when_the_caller_asks_whatever_the_host_record_says(tiny_model, monkeypatch):
    """generate(static=...) alone decides (the stages pass pipelines/host.py static_step): the host settings' record
    saying static_step (the CUDA check stubbed) turns nothing on, and static=True does without it."""
    from models import hardware

    model, _ = tiny_model
    attached = []
    monkeypatch.setattr(decoding, "attach_static", lambda state, drafter, n: attached.append(n))
    monkeypatch.setattr(hardware, "is_cuda", lambda device: True)
    monkeypatch.setattr(hardware, "HOST_SETTINGS", {"static_step": True})
    generate(model, None, PROMPT, max_new_tokens=3, stop_token_ids=[])
    generate(model, None, PROMPT, max_new_tokens=3, stop_token_ids=[], static=False)
    assert attached == []
    monkeypatch.setattr(hardware, "HOST_SETTINGS", {})
    generate(model, None, PROMPT, max_new_tokens=4, stop_token_ids=[], static=True)
    assert attached == [4]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tree_name", [None, "sparse64"])
def test_on_cuda_the_captured_graphs_decode_what_the_eager_step_decodes(tiny_model, tree_name):
    model, _ = tiny_model
    model = model.to("cuda")
    eager = generate(model, None, PROMPT, max_new_tokens=30, stop_token_ids=[], static=False)
    drafter = exact_drafter(model, tree_name) if tree_name else None
    state = prefill(model, torch.tensor([PROMPT], device="cuda"), SamplingConfig(), drafter=drafter)
    static = attach_static(state, drafter, max_new_tokens=30)
    assert static.mode == "cuda_graphs"
    graphs = generate(model, None, PROMPT, drafter, max_new_tokens=30, stop_token_ids=[], static=True)
    assert graphs.new_tokens == eager.new_tokens
    assert static.graphs and static.fallback == {}          # the steps replayed graphs (kept from attach_static)


def test_a_model_keeps_its_static_decoder_from_one_call_to_the_next(tiny_model):
    """Graphs are captured once per model: the second decode reuses the first's buffers and cache storage, and a
    decode that needs more positions gets a larger one; the outputs stay the eager ones."""
    model, _ = tiny_model
    kept = []
    for n in (5, 7):
        state = prefill(model, torch.tensor([PROMPT]), SamplingConfig())
        kept.append(attach_static(state, None, max_new_tokens=n, capture=False))
    assert kept[0] is kept[1] and kept[0].cache.capacity % static_step.CAPACITY_STEP == 0
    storage = kept[0].cache.layers[0]._k.data_ptr()
    eager = generate(model, None, PROMPT, max_new_tokens=12, stop_token_ids=[], static=False)
    again = generate(model, None, PROMPT, max_new_tokens=12, stop_token_ids=[], static=True)
    assert again.new_tokens == eager.new_tokens
    state = prefill(model, torch.tensor([PROMPT]), SamplingConfig())
    assert attach_static(state, None, max_new_tokens=8, capture=False).cache.layers[0]._k.data_ptr() == storage
    state = prefill(model, torch.tensor([PROMPT]), SamplingConfig())
    bigger = attach_static(state, None, max_new_tokens=static_step.CAPACITY_STEP, capture=False)
    assert bigger is not kept[0] and bigger.cache.capacity >= len(PROMPT) + static_step.CAPACITY_STEP


def test_the_verify_profile_takes_the_static_step_when_asked(tiny_model):
    from models.measure.latency import verify_latency_profile

    model, _ = tiny_model
    prof = verify_latency_profile(model, [1, 4, 16], repeats=1, prefix_len=20, static=True)
    assert prof["static"] and prof["sizes"] == [1, 4, 16] and all(t > 0 for t in prof["forward_lm_head_s"])
    assert verify_latency_profile(model, [1, 4], repeats=1, prefix_len=20)["static"] is False   # a CPU: host says no


def test_the_span_is_the_filled_slots_rounded_up_to_the_span_step_within_the_capacity(monkeypatch):
    from models.engine.kv_cache import StaticCache

    monkeypatch.setattr(static_step, "SPAN_STEP", 16)
    span_of = static_step.span_of
    assert [span_of(0, 1, 64), span_of(15, 1, 64), span_of(16, 1, 64), span_of(40, 8, 64)] == [16, 16, 32, 48]
    assert span_of(60, 4, 64) == 64 and span_of(50, 16, 70) == 70          # never past the capacity
    positions = torch.arange(4)
    cache = StaticCache(2, 64, positions)
    keys, values = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    assert cache.layers[0].update(keys, values)[0].shape[-2] == 64          # by default: the whole capacity
    cache.set_span(32)
    k, v = cache.layers[0].update(keys, values)
    full_k, full_v = cache.layers[0].storage()
    assert k.shape[-2] == v.shape[-2] == 32 and full_k.shape[-2] == 64      # views; storage() stays full
    assert k.data_ptr() == full_k.data_ptr() and v.data_ptr() == full_v.data_ptr() and torch.equal(k[:, :, :4], keys)
    with pytest.raises(ValueError, match="span"):
        cache.set_span(65)


@pytest.mark.parametrize("tree_name", [None, "sparse64"])
def test_a_decode_across_span_boundaries_decodes_what_the_eager_step_decodes(tiny_model, tree_name, monkeypatch):
    """Spans of 16 slots: the answer's steps attend to ever longer spans (each past + verify size rounded up, within
    the capacity) and still decode the eager tokens."""
    model, _ = tiny_model
    monkeypatch.setattr(static_step, "SPAN_STEP", 16)
    ran, run = [], StaticDecoder.run

    def recording(self, key):
        past, layer = self.cache.get_seq_length(), self.cache.layers[0]
        ran.append((past, key, self.cache.capacity))
        out = run(self, key)
        assert layer.span == key[1] and layer.keys.shape[-2] == past      # attention read span slots; cache unchanged
        return out

    monkeypatch.setattr(StaticDecoder, "run", recording)
    eager = generate(model, None, PROMPT, max_new_tokens=40, stop_token_ids=[], static=False)
    drafter = exact_drafter(model, tree_name) if tree_name else None
    static = generate(model, None, PROMPT, drafter, max_new_tokens=40, stop_token_ids=[], static=True)
    assert static.new_tokens == eager.new_tokens
    for past, (b, span), capacity in ran:
        assert span == min(capacity, -(-(past + b) // 16) * 16) and past + b <= span <= capacity
    assert len({span for _, (_, span), _ in ran}) >= 3                      # two or more span boundaries crossed
