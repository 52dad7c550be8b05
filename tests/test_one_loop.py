"""pytest tests/test_one_loop.py: generate and generate_batch are two doors to one core (decoding.decode).

A batch of one decodes exactly as generate does, for every drafter kind of tests/test_batch.py and for a sampled
run; a lone sequence runs on the model's own causal mask (no attention_mask and no positions in its prefill, no
mask in a plain step) while a batch's prefill is padded and masked; a lone row that stops leaves its cache alone,
while a batch drops the rows of the sequences that stopped; what belongs to one sequence (its past and root, the
static step, static drafts) is refused by name on a state or a batch of several.
"""
from __future__ import annotations

import pytest
import torch

from models.engine.acceptance import SamplingConfig
from models.engine.batch import generate_batch
from models.engine.decoding import Row, decode, generate, prefill_rows, sequences
from models.engine.kv_cache import GrowingCache
from tests.test_batch import DRAFTERS, NEW, tiny  # noqa: F401  (tiny: the fixture of ragged prompts)

pytestmark = pytest.mark.usefixtures("one_thread")


def outcome(res) -> tuple:
    return res.new_tokens, res.accept_lengths, res.from_draft, res.stop_reason, res.steps


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
def test_a_batch_of_one_decodes_as_generate(tiny, kind):
    model, _, prompts = tiny
    make = DRAFTERS[kind](model)
    for p in prompts[:3]:
        alone = generate(model, None, p, make() if make else None, max_new_tokens=NEW, stop_token_ids=[])
        [batch] = generate_batch(model, None, [p], [make()] if make else None, max_new_tokens=NEW, stop_token_ids=[])
        assert outcome(batch) == outcome(alone)
        assert sorted(batch.timings) == sorted(alone.timings) and batch.prefill_time > 0


def test_a_sampled_batch_of_one_draws_as_generate(tiny):
    model, _, prompts = tiny
    make = DRAFTERS["hydra_pp"](model)
    s = SamplingConfig(temperature=1.0, top_k=20, acceptance="sampling", seed=7)
    alone = generate(model, None, prompts[3], make(), sampling=s, max_new_tokens=NEW, stop_token_ids=[])
    [batch] = generate_batch(model, None, [prompts[3]], [make()], sampling=s, max_new_tokens=NEW, stop_token_ids=[])
    assert outcome(batch) == outcome(alone)


def recorded_forwards(model, monkeypatch) -> list[tuple]:
    """(attention_mask given, position_ids given, query length) of every forward of the base decoder."""
    decoder, seen = model.get_decoder(), []
    real = decoder.forward
    monkeypatch.setattr(decoder, "forward", lambda *a, **k: seen.append(
        (k.get("attention_mask") is not None, k.get("position_ids") is not None, k["input_ids"].shape[1]))
        or real(*a, **k))
    return seen


def test_a_lone_sequence_runs_the_models_own_mask_and_a_batch_its_padded_one(tiny, monkeypatch):
    model, _, prompts = tiny
    generate(model, None, prompts[2], max_new_tokens=1)            # the model's one-time logits check, unrecorded
    seen = recorded_forwards(model, monkeypatch)
    generate(model, None, prompts[2], max_new_tokens=4, stop_token_ids=[])
    assert seen == [(False, False, len(prompts[2]))] + [(False, True, 1)] * 3
    seen.clear()
    generate_batch(model, None, prompts[2:4], max_new_tokens=4, stop_token_ids=[])
    assert seen[0] == (True, True, max(map(len, prompts[2:4]))) and all(m and p for m, p, _ in seen[1:])


def test_a_lone_row_that_stops_keeps_its_cache_and_a_batch_drops_the_stopped_rows(tiny, monkeypatch):
    model, _, prompts = tiny
    kept = []
    select = GrowingCache.batch_select_indices
    monkeypatch.setattr(GrowingCache, "batch_select_indices", lambda self, i: kept.append(i.tolist()) or select(self, i))
    three = [prompts[2], prompts[4], prompts[5]]
    plain = [generate(model, None, p, max_new_tokens=12, stop_token_ids=[]).new_tokens for p in three]
    assert kept == []                                   # a lone row that stops: its cache is left as it is
    stop = next(t for t in plain[0][1:10] if t not in plain[1] + plain[2])    # ends the first answer alone
    together = generate_batch(model, None, three, max_new_tokens=12, stop_token_ids=[stop])
    assert [r.stop_reason for r in together] == ["eos", "max_new_tokens", "max_new_tokens"]
    assert kept == [[1, 2]]                             # the first row dropped; the last two stop together


def test_one_sequences_parts_are_refused_on_several(tiny):
    model, _, prompts = tiny
    ids = [torch.tensor(p) for p in prompts[2:4]]
    state = prefill_rows(model, ids, SamplingConfig(), [Row(0, 0), Row(0, 0)], [None, None])
    assert [r.past for r in state.rows] == [len(p) for p in ids]
    with pytest.raises(ValueError, match="this state has 2 rows"):
        state.past
    with pytest.raises(ValueError, match="static drafts .* this prefill has 2 rows"):
        prefill_rows(model, ids, SamplingConfig(), [Row(0, 0), Row(0, 0)], [None, None], static_drafts=True)
    seqs = sequences([None, None], SamplingConfig(), 4, set(), ids[0].device)
    with pytest.raises(ValueError, match="the static step decodes one sequence; this batch has 2"):
        decode(model, None, ids, seqs, SamplingConfig(), static=True)


def test_the_batched_latency_profile_times_the_engines_own_verify(tiny, monkeypatch):
    """models.measure.latency.batch_verify_profile goes through decoding.verify_rows: each B and chain length once a
    repeat (and the warm-up), a lone row's 1-token step maskless as the engine's plain step is, and a batch masked."""
    from models.engine import decoding
    from models.measure.latency import batch_verify_profile

    model, _, _ = tiny
    seen = recorded_forwards(model, monkeypatch)
    calls = []
    real = decoding.verify_rows
    monkeypatch.setattr(decoding, "verify_rows", lambda state, drafts, *a: calls.append(
        (len(state.rows), max(1 if d is None else d.buf.num_tokens for d in drafts))) or real(state, drafts, *a))
    prof = batch_verify_profile(model, batch_sizes=(1, 2), sizes=(1, 4), repeats=2, prefix_len=20)
    assert calls == [(B, n) for B in (1, 2) for _ in range(3) for n in (1, 4)]
    assert len(prof["seconds"]) == 2 and all(len(row) == 2 and min(row) > 0 for row in prof["seconds"])
    steps = [s for s in seen if s[2] in (1, 4)]                           # the verify forwards, after each prefill
    assert steps[0] == (False, True, 1) and steps[1] == (True, True, 4) and all(m for m, _, _ in steps[6:])
