"""python -m pipelines.cost [group=option ...]          (make cost [OVERRIDES="profile=smoke"])

What `make repro` will cost on this machine, before it starts, in under a minute: it composes conf/ with the
overrides as `make repro` would, measures this machine's plain step (a 1-token decoding step of the configured
model, the decoder's own, after a 300-token prefix) and weight-read floor (one pass over every weight), and prints
each stage with its unit of work, its amount for this config, its cost in plain steps and weight reads and its
projected minutes here, then the total against the budget (analysis/cost_model.py). The rates, in plain steps of
their machine per unit of work, come from a finished run: analysis/cost_rates.json, which names it.

    python -m pipelines.cost --rates [FILE]   # rewrite the rates file from the committed run (reports/metrics/,
                                              # params.yaml, the run's plain step); FILE: the params it ran with

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

from analysis.cost_model import (BUDGET_WEIGHT_READS, RATES_FILE, Plan, project, projection_table, rates_from_run,
                                 stage_work)
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
    from models.measure.latency import verify_latency_profile, weight_read_seconds
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
    return {"plain_step_s": step, "weight_read_s": floor["seconds"], "weight_bytes": floor["bytes"],
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
    rows = project(stage_work(plan_for(cfg)), rates["rates"], machine["plain_step_s"], machine["weight_read_s"])
    src = rates.get("source") or {}
    head = (f"`make repro` with overrides {overrides or '(none)'}: profile {cfg.profile.name}, model {cfg.model.name}."
            f"\nThis machine: plain step {1e3 * machine['plain_step_s']:.1f} ms, one read of every weight "
            f"{1e3 * machine['weight_read_s']:.1f} ms (a plain step is {machine['plain_step_s'] / machine['weight_read_s']:.2f} "
            f"weight reads). Rates: plain steps per unit of work in the run at {str(src.get('commit', '?'))[:12]} "
            f"on a {src.get('cpu', '?')} (plain step {1e3 * float(src.get('plain_step_s') or 0):.1f} ms).\n")
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


def run_plain_step(metrics_dir: Path) -> tuple[float, float | None, str]:
    """(plain step, weight read or None, where from) of the run whose metrics are in metrics_dir: calibrate_latency's
    own record when the run kept it, else one over the references stage's baseline decode rate."""
    lat = metrics_dir / "calibrate_latency.json"
    if lat.is_file():
        rec = json.loads(lat.read_text())
        return float(rec["baseline_step_s"]), (rec.get("weight_read") or {}).get("seconds"), "calibrate_latency"
    ref = json.loads((metrics_dir / "references.json").read_text())
    return 1.0 / float(ref["baseline_decode_tokens_per_s"]), None, "1 / the references baseline's decode tokens/s"


def write_rates(params_file: Path, metrics_dir: Path = REPO_ROOT / "reports" / "metrics",
                out: Path = RATES_FILE, estimates: dict | None = None) -> dict:
    """The rates file from the run whose stage metrics are in metrics_dir and whose config is params_file; the
    stages it lacks keep the estimates already in the file (each marked so)."""
    text = params_file.read_text()
    cfg = OmegaConf.create(yaml.safe_load(text))
    work = stage_work(plan_for(cfg))
    step, floor, how = run_plain_step(metrics_dir)
    seconds = run_seconds(metrics_dir)
    measured = rates_from_run({s: t for s, (t, _) in seconds.items()}, work, step)
    runs = [json.loads(p.read_text()).get("run") or {} for p in sorted(metrics_dir.glob("*.json"))]
    first = next((r for r in runs if r.get("commit")), {})
    old = estimates if estimates is not None else (json.loads(out.read_text()).get("rates", {}) if out.is_file() else {})
    rates = {s: {"unit": work[s][0], "plain_steps_per_unit": r, "source": f"measured at {seconds[s][1][:7]}"}
             for s, r in measured.items()}
    for s, r in old.items():
        if s not in rates and str(r.get("source", "")).startswith("estimated"):
            rates[s] = r
    record = {"source": {"commit": first.get("commit"), "cpu": first.get("cpu"), "cpu_flags": first.get("cpu_flags"),
                         "plain_step_s": step, "plain_step_from": how, "weight_read_s": floor,
                         "params": str(params_file)},
              "rates": {**{s: rates[s] for s in work if s in rates}, **{s: r for s, r in rates.items() if s not in work}}}
    write_json(out, record)
    return record


def main(argv: list[str]) -> None:
    if argv[:1] == ["--rates"]:
        rec = write_rates(Path(argv[1]) if len(argv) > 1 else REPO_ROOT / "params.yaml")
        print(f"{RATES_FILE}: {len(rec['rates'])} stages, from {rec['source']['commit']}")
        return
    print(preview(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
