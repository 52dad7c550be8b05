"""What a run of the pipeline costs before it starts: each stage's amount of work, read from the composed config,
times its rate, taken from a finished run, in plain steps of that run's machine per unit of work. A plain step
(one 1-token decoding step of the base model) travels between machines where seconds do not: a machine whose
plain step is twice as long takes about twice as long for every stage. The budget is counted in weight reads (one
pass over every weight of the base model, the floor a decoding step cannot beat on a memory-bound machine), so a
decoder that gets closer to that floor counts toward it.

    plan = Plan.from_params(params, epochs={"medusa1": 2, ...}, eval_extra={"medusa2": 1}, assisted=["sps"])
    work = stage_work(plan)                                   # {stage: (unit, amount)}
    rates = rates_from_run(stage_seconds, work_then, plain_step_s_then)   # {stage: plain steps per unit}
    rows = project(work, rates_file["rates"], plain_step_s=0.10, weight_read_s=0.033)
    print(projection_table(rows, budget=BUDGET_WEIGHT_READS))
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

RATES_FILE = Path(__file__).with_name("cost_rates.json")    # the rates (`python -m pipelines.cost --rates` writes it)
BUDGET_WEIGHT_READS = 585_000     # the whole default run: two hours where one read of the weights takes 12.3 ms
MT_BENCH_QUESTIONS = 80
RAW_RECORDS = 17_672              # records in the cut-off ShareGPT file the assets stage fetches (prepare reads them)


@dataclass
class Plan:
    """The amounts a config asks for, as plain numbers (built from a composed params.yaml by from_params)."""
    heads: list[str]                       # pipeline_heads: trained and calibrated
    families: list[str]                    # profile.eval.families: evaluated and batched
    epochs: dict[str, int]                 # each trained family's effective epochs
    records: int                           # ShareGPT records prepare reads
    distill_answers: int                   # self-distilled conversations
    distill_val: int
    distill_new_tokens: int
    relabel_positions: int
    latency_sizes: int
    latency_repeats: int
    latency_batch_sizes: int               # batch sizes profiled beside batch 1 (0: none)
    calibrate_candidates: int              # trees and grown settings each calibration predicts and times
    questions: int
    turns: int
    repeats: int
    max_new_tokens: int
    reference_methods: int                 # the references stage's methods, its baseline included
    full_trees: int                        # evaluate's trees run on every question
    subset_questions: int                  # the questions of the trees run on a subset, summed over those trees
    eval_extra: dict[str, int] = field(default_factory=dict)   # answers a question beyond the trees (a LoRA
    #                                                            backbone's own baseline)
    assisted: list[str] = field(default_factory=list)   # families also run as transformers' assistant (sps_hf)
    assisted_questions: int | None = None  # ... on N questions (None: every one)
    # per family, where the calibrated kind it was not given (fixed or grown) runs on fewer questions:
    # (trees on every question, questions of the subset trees summed)
    eval_split: dict[str, tuple[int, int]] = field(default_factory=dict)
    # per family, its own trees beside the others' (profile.eval.family_trees): (trees on every question, questions
    # of its subset trees summed)
    family_trees: dict[str, tuple[int, int]] = field(default_factory=dict)
    batch_sizes: int = 0                   # batch sizes above 1 (the batch curve alone)
    batch_lookup_sizes: int = 0            # batch sizes above 1 with prompt lookup merged in
    batch_questions: int | None = None     # the batch curve's questions (None: every one)

    @classmethod
    def from_params(cls, params: dict, epochs: dict[str, int], eval_extra: dict[str, int] | None = None,
                    assisted: list[str] | None = None) -> "Plan":
        prof, ev = params["profile"], params["profile"]["eval"]
        d, c = prof["distill"], prof["calibrate"]
        questions = min(int(ev.get("num_questions") or MT_BENCH_QUESTIONS), MT_BENCH_QUESTIONS)
        limits = ev.get("tree_questions") or {}
        trees = list(ev.get("trees") or [])
        subset = sum(min(int(limits[t]), questions) for t in trees if limits.get(t) is not None)
        full = sum(1 for t in trees if limits.get(t) is None)
        split = {}
        kinds, unchosen = ev.get("choice_trees") or {}, ev.get("unchosen_questions")
        if unchosen is not None:            # which kind calibrate chooses is not known before it runs: the larger
            counts = [sum(1 for t in trees if limits.get(t) is None and kinds.get(t) == k) for k in ("fixed", "grown")]
            moved = min(counts)             # kind is taken as the chosen one
            split = {f: (full - moved, subset + moved * min(int(unchosen), questions))
                     for f in ev.get("families") or [] if f not in (ev.get("both_choices") or [])}
        own = {}
        for f, names in (ev.get("family_trees") or {}).items():
            names = [t for t in names or [] if t not in trees]
            own[f] = (sum(1 for t in names if limits.get(t) is None),
                      sum(min(int(limits[t]), questions) for t in names if limits.get(t) is not None))
        lookup = params["eval"]["prompt_lookup"]
        peers = 1 + (2 if lookup.get("enabled") else 0) + len(params["eval"].get("drafters") or {}) \
            + (1 if (params["eval"].get("hf_generate") or {}).get("enabled") else 0)
        grown = c.get("grown") or {}
        grid = len(grown.get("depth") or []) * len(grown.get("top_k") or []) * len(grown.get("nodes") or [])
        sizes = [int(b) for b in ev.get("batch_sizes") or [1] if int(b) > 1]
        lookup_sizes = ev.get("batch_lookup_sizes")
        lookup_sizes = sizes if lookup_sizes is None else [int(b) for b in lookup_sizes if int(b) > 1]
        return cls(heads=list(params["pipeline_heads"]), families=list(ev.get("families") or []), epochs=epochs,
                   records=int(prof["prepare"].get("max_conversations") or RAW_RECORDS),
                   distill_answers=int(d["num_conversations"]), distill_val=int(d.get("val_conversations") or 0),
                   distill_new_tokens=int(d["max_new_tokens"]), relabel_positions=int(d.get("relabel_positions") or 0),
                   latency_sizes=len(c["latency_sizes"]), latency_repeats=int(c["latency_repeats"]),
                   latency_batch_sizes=len([b for b in c.get("batch_sizes") or [1] if int(b) > 1]),
                   calibrate_candidates=len(c.get("budgets") or []) + 2 + grid,
                   questions=questions, turns=int(ev.get("turns") or 1), repeats=int(ev.get("repeats") or 1),
                   max_new_tokens=int(ev["max_new_tokens"]), reference_methods=peers,
                   full_trees=full, subset_questions=subset, eval_extra=dict(eval_extra or {}), eval_split=split,
                   family_trees=own,
                   assisted=list(assisted or []),
                   assisted_questions=None if ev.get("assisted_questions") is None else
                   min(int(ev["assisted_questions"]), questions),
                   batch_sizes=len(sizes), batch_lookup_sizes=len(lookup_sizes),
                   batch_questions=None if ev.get("batch_questions") is None else
                   min(int(ev["batch_questions"]), questions))


def settings_from_metrics(metrics: dict[str, dict]) -> tuple[dict[str, int], dict[str, int], list[str]]:
    """(epochs, eval_extra, assisted) of Plan.from_params as a finished run's stage metrics record them: each train
    stage's effective epochs, an evaluate stage's baseline of its adapted backbone (baseline-<h>) and its
    transformers' assisted generation (<h>_hf)."""
    epochs = {n[len("train_"):]: int(m.get("epochs") or 1) for n, m in metrics.items()
              if n.startswith("train_") and isinstance(m, dict)}
    extra, assisted = {}, []
    for n, m in metrics.items():
        if n.startswith("evaluate_") and isinstance(m, dict):
            h, names = n[len("evaluate_"):], set(m.get("methods") or {})
            if f"baseline-{h}" in names:
                extra[h] = 1
            if f"{h}_hf" in names:
                assisted.append(h)
    return epochs, extra, assisted


