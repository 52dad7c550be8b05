"""The tree grown per step against a fixed tree of as many drafts: what one step costs each, from the evaluate
stages' per-question records (decode only), so the grown tree's drafting is judged on the same verify width.

    rows = grown_step_rows(summary);  markdown = grown_step_table(rows)

A family's fixed trees (the calibrated one, the papers' 63-node tree, the 4-token chain; not the ones merged with
prompt lookup or cut by cost, whose width changes per step) rarely have exactly the grown tree's number of drafts.
So the fixed step at that width is read from the family's own fixed trees in the same stage:
- exact: a fixed tree with as many drafts;
- interpolated: linearly in drafts between the nearest fixed trees below and above;
- a bound: every fixed tree is wider (or every one narrower). A wider fixed step is an upper bound on the fixed
  step at the grown width, so the grown tree can only be shown to miss the target there; a narrower one a lower
  bound, so it can only be shown to meet it.
The ratio is pooled (all decode time over all steps, each method's) on the questions all the trees used ran, with a
95% bootstrap interval over those questions.
"""
from __future__ import annotations

import numpy as np

from models.measure.intervals import bootstrap_columns

TARGET = 1.05        # the grown step at most this many fixed steps of as many drafts


def _is_fixed(m: dict) -> bool:
    return (m.get("kind") == "heads" and bool(m.get("tree_nodes")) and not m.get("grown")
            and not m.get("cut_by_cost") and not m.get("lookup_branch"))


def _timed(m: dict) -> dict[str, tuple[float, float]]:
    """{question: (decode seconds, steps)} where the method took steps."""
    return {q: (float(r["decode_time"]), float(r["steps"])) for q, r in (m.get("per_question") or {}).items()
            if r.get("steps") and r.get("decode_time")}


def _fixed_at(width: int, fixed: list[tuple[int, str]]) -> tuple[str, list[tuple[str, float]]]:
    """How the fixed step at `width` drafts is read, and the fixed trees with their weights. fixed: (drafts, name),
    sorted; among trees of equal width the first (the caller puts the one on more questions first)."""
    exact = [name for n, name in fixed if n == width]
    if exact:
        return "exact", [(exact[0], 1.0)]
    below = [(n, name) for n, name in fixed if n < width]
    above = [(n, name) for n, name in fixed if n > width]
    if below and above:
        (lo, a), (hi, b) = below[-1], above[0]
        w = (width - lo) / (hi - lo)
        return "interpolated", [(a, 1.0 - w), (b, w)]
    return ("upper bound", [(above[0][1], 1.0)]) if above else ("lower bound", [(below[-1][1], 1.0)])


def _ratio(grown: dict, parts: list[tuple[dict, float]]) -> tuple[float, list[float] | None, int]:
    """Pooled grown step over the weighted fixed steps, its interval and the questions it is read on."""
    timed = [_timed(grown)] + [_timed(m) for m, _ in parts]
    shared = sorted(set.intersection(*(set(t) for t in timed)))
    if not shared:
        return float("nan"), None, 0
    cols = {f"{k}{i}": [t[q][j] for q in shared] for i, t in enumerate(timed) for j, k in enumerate(("t", "s"))}

    def stat(c):
        fixed = sum(w * c[f"t{i + 1}"].sum(-1) / c[f"s{i + 1}"].sum(-1) for i, (_, w) in enumerate(parts))
        return c["t0"].sum(-1) / c["s0"].sum(-1) / fixed

    point = float(stat({k: np.asarray(v, dtype=float) for k, v in cols.items()}))
    ci = bootstrap_columns(cols, stat)
    return point, None if ci is None else [ci[0], ci[1]], len(shared)


def verdict(how: str, ratio: float, ci: list[float] | None) -> str:
    """Met / missed against TARGET, as far as how the fixed step was read allows."""
    if ratio != ratio:
        return "no shared questions"
    if how == "upper bound" and ratio <= TARGET:
        return "not judged here (every fixed tree is wider)"
    if how == "lower bound" and ratio > TARGET:
        return "not judged here (every fixed tree is narrower)"
    word = "met" if ratio <= TARGET else "missed"
    return word + (f" (the interval reaches past {TARGET})" if ci and ci[0] <= TARGET < ci[1] else "")


def grown_step_rows(summary: dict) -> list[dict]:
    """One row per family with a tree grown per step (not merged with prompt lookup) and a fixed tree."""
    methods = summary.get("methods", {})
    rows = []
    for name, g in methods.items():
        if g.get("kind") != "heads" or not g.get("grown") or g.get("lookup_branch") or not g.get("tree_nodes"):
            continue
        peers = [(n, m) for n, m in methods.items() if _is_fixed(m) and m.get("heads") == g.get("heads")]
        if not peers:
            continue
        peers.sort(key=lambda p: (p[1]["tree_nodes"], -len(_timed(p[1]))))
        how, parts = _fixed_at(int(g["tree_nodes"]), [(int(m["tree_nodes"]), n) for n, m in peers])
        ratio, ci, questions = _ratio(g, [(methods[n], w) for n, w in parts])
        rows.append({"heads": g.get("heads"), "grown": name, "drafts": int(g["tree_nodes"]), "how": how,
                     "fixed": [{"method": n, "drafts": int(methods[n]["tree_nodes"]), "weight": w} for n, w in parts],
                     "ratio": ratio, "interval": ci, "questions": questions, "verdict": verdict(how, ratio, ci)})
    return rows


def grown_step_table(rows: list[dict]) -> str:
    lines = ["| Family | Grown tree (drafts) | Fixed step read from | Questions | Grown step / fixed step | "
             f"Target {TARGET}x |", "|---|---|---|---|---|---|"]
    for r in rows:
        src = " + ".join(f"{f['weight']:.2f} x {f['method']} ({f['drafts']})" if r["how"] == "interpolated"
                         else f"{f['method']} ({f['drafts']})" for f in r["fixed"])
        ci = f" [{r['interval'][0]:.2f}, {r['interval'][1]:.2f}]" if r["interval"] else ""
        lines.append(f"| {r['heads']} | {r['grown']} ({r['drafts']}) | {r['how']}: {src} | {r['questions']} | "
                     f"{r['ratio']:.2f}x{ci} | {r['verdict']} |")
    return "\n".join(lines) + "\n"
