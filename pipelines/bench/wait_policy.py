"""python -m pipelines.bench.wait_policy   (make bench-wait)   [heads=<a conf/heads option> +bench.rounds=3]

A benchmark, not a test: what OpenMP's wait policy costs a decoding step on a quiet machine, paired. In each of
`rounds` rounds every policy of `policies` runs in turn in a fresh process (libgomp reads its policy when torch
loads; the settings are those of pipelines/bench/load.py), decoding the first turns of `questions` MT-Bench
questions for `new_tokens` tokens, with the autoregressive baseline and with random heads of the `heads=` option on
sparse64's first `nodes` nodes. The ms per decoding step after the prefill of each (round, question) pair up across
policies: each policy over the first, pooled, with a bootstrap interval over the pairs (models.measure.intervals).
A policy that slows the baseline more than the tree step flatters the speedups by their ratio (`speedup_bias`).
Run it with the cores free: it measures the quiet machine; `make bench-load` measures a loaded one. Writes
reports/bench/wait_policy.json.
"""
from __future__ import annotations

from pipelines import omp  # noqa: F401,I001  (first: libgomp reads its policy when torch loads)
import os

from omegaconf import DictConfig, OmegaConf

from models.hardware import cpu_model, host_record
from models.measure.intervals import paired_comparison
from pipelines.bench.load import child_overrides, parse_setting, run_in_process
from pipelines.common import conf_option, load_model, log, run_record, stage, write_json

DEFAULTS = {"policies": ["default", "passive", "active"], "rounds": 3, "questions": 5, "new_tokens": 32,
            "nodes": 15, "child": None, "child_out": None}


def decode_all(cfg: DictConfig, settings: dict) -> dict:
    """In a policy's own process: {method: [ms per step, one per question]}."""
    import torch

    from models.engine.decoding import generate
    from models.engine.drafting import make_drafter
    from models.engine.fast_inference import prepare_heads_for_decoding
    from models.engine.path_choice import prepare_for_decoding
    from models.engine.trees import tree_from_config
    from models.measure.mtbench import chat_input_ids, load_questions
    from pipelines.bench.verify import same_size_fixed
    from pipelines.methods import random_heads

    model, tok = load_model(cfg)
    prepare_for_decoding(model)
    heads = random_heads(cfg, model, cfg.heads)
    prepare_heads_for_decoding(heads)
    tree = same_size_fixed(tree_from_config(conf_option("tree", "sparse64")), int(settings["nodes"]))
    drafters = {"baseline": None, f"{cfg.heads.name}/{tree.name}": make_drafter({"kind": "heads", "tree": tree},
                                                                                   heads=heads)}
    questions = load_questions(cfg.data.questions_file)[:int(settings["questions"])]
    ms = {name: [] for name in drafters}
    with torch.inference_mode():
        for q in questions:
            ids = chat_input_ids(tok, [q.turns[0]], [])
            for name, drafter in drafters.items():
                r = generate(model, tok, ids, drafter, max_new_tokens=int(settings["new_tokens"]), stop_token_ids=[])
                ms[name].append(1e3 * (r.wall_time - r.prefill_time) / r.steps)
    return {"question_ids": [q.question_id for q in questions], "ms_per_step": ms,
            "omp_wait": host_record("cpu")["omp_wait"], "chosen": omp.CHOSEN}


def run_policy(name: str, overrides: list[str]) -> dict:
    return run_in_process(parse_setting(name), overrides, module="pipelines.bench.wait_policy")


def compare(runs: list[dict], policies: list[str]) -> dict:
    """Each policy's ms per step over the first policy's, paired by (round, question), per method."""
    first, out = policies[0], {}
    for policy in policies[1:]:
        out[policy] = {}
        for method in runs[0]["results"][first]["ms_per_step"]:
            a, b = {}, {}
            for r, run in enumerate(runs):
                qids = run["results"][first]["question_ids"]
                a.update({(r, q): v for q, v in zip(qids, run["results"][policy]["ms_per_step"][method])})
                b.update({(r, q): v for q, v in zip(qids, run["results"][first]["ms_per_step"][method])})
            c = paired_comparison(a, b)
            out[policy][method] = {"ms_ratio": c["ratio"], "interval": c["interval"], "pairs": c["questions"]}
        base, tree = (out[policy][m]["ms_ratio"] for m in runs[0]["results"][first]["ms_per_step"])
        out[policy]["speedup_bias"] = base / tree           # > 1: the policy's speedups read higher than the first's
    return out


@stage
def main(cfg: DictConfig) -> None:
    settings = {**DEFAULTS, **OmegaConf.to_container(OmegaConf.select(cfg, "bench", default=OmegaConf.create({})))}
    if settings["child"]:
        write_json(settings["child_out"], decode_all(cfg, settings))
        return
    policies = list(settings["policies"])
    if len(policies) < 2 or int(settings["rounds"]) < 1:
        raise ValueError(f"bench.policies={policies}, bench.rounds={settings['rounds']}: need two policies or more "
                         "(each compared with the first) and one round or more")
    overrides, load = child_overrides(), list(os.getloadavg())
    runs = []
    for r in range(int(settings["rounds"])):
        runs.append({"round": r, "results": {p: run_policy(p, overrides) for p in policies}})
        log.info("round %d: %s", r, {p: {m: round(sum(v) / len(v), 1) for m, v in res["ms_per_step"].items()}
                                     for p, res in runs[-1]["results"].items()})
    comparison = compare(runs, policies)
    for policy, rows in comparison.items():
        for method, row in rows.items():
            if method != "speedup_bias":
                ci = row["interval"] and f" [{row['interval'][0]:.3f}, {row['interval'][1]:.3f}]"
                print(f"{policy} / {policies[0]}, {method}: ms per step x{row['ms_ratio']:.3f}{ci or ''} over "
                      f"{row['pairs']} pairs")
        print(f"{policy}: speedups read x{rows['speedup_bias']:.3f} of {policies[0]}'s")
    record = {"model": cfg.model.name, "machine": cpu_model(), "cpu_count": os.cpu_count(),
              "run": run_record(),
              "load_average_at_start": load, "settings": settings, "comparison": comparison, "runs": runs}
    path = write_json(f"{cfg.paths.reports}/bench/wait_policy.json", record)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
