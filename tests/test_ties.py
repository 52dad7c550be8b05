"""The tie rule of the losslessness check (models/measure/ties.py, lossless.py): the tolerance follows the dtype
and the logits' magnitude; a flip between two logits that bf16 cannot tell apart is reported as a tie with its
margins and tolerance; a planted real difference (a verify rule that accepts a draft the base rejected) fails
in bf16 and in float32 alike."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from models.base import build_tiny_model
from models.engine import acceptance
from models.engine.decoding import generate
from models.engine.drafting import make_drafter
from models.measure.benchmark import TurnRecord
from models.measure.lossless import check_lossless, tie_summary
from models.measure.ties import rounding_step, step_start_of, tie_tolerance
from tests.test_decoding import prompt_ids

TWIN_TOKEN = 200          # its LM-head row is the reference token's, scaled: a near-tie by construction
FLOOR = 1e-3


def next_up(x: float, dtype: torch.dtype) -> float:
    """The next representable number above x > 0 in dtype, by its bit pattern (independent of rounding_step)."""
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
    t = torch.tensor([x], dtype=dtype)
    return float((t.view(bits) + 1).view(dtype)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x", [0.75, 3.0, 12.5, 20.0, 100.0])
def test_the_rounding_step_is_the_gap_to_the_next_number(dtype, x):
    assert rounding_step(dtype, x) == next_up(x, dtype) - x
    assert rounding_step(dtype, -x) == rounding_step(dtype, x)


def test_the_tolerance_follows_the_dtype_and_keeps_float32_as_strict_as_the_floor():
    assert tie_tolerance(torch.float32, 20.0, 19.9, FLOOR) == FLOOR          # 2 float32 steps at 20: 3.8e-6
    assert tie_tolerance(torch.bfloat16, 20.0, 19.9, FLOOR) == 2 * 0.125     # bf16 numbers in [16, 32): 0.125 apart
    assert tie_tolerance(torch.bfloat16, 0.3, -5.0, FLOOR) == 2 * 0.03125    # the larger magnitude sets it
    assert tie_tolerance(torch.bfloat16, 1e-4, 1e-4, FLOOR) == FLOOR
    with pytest.raises(ValueError, match="-1"):
        tie_tolerance(torch.float32, 1.0, 1.0, -1)


def test_step_start_counts_the_tokens_emitted_before_the_step():
    # prefill emits token 0; steps emit 3, 1, 2 tokens: tokens 1-3, 4, 5-6
    assert [step_start_of([3, 1, 2], p) for p in range(7)] == [0, 1, 1, 1, 4, 5, 5]


def twin_model(dtype):
    """A tiny Llama whose greedy answer's first token has a twin: the twin's LM-head row is the token's, scaled
    by 1 - 2^-9, so their logits differ by ~0.2% of the logit, below two bf16 steps, above float32's floor."""
    model, tok = build_tiny_model(seed=5)
    prompt = prompt_ids(tok)
    first = generate(model, tok, prompt, max_new_tokens=1, stop_token_ids=[]).new_tokens[0]
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[first] *= 4.0                                  # logits of ~16: a margin float32 does not call a tie
        head[TWIN_TOKEN] = head[first] * (1 - 2 ** -9)
    return model.to(dtype), tok, prompt, first


def turn(tokens, accept_lengths, method):
    return TurnRecord(1, "writing", 1, method, 0, 0.0, len(tokens), 1.0, len(accept_lengths), accept_lengths,
                      tokens=list(tokens))


def check(model, prompt, ref_tokens, got_tokens, accept_lengths):
    methods = [SimpleNamespace(name="baseline", reference=None, model=model),
               SimpleNamespace(name="method", reference="baseline", model=model)]
    records = {"baseline": [[turn(ref_tokens, [1] * (len(ref_tokens) - 1), "baseline")]],
               "method": [[turn(got_tokens, accept_lengths, "method")]]}
    return check_lossless(methods, records, {(0, 1, 1): prompt}, FLOOR)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_flip_to_a_twin_is_a_tie_in_bf16_and_a_failure_in_float32(dtype):
    model, tok, prompt, first = twin_model(dtype)
    ref = generate(model, tok, prompt, max_new_tokens=6, stop_token_ids=[]).new_tokens
    position = next(p for p, t in enumerate(ref) if p > 0 and t in (first, TWIN_TOKEN))   # bf16 may round them equal
    other = TWIN_TOKEN if ref[position] == first else first
    flipped = ref[:position] + [other] + ref[position + 1:]
    report = check(model, prompt, ref, flipped, [1] * (len(ref) - 1))
    entries = report["ties"] + report["failures"]
    assert len(entries) == 1 and entries[0]["position"] == position and entries[0]["got_token"] == other
    e = entries[0]
    assert set(e["margins"]) == {"one_token", "verify"} and e["dtype"] == str(dtype).removeprefix("torch.")
    if dtype == torch.bfloat16:
        assert report["passed"] and report["ties"] and e["tolerance"] > FLOOR
        assert all(abs(m) <= e["tolerance"] for m in e["margins"].values())
        assert tie_summary(report).startswith("lossless up to 1 tie (question 1 turn 1 method at token")
    else:
        assert not report["passed"] and e["tolerance"] == FLOOR
        assert all(FLOOR < m < 0.1 for m in e["margins"].values())        # a near-tie, but not a float32 one


def accept_a_rejected_draft(tokens, buf, logits, sampling=None, generator=None, draft_q=None):
    """A planted bug: the greedy rule, except that a step accepting nothing takes the first draft anyway."""
    path, bonus = acceptance.accept_greedy(tokens, buf, logits, sampling, generator, draft_q)
    if len(path) == 1 and buf.num_tokens > 1:
        path, bonus = [0, 1], int(logits.rows([1])[0].argmax())
    return path, bonus


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_planted_bug_fails_the_check_in_either_dtype(dtype, monkeypatch):
    model, tok = build_tiny_model(seed=2)
    model = model.to(dtype)
    prompt = prompt_ids(tok)
    ref = generate(model, tok, prompt, max_new_tokens=10, stop_token_ids=[]).new_tokens
    wrong = [t for t in range(100, 110) if t not in ref][:3]
    monkeypatch.setitem(acceptance.ACCEPTANCE, "greedy", accept_a_rejected_draft)
    res = generate(model, tok, prompt, make_drafter({"kind": "fixed", "drafts": wrong}), max_new_tokens=10,
                   stop_token_ids=[])
    report = check(model, prompt, ref, res.new_tokens, res.accept_lengths)
    assert not report["passed"] and not report["ties"] and len(report["failures"]) == 1
    f = report["failures"][0]
    assert f["got_token"] in wrong and min(f["margins"].values()) > f["tolerance"]
