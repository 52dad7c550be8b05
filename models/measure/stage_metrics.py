"""reports/metrics/evaluate*.json from an evaluation summary: the figures DVC tracks and the tables read."""
from __future__ import annotations

from models.measure.lossless import tie_summary


def metrics_of(summary: dict, lossless: dict, per_question: bool = False) -> dict:
    """reports/metrics/evaluate*.json: per method both speedups, and the stronger prompt lookup (pld or
    pld_hf, by end-to-end speedup) that "beats prompt lookup" is judged against. per_question: also each
    question's speedup and accepted length (a run of one method, so that the tables can pair it question by
    question with the main run's methods)."""
    base = summary["methods"]["baseline"]
    def ci(s, key):
        return (s.get("intervals") or {}).get(key, {}).get("ci")

    def alt(s, key):
        e = (s.get("intervals") or {}).get(key) or {}
        return {"value": e.get("value"), "ci": e.get("ci")}

    methods = {n: {"speedup": s["speedup"]["mean"], "speedup_ci": ci(s, "speedup"), "speedup_std": s["speedup"]["std"],
                   "decode_speedup": s["decode_speedup"]["mean"], "decode_speedup_ci": ci(s, "decode_speedup"),
                   "decode_speedup_std": s["decode_speedup"]["std"],
                   "speedup_mean_of_ratios": alt(s, "mean_of_ratios"), "speedup_pooled": alt(s, "pooled"),
                   "accept_length": s["accept_length"]["mean"], "accept_length_ci": ci(s, "accept_length"),
                   "tokens_per_s": s["throughput"]["mean"],
                   "decode_tokens_per_s": s["decode_throughput"]["mean"], "questions": s["questions"],
                   "per_category_speedup": {c: v["speedup"]["mean"] for c, v in (s.get("per_category") or {}).items()},
                   **({"pld_speedups": s["pld_speedups"]} if "pld_speedups" in s else {}),
                   **({"agreement_with_base": s["agreement_with_base"]} if "agreement_with_base" in s else {}),
                   **({"per_question": {q: {k: (None if r[k] is None else round(r[k], 4))
                                            for k in ("speedup", "accept_length")}
                                        for q, r in (s.get("per_question") or {}).items()}} if per_question else {})}
               for n, s in summary["methods"].items() if n != "baseline"}
    plds = [n for n, s in summary["methods"].items()
            if s["kind"] in ("pld", "pld_hf") and s["speedup"]["mean"] is not None]
    best = max(plds, key=lambda n: summary["methods"][n]["speedup"]["mean"], default=None)
    return {"tag": summary["tag"], "lossless": lossless["passed"],
            "lossless_checked_turns": sum(v["checked_turns"] for v in lossless.get("methods", {}).values()),
            "lossless_ties": len(lossless.get("ties", [])), "lossless_summary": tie_summary(lossless),
            "interval": "95% percentile bootstrap over questions (10,000 resamples); speedup: mean per-question "
                        "throughput over the baseline's (Spec-Bench), speedup_mean_of_ratios: mean of per-question "
                        "ratios, speedup_pooled: summed tokens over summed time",
            "num_questions": summary["settings"]["num_questions"],
            "max_new_tokens": summary["settings"]["max_new_tokens"],
            "baseline_tokens_per_s": base["throughput"]["mean"],
            "baseline_decode_tokens_per_s": base["decode_throughput"]["mean"],
            "strongest_pld": best and {"method": best, **{k: methods[best][k] for k in ("speedup", "decode_speedup")}},
            "methods": methods}
