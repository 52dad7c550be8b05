"""The results document (reports/results.md): headline figures with intervals, the paired comparisons, the papers'
claims judged by them, the per-category means and what the joint stage of Medusa-2 did, all from the run's files.

    text = results_markdown(summary, train={"medusa1": {...}, "medusa2": {...}}, latency={...},
                            run={"prepare": {...}, "distill": {...}, "train_medusa1": {...}, ...})
"""
from __future__ import annotations

from analysis.claims import claim_rows, claims_markdown
from analysis.conformance import conformance_section
from analysis.grown_steps import TARGET, grown_step_rows, grown_step_table
from analysis.comparisons import (HF_GENERATE, METRIC_LABELS, compare_across_runs, describe, faster_ar_loop,
                                  fmt_interval, standard_comparisons)
from analysis.recipes_run import recipes_section
from analysis.batch_curve import batch_markdown
from analysis.run_record import run_markdown
from analysis.stage_rates import stage_rates_table
from analysis.tables import CATEGORIES, PLD_KINDS, ours_label


HEADLINE_TREES = ("optimal", "optimal_pld", "dynamic_optimal", "dynamic_optimal_pld")   # fixed and grown, +- lookup


def _fig(entry: dict | None, fmt: str = "{:.2f}") -> str:
    if not entry or entry.get("value") is None:
        return "-"
    return fmt.format(entry["value"]) + (f" ({fmt_interval(entry['ci'])})" if entry.get("ci") else "")


def ar_loops(summary: dict) -> tuple[str, float] | None:
    """(the faster autoregressive loop's name, the factor a speedup over the baseline is multiplied by to be over it)
    from the tokens/s of the baseline and of transformers' greedy generate (hf_generate, the same stage's); None
    without an hf_generate row."""
    ms = summary["methods"]
    base = (ms.get("baseline") or {}).get("throughput", {}).get("mean")
    hf = (ms.get(HF_GENERATE) or {}).get("throughput", {}).get("mean")
    return faster_ar_loop(base, hf) if base and hf else None


def ar_loops_note(summary: dict) -> str:
    """The two autoregressive loops' tokens/s and which is the faster; "" without an hf_generate row."""
    loops = ar_loops(summary)
    if loops is None:
        return ""
    faster, factor = loops
    ms = summary["methods"]
    base, hf = ms["baseline"]["throughput"]["mean"], ms[HF_GENERATE]["throughput"]["mean"]
    text = (f"The two autoregressive loops, no drafting, in the same stage on the same questions: the baseline (this "
            f"decoder) decoded {base:.1f} tokens/s, transformers' greedy generate (`{HF_GENERATE}`) {hf:.1f} tokens/s, "
            "its greedy answers checked token for token against the baseline's. ")
    if faster == HF_GENERATE:
        text += (f"Transformers' is the faster loop on this machine: every speedup over it is the speedup over the "
                 f"baseline x {factor:.2f} ({base:.1f} / {hf:.1f}), the last column.")
    else:
        text += "The baseline is the faster loop on this machine: the speedups over it stand (the last column)."
    return text + "\n"


def headline_table(summary: dict) -> str:
    loops = ar_loops(summary)
    lines = ["| Method | Questions | Speedup (Spec-Bench) | Mean of per-question ratios | Summed tokens / summed time "
             "| Decode-only | Accepted tokens/step |" + (" Over the faster AR loop |" if loops else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if loops else "")]
    for name, m in summary["methods"].items():
        if m["kind"] not in ("heads", *PLD_KINDS, HF_GENERATE):
            continue
        iv = m.get("intervals") or {}
        value = (iv.get("speedup") or {}).get("value", (m.get("speedup") or {}).get("mean"))
        over = "" if not loops else f" {value * loops[1]:.2f}x |" if value is not None else " - |"
        lines.append(f"| {name} | {m.get('questions')} | {_fig(iv.get('speedup'), '{:.2f}x')} | "
                     f"{_fig(iv.get('mean_of_ratios'), '{:.2f}x')} | {_fig(iv.get('pooled'), '{:.2f}x')} | "
                     f"{_fig(iv.get('decode_speedup'), '{:.2f}x')} | {_fig(iv.get('accept_length'))} |{over}")
    return "\n".join(lines) + "\n"


