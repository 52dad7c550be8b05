"""python -m pipelines.cost [group=option ...]          (make cost [OVERRIDES="profile=smoke"])

What `make repro` will cost on this machine, before it starts, in under a minute: it composes conf/ with the
overrides as `make repro` would, measures this machine's plain step (a 1-token decoding step of the configured
model, the decoder's own, after a 300-token prefix) and weight-read floor (one pass over every weight), and prints
each stage with its unit of work, its amount for this config, its cost in plain steps and weight reads and its
projected minutes here, then the total against the budget (analysis/cost_model.py). The rates, in plain steps of
their machine per unit of work, come from a finished run: analysis/cost_rates.json, which names it.

    python -m pipelines.cost --rates [FILE] [--commits=SHA,...]   # rewrite the rates file from the committed
                     # run (reports/metrics/, params.yaml, the run's plain step); FILE: the params it ran with;
                     # --commits: only the stages those commits ran (a run committed in progress), the rest kept

A missing base model is fetched first (the assets stage's own code); nothing else of the pipeline runs.
"""
from __future__ import annotations

from pipelines import omp  # noqa: F401,I001  (first: OpenMP's wait policy is read when torch loads)
import json
import sys
import time
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from analysis.cost_model import (BUDGET_WEIGHT_READS, RATES_FILE, Plan, is_training, project, projection_table,
                                 rates_from_run, stage_work)
from analysis.run_record import stage_label, wall_time
from pipelines.common import REPO_ROOT, write_json
from pipelines.params import compose_config as compose



def family_settings(cfg) -> tuple[dict[str, int], dict[str, int], list[str]]:
    """({heads: effective training epochs}, {heads: answers a question beyond its trees}, [heads also run as
    transformers' assistant]) for this config: a LoRA recipe runs its adapted backbone's own baseline, a family whose
    draft can be transformers' assistant model also runs assisted generation (eval.sps_hf)."""
    from models.methods import method
    from pipelines.recipes import effective_epochs, stage_heads

    epochs, extra, assisted = {}, {}, []
    for name in dict.fromkeys([*cfg.pipeline_heads, *cfg.profile.eval.families]):
        c = stage_heads(cfg, str(name))
        epochs[str(name)] = effective_epochs(c)
        if c.heads.recipe.get("lora"):
            extra[str(name)] = 1
        if method(str(c.heads.family)).family.assistant and (cfg.eval.get("sps_hf") or {}).get("enabled"):
            assisted.append(str(name))
    return epochs, extra, assisted


def plan_for(cfg) -> Plan:
    epochs, extra, assisted = family_settings(cfg)
    return Plan.from_params(OmegaConf.to_container(cfg, resolve=True), epochs, extra, assisted)


def ensure_model(cfg) -> None:
    """The configured base model on disk: a hub id or tiny model loads as it is; the default's folder comes from the
    assets stage, whose code fetches it now if it is missing."""
    if cfg.model.tiny or not str(cfg.model.source).startswith(str(cfg.paths.artifacts)):
        return
    if Path(cfg.model.source).is_dir():
        return
    from pipelines.assets import build_assets

    print(f"{cfg.model.source} is missing: fetching it first (the assets stage's code, about a minute)")
    build_assets(Path(cfg.paths.artifacts), Path(cfg.data.raw_file), Path(cfg.data.questions_file))


def measure_machine(cfg, repeats: int = 15) -> dict:
    """This machine's plain step and weight-read floor on the configured model, as the decoding stages run it."""
    import torch

    from models.engine.path_choice import prepare_for_decoding
    from models.measure.latency import train_step_seconds, verify_latency_profile, weight_read_seconds
    from pipelines.common import load_model

    threads = cfg.eval.num_threads
    if threads:
        torch.set_num_threads(int(threads))
    model, _ = load_model(cfg)
    model.eval()
    prepare_for_decoding(model)
    t0 = time.perf_counter()
    step = verify_latency_profile(model, sizes=[1], repeats=repeats, prefix_len=300)["forward_lm_head_s"][0]
    floor = weight_read_seconds(model, 7)
    train = train_step_seconds(model)         # the unit calibrate_latency records: a run's train rates are in it
    return {"plain_step_s": step, "weight_read_s": floor["seconds"], "weight_bytes": floor["bytes"],
            "train_step_s": train["seconds"], "train_step_dtype": train["dtype"],
            "measure_s": round(time.perf_counter() - t0, 1), "threads": torch.get_num_threads()}


def load_rates(path: Path = RATES_FILE) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: `python -m pipelines.cost --rates` writes it from a finished run")
    return json.loads(path.read_text())