def stage_work(plan: Plan) -> dict[str, tuple[str, float]]:
    """{stage: (unit of work, amount)} for every stage the plan runs, in the order the pipeline runs them."""
    answer = plan.turns * plan.repeats * plan.max_new_tokens            # new tokens of one question's answers
    positions = (plan.distill_answers - plan.distill_val) * plan.distill_new_tokens + plan.relabel_positions
    work: dict[str, tuple[str, float]] = {
        "prepare": ("ShareGPT records read", plan.records),
        # a relabelled position costs about two teacher-forced tokens (its prompt beside it)
        "distill": ("tokens generated or teacher-forced",
                    plan.distill_answers * plan.distill_new_tokens + 2 * plan.relabel_positions)}
    for h in plan.heads:
        work[f"train@{h}"] = ("training positions x epochs", positions * plan.epochs.get(h, 1))
    timed = plan.latency_sizes * (plan.latency_repeats + 1)
    work["calibrate_latency"] = ("verify steps timed", timed * (1 + plan.latency_batch_sizes))
    for h in plan.heads:
        work[f"calibrate@{h}"] = ("candidate trees predicted and timed", plan.calibrate_candidates)
    work["references"] = ("new tokens decoded", plan.reference_methods * plan.questions * answer)
    for h in plan.families:
        trees, subset = plan.eval_split.get(h, (plan.full_trees, plan.subset_questions))
        own_full, own_subset = plan.family_trees.get(h, (0, 0))         # its own trees
        full = 1 + trees + own_full + plan.eval_extra.get(h, 0)         # its own baseline, the trees, the extras
        subset += own_subset
        if h in plan.assisted:
            full, subset = (full + 1, subset) if plan.assisted_questions is None else \
                (full, subset + plan.assisted_questions)
        work[f"evaluate@{h}"] = ("new tokens decoded", (full * plan.questions + subset) * answer)
    if plan.batch_sizes:
        curve = plan.questions if plan.batch_questions is None else plan.batch_questions
        work["batch_baseline"] = ("new tokens decoded in batches", plan.batch_sizes * curve * answer)
        for h in plan.families:
            work[f"batch@{h}"] = ("new tokens decoded in batches",
                                  (plan.batch_sizes + plan.batch_lookup_sizes) * curve * answer)
    work["tables"] = ("run", 1)
    return work


