"""The losslessness check of an evaluation: every greedy answer against its autoregressive reference, token
for token; a difference at a float tie of the base model's logits is reported apart from a failure.

    report = check_lossless(methods, records, prompts, tolerance=1e-3)
    if not report["passed"]: raise LosslessnessError(failure_message(report))
"""
from __future__ import annotations

import torch

from models.measure.benchmark import first_difference


class LosslessnessError(RuntimeError):
    """A greedy method produced tokens that differ from its autoregressive reference."""


def check_lossless(methods: list, records: dict, prompts: dict, tolerance: float) -> dict:
    """Every greedy turn of every method against its reference's tokens (the baseline, or the AR run of
    the same adapted backbone). methods: objects with name, reference (None: not checked) and model;
    records[name][run] = [TurnRecord]; prompts[(run, question_id, turn)] = input ids. Mismatches at a float
    tie (|logit gap| <= tolerance) are reported apart."""
    by_name = {m.name: m for m in methods}
    report = {"passed": True, "tie_tolerance": tolerance, "methods": {}, "failures": [], "ties": [],
              "skipped_sampled_turns": 0}
    for m in methods:
        if m.reference is None:
            continue
        ref_model = by_name[m.reference].model
        stats = {"reference": m.reference, "checked_turns": 0, "identical": 0, "ties": 0, "failures": 0}
        for run, (recs, ref_recs) in enumerate(zip(records[m.name], records[m.reference])):
            ref_by_key = {(r.question_id, r.turn): r for r in ref_recs}
            for rec in recs:
                if rec.temperature > 0:
                    report["skipped_sampled_turns"] += 1
                    continue
                ref = ref_by_key[(rec.question_id, rec.turn)]
                stats["checked_turns"] += 1
                pos = first_difference(ref.tokens, rec.tokens)
                if pos is None:
                    stats["identical"] += 1
                    continue
                got = rec.tokens[pos] if pos < len(rec.tokens) else None
                margin = greedy_margin(ref_model, prompts[(run, rec.question_id, rec.turn)], ref.tokens, pos, got)
                entry = {"question_id": rec.question_id, "turn": rec.turn, "run": run, "method": m.name,
                         "reference": m.reference, "position": pos,
                         "expected_token": ref.tokens[pos] if pos < len(ref.tokens) else None, "got_token": got,
                         "expected_length": len(ref.tokens), "got_length": len(rec.tokens), "logit_margin": margin}
                if margin is not None and abs(margin) <= tolerance:
                    stats["ties"] += 1
                    report["ties"].append(entry)
                else:
                    stats["failures"] += 1
                    report["failures"].append(entry)
        report["methods"][m.name] = stats
    report["passed"] = not report["failures"]
    return report


def failure_message(report: dict) -> str:
    lines = [f"losslessness check failed: {len(report['failures'])} greedy turn(s) differ from their reference"]
    for f in report["failures"][:10]:
        lines.append(f"  question {f['question_id']} turn {f['turn']} (run {f['run']}): method {f['method']} differs "
                     f"from {f['reference']} first at new-token position {f['position']} (expected "
                     f"{f['expected_token']}, got {f['got_token']}; lengths {f['expected_length']} vs {f['got_length']})")
    return "\n".join(lines)


@torch.no_grad()
def greedy_margin(model, prompt_ids: list[int], reference: list[int], position: int, other_token: int | None) -> float | None:
    """Logit of the reference's token at `position` minus that of `other_token`, with the model
    teacher-forced on prompt + reference[:position]. A margin near 0 marks a numerical tie (two
    tokens equally likely up to float rounding), not a decoding bug."""
    if other_token is None or position >= len(reference):
        return None
    ids = torch.tensor([prompt_ids + reference[:position]], device=next(model.parameters()).device)
    logits = model(input_ids=ids).logits[0, -1].float()       # [V]
    return float(logits[reference[position]] - logits[other_token])