def preview(overrides: list[str], machine: dict | None = None, rates: dict | None = None) -> str:
    cfg = compose(overrides)
    rates = rates or load_rates()
    if machine is None:
        ensure_model(cfg)
        machine = measure_machine(cfg)
    rows = project(stage_work(plan_for(cfg)), rates["rates"], machine["plain_step_s"], machine["weight_read_s"],
                   machine.get("train_step_s"))
    src = rates.get("source") or {}
    train = (f", one train step (the base forward and backward, "
             f"{machine.get('train_step_dtype', '?')}) {machine['train_step_s']:.2f} s"
             if machine.get("train_step_s") else "")
    head = (f"`make repro` with overrides {overrides or '(none)'}: profile {cfg.profile.name}, model {cfg.model.name}."
            f"\nThis machine: plain step {1e3 * machine['plain_step_s']:.1f} ms, one read of every weight "
            f"{1e3 * machine['weight_read_s']:.1f} ms (a plain step is {machine['plain_step_s'] / machine['weight_read_s']:.2f} "
            f"weight reads){train}. Rates: plain steps per unit of work (and train steps, where its run measured "
            f"them) in the runs each row names; the file's at {str(src.get('commit', '?'))[:12]} "
            f"on the {src.get('cpu', '?')} (plain step {1e3 * float(src.get('plain_step_s') or 0):.1f} ms).\n")
    return head + "\n" + projection_table(rows, BUDGET_WEIGHT_READS)


# -- the rates, from a finished run --------------------------------------------------------------
def run_seconds(metrics_dir: Path) -> dict[str, tuple[float, str]]:
    """{stage: (seconds, the commit that ran it)} from the stage metrics a run committed (reports/metrics/*.json)."""
    out = {}
    for path in sorted(metrics_dir.glob("*.json")):
        m = json.loads(path.read_text())
        if isinstance(m, dict) and wall_time(m):
            out[stage_label(path.stem)] = (float(wall_time(m)), str((m.get("run") or {}).get("commit") or "?"))
    return out


def run_plain_step(metrics_dir: Path) -> tuple[float, float | None, str, float | None]:
    """(plain step, weight read or None, where from, train step or None) of the run whose metrics are in
    metrics_dir: calibrate_latency's own record when the run kept it, else one over the references stage's baseline
    decode rate."""
    lat = metrics_dir / "calibrate_latency.json"
    if lat.is_file():
        rec = json.loads(lat.read_text())
        return (float(rec["baseline_step_s"]), (rec.get("weight_read") or {}).get("seconds"), "calibrate_latency",
                (rec.get("train_step") or {}).get("seconds"))
    ref = json.loads((metrics_dir / "references.json").read_text())
    return 1.0 / float(ref["baseline_decode_tokens_per_s"]), None, "1 / the references baseline's decode tokens/s", None


def write_rates(params_file: Path, metrics_dir: Path = REPO_ROOT / "reports" / "metrics",
                out: Path = RATES_FILE, estimates: dict | None = None, commits: list[str] | None = None) -> dict:
    """The rates file from the run whose stage metrics are in metrics_dir and whose config is params_file; the
    stages it lacks keep the rates already in the file. `commits`: only the stages those commits ran count (a run
    committed in progress, beside an older run's metrics), each stage named with the machine that ran it."""
    text = params_file.read_text()
    cfg = OmegaConf.create(yaml.safe_load(text))
    work = stage_work(plan_for(cfg))
    step, floor, how, train_step = run_plain_step(metrics_dir)
    seconds = run_seconds(metrics_dir)
    if commits:
        seconds = {s: v for s, v in seconds.items() if any(v[1].startswith(c) for c in commits)}
    measured = rates_from_run({s: t for s, (t, _) in seconds.items()}, work, step)
    runs = [json.loads(p.read_text()).get("run") or {} for p in sorted(metrics_dir.glob("*.json"))]
    first = next((r for r in runs if r.get("commit") and (not commits or r["commit"].startswith(tuple(commits)))), {})
    where = f" on the {first.get('cpu', '?')} (plain step {1e3 * step:.1f} ms)" if commits else ""
    old = estimates if estimates is not None else (json.loads(out.read_text()).get("rates", {}) if out.is_file() else {})
    rates = {s: {"unit": work[s][0], "plain_steps_per_unit": r, "source": f"measured at {seconds[s][1][:7]}{where}"}
             for s, r in measured.items()}
    for s in rates:
        if is_training(s) and train_step:              # the compute-bound unit, where the run measured it
            rates[s]["train_steps_per_unit"] = seconds[s][0] / train_step / work[s][1]
    for s, r in old.items():
        if s not in rates and (commits or str(r.get("source", "")).startswith("estimated")):
            rates[s] = r
    source = {"commit": first.get("commit"), "cpu": first.get("cpu"), "cpu_flags": first.get("cpu_flags"),
              "plain_step_s": step, "plain_step_from": how, "weight_read_s": floor, "train_step_s": train_step,
              "params": str(params_file.resolve().relative_to(REPO_ROOT) if params_file.resolve().is_relative_to(REPO_ROOT)
                            else params_file)}
    if commits and out.is_file():                      # the file's own run stays the source of its other rows
        source = {**json.loads(out.read_text())["source"], "updated_from": {**source, "commits": commits}}
    record = {"source": source,
              "rates": {**{s: rates[s] for s in work if s in rates}, **{s: r for s, r in rates.items() if s not in work}}}
    write_json(out, record)
    return record


def main(argv: list[str]) -> None:
    if argv[:1] == ["--rates"]:
        args = [a for a in argv[1:] if not a.startswith("--commits=")]
        commits = [c for a in argv[1:] if a.startswith("--commits=") for c in a.split("=", 1)[1].split(",") if c]
        rec = write_rates(Path(args[0]) if args else REPO_ROOT / "params.yaml", commits=commits or None)
        print(f"{RATES_FILE}: {len(rec['rates'])} stages, from {rec['source']['commit']}")
        return
    print(preview(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