def rates_from_run(seconds: dict[str, float], work: dict[str, tuple[str, float]],
                   plain_step_s: float) -> dict[str, float]:
    """{stage: plain steps per unit of work} from a finished run's stage seconds and the work its config asked for."""
    return {s: t / plain_step_s / work[s][1] for s, t in seconds.items() if s in work and work[s][1] and t}


def is_training(stage: str) -> bool:
    return stage.startswith("train@")


def rate_for(stage: str, rates: dict[str, dict]) -> dict | None:
    """A stage's rate entry; a stage the rate run did not have takes its kind's (train@dflash: the mean of the
    train@ rates), marked as borrowed."""
    if stage in rates:
        return rates[stage]
    kind = stage.split("@")[0] + "@"
    same = [r for s, r in rates.items() if s.startswith(kind)]
    if "@" not in stage or not same:
        return None
    rate = {"plain_steps_per_unit": sum(r["plain_steps_per_unit"] for r in same) / len(same),
            "source": f"mean of the {kind} stages' rates"}
    if all(r.get("train_steps_per_unit") for r in same):
        rate["train_steps_per_unit"] = sum(r["train_steps_per_unit"] for r in same) / len(same)
    return rate


@dataclass
class Row:
    stage: str
    unit: str
    amount: float
    plain_steps: float | None
    seconds: float | None
    weight_reads: float | None
    source: str


def project(work: dict[str, tuple[str, float]], rates: dict[str, dict], plain_step_s: float,
            weight_read_s: float, train_step_s: float | None = None) -> list[Row]:
    """Each stage's cost here: amount x plain steps per unit, in this machine's seconds and weight reads. A train
    stage whose rate also counts train steps (one forward and backward of the base, models/measure/latency.py
    train_step_seconds) goes through this machine's train step when it is known: training is compute-bound and
    does not follow the plain step between machines."""
    rows = []
    for stage, (unit, amount) in work.items():
        rate = rate_for(stage, rates)
        if rate is None:
            rows.append(Row(stage, unit, amount, None, None, None, "no rate"))
            continue
        if train_step_s and is_training(stage) and rate.get("train_steps_per_unit"):
            seconds = amount * rate["train_steps_per_unit"] * train_step_s
            steps = seconds / plain_step_s
            rows.append(Row(stage, unit, amount, steps, seconds, seconds / weight_read_s,
                            f"{rate.get('source', '')}, through the train step"))
            continue
        steps = amount * rate["plain_steps_per_unit"]
        seconds = steps * plain_step_s
        rows.append(Row(stage, unit, amount, steps, seconds, seconds / weight_read_s, rate.get("source", "")))
    return rows


def minutes(seconds: float | None) -> str:
    """Seconds in words: "2 min 05 s", "3 h 07 min" (the run section and make cost alike); "-" for none."""
    if seconds is None:
        return "-"
    m, s = divmod(int(round(seconds)), 60)
    if m >= 60:
        return f"{m // 60} h {m % 60:02d} min"
    return f"{m} min {s:02d} s"


def total(rows: list[Row]) -> tuple[float, float, float]:
    """(plain steps, seconds, weight reads) summed over the rows that have a rate."""
    return (sum(r.plain_steps or 0 for r in rows), sum(r.seconds or 0 for r in rows),
            sum(r.weight_reads or 0 for r in rows))


def verdict(weight_reads: float, budget: float = BUDGET_WEIGHT_READS) -> str:
    if weight_reads <= budget:
        return f"within the budget of {budget:,.0f} weight reads ({weight_reads / budget:.0%} of it)"
    return f"{weight_reads / budget - 1:.0%} over the budget of {budget:,.0f} weight reads"


def projection_table(rows: list[Row], budget: float = BUDGET_WEIGHT_READS) -> str:
    lines = ["| stage | unit of work | amount | plain steps | weight reads | minutes here | rate from |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.seconds is None:
            lines.append(f"| {r.stage} | {r.unit} | {r.amount:,.0f} | - | - | - | {r.source} |")
        else:
            lines.append(f"| {r.stage} | {r.unit} | {r.amount:,.0f} | {r.plain_steps:,.0f} | {r.weight_reads:,.0f} "
                         f"| {r.seconds / 60:,.1f} | {r.source} |")
    steps, seconds, reads = total(rows)
    lines.append(f"| all | | | {steps:,.0f} | {reads:,.0f} | {seconds / 60:,.1f} | |")
    missing = [r.stage for r in rows if r.seconds is None]
    tail = f"Projected: {minutes(seconds)} here, {verdict(reads, budget)}."
    if missing:
        tail += f" Not counted (no rate): {', '.join(missing)}."
    return "\n".join(lines) + "\n\n" + tail + "\n"
