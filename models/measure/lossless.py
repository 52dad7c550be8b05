"""The losslessness check of an evaluation: every greedy answer against its autoregressive reference, token
for token; a difference at a float tie of the base model's logits (models/measure/ties.py: within the dtype's
rounding at their magnitude, in the 1-token and the verify shape) is reported apart from a failure.

    report = check_lossless(methods, records, prompts, tolerance=1e-3)     # tolerance: the ties' absolute floor
    if not report["passed"]: raise LosslessnessError(failure_message(report))
    tie_summary(report)     # "lossless up to 2 ties (q81 t1 at 37: margin 0.031 <= 0.0625 bfloat16, ...)"
"""
from __future__ import annotations

from models.measure.benchmark import first_difference
from models.measure.ties import TIE_STEPS, judge_difference, step_start_of


class LosslessnessError(RuntimeError):
    """A greedy method produced tokens that differ from its autoregressive reference."""


def check_lossless(methods: list, records: dict, prompts: dict, tolerance: float) -> dict:
    """Every greedy turn of every method against its reference's tokens (the baseline, or the AR run of
    the same adapted backbone). methods: objects with name, reference (None: not checked) and model;
    records[name][run] = [TurnRecord]; prompts[(run, question_id, turn)] = input ids. A mismatch at a float
    tie (ties.judge_difference, `tolerance` its absolute floor) is reported apart, with its margins."""
    by_name = {m.name: m for m in methods}
    report = {"passed": True, "tie_tolerance": tolerance,
              "tie_rule": f"|margin| <= max({tolerance}, {TIE_STEPS} rounding steps of the base's dtype at the "
                          "logits' magnitude) in both the 1-token and the verify-shaped forward",
              "methods": {}, "failures": [], "ties": [], "skipped_sampled_turns": 0}
    for m in methods:
        if m.reference is None:
            continue
        stats = {"reference": m.reference, "checked_turns": 0, "identical": 0, "ties": 0, "failures": 0}
        for run, (recs, ref_recs) in enumerate(zip(records[m.name], records[m.reference])):
            ref_by_key = {(r.question_id, r.turn): r for r in ref_recs}
            for rec in recs:
                if rec.temperature > 0:
                    report["skipped_sampled_turns"] += 1
                    continue
                stats["checked_turns"] += 1
                entry = difference(by_name[m.reference].model, prompts[(run, rec.question_id, rec.turn)],
                                   ref_by_key[(rec.question_id, rec.turn)], rec, tolerance)
                if entry is None:
                    stats["identical"] += 1
                    continue
                entry.update(run=run, method=m.name, reference=m.reference)
                kind = "ties" if entry["tie"] else "failures"
                stats[kind] += 1
                report[kind].append(entry)
        report["methods"][m.name] = stats
    report["passed"] = not report["failures"]
    return report


def difference(ref_model, prompt: list[int], ref, rec, floor: float) -> dict | None:
    """The first difference of rec's tokens from ref's (TurnRecords of one turn), judged; None when equal."""
    entry = judged_difference(ref_model, prompt, ref.tokens, rec.tokens, rec.accept_lengths, floor)
    return None if entry is None else {"question_id": rec.question_id, "turn": rec.turn, **entry}


def judged_difference(ref_model, prompt: list[int], reference: list[int], tokens: list[int],
                      accept_lengths: list[int], floor: float) -> dict | None:
    """The first difference of a greedy answer `tokens` (decoded in steps of accept_lengths) from the reference
    answer, with the tie verdict (ties.judge_difference); None when they are equal."""
    pos = first_difference(reference, tokens)
    if pos is None:
        return None
    got = tokens[pos] if pos < len(tokens) else None
    verdict = judge_difference(ref_model, prompt, reference, pos, got, step_start_of(accept_lengths, pos), floor)
    margin = None if verdict["margins"] is None else verdict["margins"]["one_token"]
    return {"position": pos, "expected_token": reference[pos] if pos < len(reference) else None, "got_token": got,
            "expected_length": len(reference), "got_length": len(tokens), "logit_margin": margin, **verdict}


def tie_summary(report: dict, limit: int = 5) -> str:
    """"lossless" or "lossless up to N ties (where, margin, tolerance and dtype)", for the results document."""
    ties = report.get("ties", [])
    if not ties:
        return "lossless"
    where = "; ".join(f"question {t['question_id']} turn {t['turn']} {t['method']} at token {t['position']}: margin "
                      f"{max(abs(v) for v in t['margins'].values()):.3g} <= {t['tolerance']:.3g} ({t['dtype']})"
                      for t in ties[:limit])
    more = f"; {len(ties) - limit} more in lossless_report.json" if len(ties) > limit else ""
    return f"lossless up to {len(ties)} tie{'s' if len(ties) > 1 else ''} ({where}{more})"


def failure_message(report: dict) -> str:
    lines = [f"losslessness check failed: {len(report['failures'])} greedy turn(s) differ from their reference"]
    for f in report["failures"][:10]:
        lines.append(f"  question {f['question_id']} turn {f['turn']} (run {f['run']}): method {f['method']} differs "
                     f"from {f['reference']} first at new-token position {f['position']} (expected "
                     f"{f['expected_token']}, got {f['got_token']}; lengths {f['expected_length']} vs {f['got_length']})")
    return "\n".join(lines)