def comparisons_table(rows: list[dict]) -> str:
    lines = ["| Question (A beats B?) | A | B | Compared | A / B (95% interval), questions A wins | Verdict |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        what = "accepted length" if r["metric"] == "accept_length" else "speedup"
        lines.append(f"| {r['question']} | {r['a_label']} | {r['b_label']} | {what} | {describe(r)} | {r['verdict']} |")
    return "\n".join(lines) + "\n"


def category_means_table(summary: dict) -> str:
    methods = [(n, m) for n, m in summary["methods"].items()
               if m["kind"] in PLD_KINDS or (m["kind"] == "heads" and m.get("tree") in HEADLINE_TREES)]
    cats = [c for c in CATEGORIES if any(c in (m.get("per_category") or {}) for _, m in methods)]
    lines = ["| Method | " + " | ".join(cats) + " |", "|---|" + "---|" * len(cats)]
    for name, m in methods:
        per = m.get("per_category") or {}
        cells = [f"{per[c]['speedup']['mean']:.2f}x" if c in per and per[c]["speedup"].get("mean") else "-" for c in cats]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def medusa2_section(summary: dict, train: dict[str, dict], own: dict | None = None) -> str:
    """The joint stage's recipe, head 0 before and after it and along it, how far it moved the backbone, and (own:
    Medusa-2's run of its own, reports/metrics/evaluate_medusa2-optimal.json) Medusa-2 against Medusa-1."""
    m2, m1 = train.get("medusa2"), train.get("medusa1")
    if not m2:
        return ""
    out = []
    hist = m2.get("val_top1_head0_by_epoch") or {}
    s1, s2 = hist.get("stage1") or [], hist.get("stage2") or []
    recipe = m2.get("recipe") or {}
    out.append(f"Recipe: stage 1 trains the heads alone on the frozen base ({len(s1)} epochs); stage 2 trains LoRA "
               f"adapters on every linear layer together with the heads on {m2.get('joint_train_examples', '?')} "
               f"conversations, loss = KL to the adapters-off model + {recipe.get('medusa_lambda')} x "
               f"sum_k {recipe.get('head_decay')}^(k+{recipe.get('head_decay_offset')}) CE_k ({recipe.get('lambda_schedule')} "
               f"warm-up of lambda), LoRA lr {recipe.get('lr')}, heads at {recipe.get('head_lr_multiplier')}x.")
    if s1 and s2:
        verdict = "raised" if max(s2) > max(s1) else "did not raise"
        out.append(f"Head-0 val top-1: {max(s1):.3f} after the heads-only stage, {max(s2):.3f} after the joint stage: "
                   f"the joint stage {verdict} it" + (f" (Medusa-1, same data: {m1['val_top1']['head0']:.3f})." if m1 else "."))
    curve = m2.get("joint_curve") or []
    if curve:
        out.append("\nHead 0 against the joint stage's training positions (validated every few steps within one run; "
                   "the learning rate follows one schedule over the whole run):\n")
        out.append("| joint positions | " + " | ".join(f"{p['positions']:,}" for p in curve) + " |")
        out.append("|---|" + "---|" * len(curve))
        out.append("| head-0 val top-1 | " + " | ".join(f"{p['val_top1_head0']:.3f}" for p in curve) + " |")
    if m2.get("val_answer_perplexity_base"):
        out.append(f"\nHow far the joint stage moved the backbone: perplexity of the val answers "
                   f"{m2['val_answer_perplexity_base']:.3f} with the adapters off, "
                   f"{m2['val_answer_perplexity_adapted']:.3f} with them on.")
    ref = ((own or summary).get("methods", {}).get("baseline-medusa2") or {}).get("agreement_with_base")
    if ref and ref.get("turns"):
        out.append(f"Its greedy MT-Bench answers against the base's: {ref['identical_answers']} of {ref['turns']} "
                   f"identical token for token; {100 * ref['identical_prefix_share']:.1f}% of the base's tokens come "
                   "before the first difference.")
    pair = {m: compare_across_runs(own, "medusa2-optimal", summary, "medusa1-optimal", m) for m in METRIC_LABELS}
    if own and all(pair.values()):
        out.append(f"\nMedusa-2 against Medusa-1 on their calibrated trees, Medusa-2 in a run of its own (`{own.get('tag')}`, "
                   f"{own.get('num_questions')} questions) and Medusa-1 in the main run, paired by question (each speedup "
                   f"over its own run's baseline): accepted length {describe(pair['accept_length'])}; speed "
                   f"{describe(pair['speedup'])}. That run decodes the heads described in this section; the main run's "
                   "Medusa-2 rows above decode the heads that run was made with.")
    return "\n".join(out) + "\n"


def single_runs_section(runs: dict[str, dict]) -> str:
    """One table per run of a single method (reports/metrics/evaluate_<tag>.json: the method beside the baseline and
    the peers it is run with, e.g. the draft model beside transformers' assisted generation)."""
    out = []
    for tag, r in sorted(runs.items()):
        lossless = (r.get("lossless_summary") or "lossless") if r.get("lossless") else "NOT lossless"
        out += [f"`{tag}`: {r.get('num_questions')} questions, {r.get('max_new_tokens')} new tokens, baseline "
                f"{r.get('baseline_tokens_per_s', float('nan')):.1f} tokens/s, {r.get('lossless_checked_turns')} greedy "
                f"turns checked, {lossless}.", "",
                "| Method | Questions | Speedup (Spec-Bench) | Summed tokens / summed time | Accepted tokens/step |",
                "|---|---|---|---|---|"]
        for name, m in r.get("methods", {}).items():
            pooled = m.get("speedup_pooled") or {}
            out.append(f"| {name} | {m.get('questions')} | "
                       f"{_fig({'value': m.get('speedup'), 'ci': m.get('speedup_ci')}, '{:.2f}x')} | "
                       f"{_fig(pooled, '{:.2f}x')} | "
                       f"{_fig({'value': m.get('accept_length'), 'ci': m.get('accept_length_ci')})} |")
        out.append("")
    return "\n".join(out)


def step_cost_rows(summary: dict) -> list[dict]:
    """Per method, pooled over its questions (decode only, the prefill left out): tokens a step, what one step costs
    in baseline steps (drafting, the wider verify, bookkeeping) and the speedup they make, tokens / cost."""
    rows = []
    for name, m in summary.get("methods", {}).items():
        pq = [q for q in (m.get("per_question") or {}).values() if q.get("steps") and q.get("decode_time")]
        if m.get("kind") not in ("heads", *PLD_KINDS) or not pq:
            continue
        steps, time, tokens = (sum(q[k] for q in pq) for k in ("steps", "decode_time", "decode_tokens"))
        base_time, base_tokens = sum(q["base_decode_time"] for q in pq), sum(q["base_decode_tokens"] for q in pq)
        cost = (time / steps) / (base_time / base_tokens)
        rows.append({"method": name, "questions": len(pq), "tokens_per_step": tokens / steps, "step_cost": cost,
                     "step_ms": 1000 * time / steps, "base_step_ms": 1000 * base_time / base_tokens,
                     "decode_speedup": tokens / steps / cost})
    return rows


def step_cost_table(rows: list[dict]) -> str:
    lines = ["| Method | Questions | Tokens a step | Step (ms) | Baseline step (ms) | Step cost (baseline steps) "
             "| Decode speedup (tokens / cost) |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['questions']} | {r['tokens_per_step']:.2f} | {r['step_ms']:.1f} | "
              f"{r['base_step_ms']:.1f} | {r['step_cost']:.2f} | {r['decode_speedup']:.2f}x |" for r in rows]
    return "\n".join(lines) + "\n"


def how_figures_are_made(summary: dict) -> str:
    """The protocol paragraphs: questions, pairing, losslessness, intervals."""
    s = summary.get("settings", {})
    return "\n".join([
        f"{ours_label(summary)}: {s.get('num_questions')} MT-Bench questions, {s.get('turns')} turn(s), "
        f"{s.get('max_new_tokens')} new tokens, {s.get('repeats')} run(s), {s.get('temperature_mode')} decoding, batch 1; "
        "each evaluate stage (`references`: the prompt lookups; `evaluate@<heads>`: one family on its trees) runs its "
        "methods and its own baseline back to back per question in one process, in an order rotated from question to "
        "question; every speedup is over its own stage's baseline, and methods of different stages are paired by "
        "question through those ratios. "
        f"Lossless: {'yes' if summary.get('lossless') else 'NO'} (every greedy answer equals its autoregressive "
        f"reference token for token; {summary.get('lossless_summary') or 'lossless'}).",
        "",
        "Intervals: 95% percentile bootstrap over questions (10,000 resamples). Speedup (Spec-Bench, the headline "
        "figure everywhere): mean per-question tokens/s over the baseline's; mean of per-question ratios: each "
        "question's tokens/s ratio, averaged; summed tokens / summed time: all new tokens over all seconds, over the "
        "baseline's (long answers weigh more). All end to end (prefill included) unless marked decode-only.",
        "",
    ])


ACCURACY_BY_POSITION = (("dflash", "DFlash (block position)"), ("dspark", "DSpark (block position)"),
                        ("eagle3", "EAGLE-3 (depth)"), ("eagle", "EAGLE (depth)"))


def position_accuracy_table(train: dict[str, dict]) -> str:
    """Validation top-1 of each block position of DFlash and DSpark (the token k after the root, all drafted in one
    forward) beside each depth of EAGLE-3 and EAGLE (the token k after the root, each drafted on the one above), from the
    train stage's metrics (val_top1 head k - 1); "" without DFlash's."""
    cols = [(name, label, (train.get(name) or {}).get("val_top1") or {}) for name, label in ACCURACY_BY_POSITION]
    cols = [c for c in cols if c[2]]
    if not any(name == "dflash" for name, _, _ in cols):
        return ""
    deepest = max(len(acc) for _, _, acc in cols)
    lines = ["| k (token after the root) | " + " | ".join(label for _, label, _ in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for k in range(deepest):
        cells = [acc.get(f"head{k}") for _, _, acc in cols]
        lines.append(f"| {k + 1} | " + " | ".join("-" if v is None else f"{v:.3f}" for v in cells) + " |")
    return "\n".join(lines) + "\n"


def later_sections(summary: dict, train: dict, single_runs: dict | None, conformance: dict | None) -> list[str]:
    """The sections shown only when their inputs exist: runs of one method, step costs, conformance, Medusa-2."""
    parts = []
    if single_runs:
        parts += ["## Runs of one method each", "",
                  "Methods run on their own by hand (`python -m pipelines.evaluate heads=<h> tree=<t>`), each beside "
                  "the baseline and its peers in the same process; their speedups compare within a run, not with the "
                  "tables above.", "",
                  single_runs_section(single_runs)]
    costs = step_cost_rows(summary)
    if costs:
        parts += ["## Where the speedup comes from: tokens a step and step cost", "",
                  "Decode only (the prefill left out), pooled over each method's questions: all its decode time over "
                  "all its steps, against its own stage's baseline's time per token on the same questions. "
                  "The speedup is the tokens a step divided by that cost, so a method that accepts more tokens than "
                  "another is still slower when its drafting and wider verify cost more.", "",
                  step_cost_table(costs)]
    grown = grown_step_rows(summary)
    if grown:
        parts += ["### The tree grown per step against a fixed tree of as many drafts", "",
                  "Each family's grown tree's step (drafting, verify, acceptance and commit) over the step of a fixed "
                  "tree with as many drafts, read from the family's own fixed trees in the same stage: exactly, "
                  "interpolated in drafts between the nearest narrower and wider ones, or bounded by one side only "
                  "(analysis/grown_steps.py). Pooled decode time over steps, on the questions every tree used ran, "
                  f"95% bootstrap interval over them. The target: at most {TARGET}x.", "",
                  grown_step_table(grown)]
    if conformance:
        parts += ["## Against the authors' Medusa code", "", conformance_section(conformance)]
    positions = position_accuracy_table(train)
    if positions:
        parts += ["## Validation top-1 by position: the block drafters against the autoregressive drafters' depths",
                  "", "The same held-out positions of the distilled data: DFlash and DSpark draft every position of "
                  "their block in one forward from the root and masks (DSpark's Markov head then biases each position "
                  "by the token before it), EAGLE-3 and EAGLE each depth on the one above it (trained "
                  "through the depths their recipes unroll).", "", positions]
    recipes = recipes_section(train)
    if recipes:
        parts += ["## The recipes as this run trained them", "",
                  "From the train stage's metrics (`reports/metrics/train_<heads>.json`): the epochs trained (and the "
                  "recipe's own count where the equal-epochs rule capped it), learning rate, loss terms, dropout, "
                  "EAGLE's input noise (its width scaled by 512 / T for a conversation of T tokens, as the authors' "
                  "trainer does), the depths a drafter is unrolled over in training, and head 0's validation top-1 "
                  "after each epoch (Medusa-2: its heads-only stage).", "", recipes]
    m2 = medusa2_section(summary, train, (single_runs or {}).get("medusa2-optimal"))
    if m2:
        parts += ["## Medusa-2: the joint stage", "", m2]
    return parts


def rates_section(run: dict[str, dict], latency: dict | None) -> list[str]:
    """Each stage's rate per unit of its work: the cost model's measured column (docs/cost.md)."""
    table = stage_rates_table(run, (latency or {}).get("baseline_step_s"))
    return ["What each stage's work cost (the measured rates of the cost model in `docs/cost.md`; the amounts are "
            "this profile's):", "", table] if table else []


def results_markdown(summary: dict, train: dict[str, dict] | None = None, latency: dict | None = None,
                     run: dict[str, dict] | None = None, single_runs: dict[str, dict] | None = None,
                     conformance: dict | None = None, projection: str | None = None,
                     batch: list[dict] | None = None, projected: dict[str, float] | None = None) -> str:
    """run: the stage metrics files by stem (reports/metrics/<stem>.json), for the run's own section; single_runs:
    {tag: reports/metrics/evaluate_<tag>.json} of runs of one method each; conformance: reports/conformance.json;
    projection: the GPU projection's section (analysis/projection.py projection_markdown); projected: the cost
    model's seconds per stage at this machine's plain step (analysis/cost_model.py), beside the measured ones."""
    train = train or {}
    comps = standard_comparisons(summary)
    parts = [
        "<!-- written by `python -m pipelines.tables` from results/eval/{references,<heads>}/summary.json, "
        "reports/metrics/{prepare,distill,train_*}.json, reports/conformance.json"
        ", results/calibrate/latency.json and the GPU bench file its projection names -->",
        "# Results",
        "",
        *(["## The run", "", run_markdown(summary, run, latency, projected), *rates_section(run, latency)] if run else []),
        "## How the figures are made",
        "",
        how_figures_are_made(summary),
        "## Headline figures",
        "",
        *([note] if (note := ar_loops_note(summary)) else []),
        headline_table(summary),
        "## Paired comparisons",
        "",
        "A against B on the questions both ran: the ratio of their mean per-question values, its paired 95% bootstrap "
        "interval, and the questions where A's value is higher. Verdict: A ahead / B ahead when the interval "
        "excludes 1, else no clear difference.",
        "",
        comparisons_table(comps),
        "## The papers' claims, on this hardware",
        "",
        claims_markdown(claim_rows(summary, train, latency, single_runs, batch)),
        "## Speedup per MT-Bench category (means)",
        "",
        category_means_table(summary),
    ]
    parts += later_sections(summary, train, single_runs, conformance)
    if batch:
        parts += ["## Batches: throughput over the baseline at the same batch size", "",
                  "The MT-Bench first turns decoded in batches of B (models/engine/batch.py), each method on the tree "
                  "calibrate chose for B, alone and with prompt lookup merged in: all new tokens over all wall time "
                  "over the baseline's on the same batches, with its 95% interval over batches; B = 1 is the "
                  "headline's (mean of per-question ratios). A CPU's verify step grows with B x tree tokens from the "
                  "start, a GPU's only once it is compute-bound: the curve here says nothing of a GPU's.", "",
                  batch_markdown(batch)]
    if projection:
        parts += ["## On a GPU: the papers' acceptance over this decoder's step costs (a projection)", "", projection]
    return "\n".join(parts)
