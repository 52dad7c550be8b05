"""python -m pipelines.bench.load   (make bench-load)   [+bench.policies=[default,passive,spin10000@1] +bench.repeats=3]

A benchmark, not a test: how much slower decoding gets when other processes share the cores, per OpenMP setting.
For each setting of `policies`, a fresh process (libgomp reads OMP_WAIT_POLICY / GOMP_SPINCOUNT when torch is
imported, so a setting cannot change inside one) loads the base model (cfg.model) and decodes a ~520-token
chat-templated prompt for `new_tokens` tokens with each of `methods`, first on the machine as it is ("quiet"),
then while `competitors` run: stock torch processes doing matrix products with 1 or 2 threads each (OpenMP's
default spin, like another training or evaluation job), stopped afterwards.

  methods      `none` (the autoregressive baseline) or `<heads name>/<tree option>`: trained heads from
               results/heads/<name> when they exist, else random heads of that family (logged; their acceptance
               differs, their time per step is what matters, so both tokens/s and ms per step are reported). A
               calibrated tree file that does not exist yet (tree=optimal...) is replaced by sparse64's first 15
               nodes, a latency profile that does not exist (tree=cut...) by no cut, both logged.
  policies     settings, each `<wait>[@<threads>]`; wait: default (libgomp's own: spin ~300k iterations, then
               sleep), passive (OMP_WAIT_POLICY=PASSIVE: sleep at once), active (spin on), spin<N>
               (GOMP_SPINCOUNT=N), auto (what pipelines/omp.py sets for the decoding commands: PASSIVE
               when other threads are runnable as the process starts, else libgomp's own; or this shell's
               variables); threads: torch threads (default: `threads`, else torch's own).
  competitors  the competing processes' thread counts ([] = none); competitor_size: their square matrices.
  repeats, new_tokens, prompt_tokens; max_seconds: a decode that runs longer is cut there (its steps so far count).
Defaults (DEFAULTS): the baseline, hydra_pp/optimal_pld and medusa1/sparse64; libgomp's `default` against `auto`;
competitors of 2 and 1 threads; 2 repeats of 64 new tokens, cut at 30 s.

tokens/s and ms per step are the decode's, after the prefill (median over repeats); slowdown = quiet tokens/s /
loaded tokens/s. Prints one table and writes reports/bench/bench_load.json (settings, each setting's OpenMP
environment, threads, cpu count, load averages, every run).
"""
from __future__ import annotations

import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipelines import omp  # noqa: F401  (first: sets OpenMP's wait policy before torch loads)
from models.engine.trees import TreeOption, tree_option
from models.hardware import cpu_model, host_record
from pipelines.common import conf_option, REPO_ROOT, load_model, log, stage, write_json
from models.methods import load_for_decoding

DEFAULTS = {"methods": ["none", "hydra_pp/optimal_pld", "medusa1/sparse64"], "policies": ["default", "auto"],
            "competitors": [2, 1], "competitor_size": 512, "repeats": 2, "new_tokens": 64, "prompt_tokens": 520,
            "max_seconds": 30.0, "threads": None, "child": None, "child_out": None}
OMP_VARS = omp.OMP_VARS
WAITS = {"default": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "active": {"OMP_WAIT_POLICY": "ACTIVE"}}
FALLBACK_NODES = 15                     # the stand-in for a calibrated tree not made yet: sparse64's first nodes
# Real prose of a fixed length: stdlib docstrings do not change within a Python version.
PROMPT_SOURCES = ("argparse", "json", "subprocess")
INSTRUCTION = "Summarize the documentation below in a few sentences, then list its main functions.\n\n"
# A stock torch process multiplying matrices until it is stopped: argv = threads, size.
COMPETITOR = ("import sys, torch\n"
              "torch.set_num_threads(int(sys.argv[1])); n = int(sys.argv[2])\n"
              "a, b = torch.randn(n, n), torch.randn(n, n)\n"
              "print('ready', flush=True)\n"
              "while True:\n    a @ b\n")


def parse_setting(spec: str, threads: int | None = None) -> dict:
    """`passive@1` -> {"name", "wait", "threads", "env"}: env maps each of OMP_VARS and omp.SWITCH to its
    value, or None to remove it; `auto` changes nothing (the environment this benchmark was started in)."""
    wait, _, t = str(spec).partition("@")
    threads = int(t) if t else (None if threads is None else int(threads))
    if wait == "auto":
        env = {}
    elif wait in WAITS or (wait.startswith("spin") and wait[4:].isdigit()):
        env = {k: None for k in OMP_VARS} | {omp.SWITCH: "off"}
        env |= WAITS[wait] if wait in WAITS else {"GOMP_SPINCOUNT": wait[4:]}
    else:
        raise ValueError(f"bench.policies: {spec!r} is not <wait>[@<threads>] with wait one of default | passive | "
                         "active | spin<N> | auto")
    return {"name": str(spec), "wait": wait, "threads": threads, "env": env}


def setting_environ(setting: dict, environ) -> dict[str, str]:
    """The environment a setting's process runs in: `environ` with the setting's variables set or removed."""
    env = dict(environ)
    for k, v in setting["env"].items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def summarize(runs: list[dict]) -> dict:
    """Medians over a phase's runs (each from timed_decode), how many were cut at max_seconds, and the runs."""
    keys = ("tokens_per_second", "ms_per_step", "prefill_ms", "mean_accepted_length")
    return {**{k: statistics.median(r[k] for r in runs) for k in keys},
            "cut_short": sum(r["cut_short"] for r in runs), "runs": runs}


def slowdown(quiet: dict, loaded: dict) -> dict:
    """How many times slower the loaded phase was: in tokens/s and in ms per step."""
    return {"tokens_per_second": quiet["tokens_per_second"] / loaded["tokens_per_second"],
            "ms_per_step": loaded["ms_per_step"] / quiet["ms_per_step"]}


def long_prompt(tokenizer, n_tokens: int) -> list[int]:
    """A chat-templated request about a long document, cut to about n_tokens tokens in all."""
    from pipelines.generate import prompt_ids

    doc = "\n\n".join(inspect.getdoc(__import__(name)) for name in PROMPT_SOURCES)
    frame = len(prompt_ids(tokenizer, INSTRUCTION))
    body = tokenizer(doc, add_special_tokens=False)["input_ids"][:max(n_tokens - frame, 1)]
    return prompt_ids(tokenizer, INSTRUCTION + tokenizer.decode(body))


class TimeUp(Exception):
    """Raised from on_tokens when a decode has run past max_seconds."""


def timed_decode(model, ids, method: dict, new_tokens: int, max_seconds: float) -> dict:
    """One decode; its figures from the time each step's tokens came out (on_tokens), so that a decode cut at
    max_seconds still counts the steps it made. The first emission is the prefill's token."""
    from models.engine.decoding import generate

    marks: list[tuple[float, int]] = []

    def on_tokens(tokens, from_draft):
        marks.append((time.perf_counter(), len(tokens)))
        if marks[-1][0] - marks[0][0] > max_seconds:
            raise TimeUp

    drafter = method["make_drafter"]() if method.get("make_drafter") else None      # fresh: drafters keep state
    t0 = time.perf_counter()
    try:
        res = generate(model, None, ids, drafter, max_new_tokens=new_tokens, stop_token_ids=[], on_tokens=on_tokens)
    except TimeUp:
        res = None
    steps = len(marks) - 1
    decode_s = marks[-1][0] - marks[0][0]
    tokens = sum(n for _, n in marks[1:])
    run = {"prefill_ms": 1e3 * (marks[0][0] - t0), "steps": steps, "tokens": tokens, "decode_s": decode_s,
           "tokens_per_second": tokens / decode_s if decode_s > 0 else 0.0,
           "ms_per_step": 1e3 * decode_s / steps if steps else 0.0,
           "mean_accepted_length": tokens / steps if steps else 0.0, "cut_short": res is None}
    if res is not None and res.steps:
        run["per_step_ms"] = {k: 1e3 * v / res.steps for k, v in res.timings.items()}
    return run


def stand_in(option: TreeOption) -> TreeOption:
    """The option with a calibrated tree file that is not there yet replaced by its `stand_in` tree option, else by
    sparse64's first nodes, and a latency profile that is not there yet dropped (no cut)."""
    if option.kind == "file" and not Path(option.file).is_file() and option.stand_in:
        log.warning("no calibrated tree %s yet: timing tree=%s in its place", option.file, option.stand_in)
        return replace(tree_option(OmegaConf.to_container(conf_option("tree", option.stand_in))),
                       lookup=option.lookup)
    if option.kind == "file" and not Path(option.file).is_file():
        log.warning("no calibrated tree %s yet: timing sparse64's first %d nodes in its place", option.file,
                    FALLBACK_NODES)
        sparse = tree_option(OmegaConf.to_container(conf_option("tree", "sparse64")))
        option = replace(option, kind="paths", file=None, paths=sparse.paths[:FALLBACK_NODES])
    if option.cut_by_cost and not Path(option.cut_by_cost).is_file():
        log.warning("no latency profile %s yet: the tree is not cut per step", option.cut_by_cost)
        option = replace(option, cut_by_cost=None)
    return option


def build_methods(cfg: DictConfig, model, specs: list[str]) -> list[dict]:
    """{"name", "model", "make_drafter", "random_heads", "tree_nodes"} per spec, models prepared for decoding."""
    from models.engine.fast_inference import prepare_heads_for_decoding
    from models.engine.path_choice import prepare_for_decoding
    from models.engine.drafting import make_drafter
    from pipelines.methods import heads_spec, random_heads, tree_config, with_costs

    prepare_for_decoding(model)
    methods = []
    for spec in specs:
        if spec == "none":
            methods.append({"name": "baseline", "model": model})
            continue
        name, _, tree_name = str(spec).partition("/")
        if not tree_name:
            raise ValueError(f"bench.methods: {spec!r} is not `none` or <heads name>/<tree option>")
        folder = Path(cfg.paths.results) / "heads" / name
        base = model
        if folder.is_dir():
            base, heads, _ = load_for_decoding(folder, model, keep_base=True)   # a merged LoRA: on a copy
            untrained = False
        else:
            h = conf_option("heads", name)
            heads = random_heads(cfg, model, h)
            log.warning("no trained heads in %s: timing random %s heads (their acceptance differs from trained ones; "
                        "compare the ms per step)", folder, h.family)
            untrained = True
            prepare_heads_for_decoding(heads)
        option = with_costs(cfg, stand_in(tree_option(tree_config(cfg, tree_name, name), tree_name)))
        option.tree.check_heads(heads.config.num_heads)
        methods.append({"name": f"{name}/{tree_name}", "model": base,
                        "make_drafter": lambda spec=heads_spec(cfg, option), heads=heads: make_drafter(spec, heads=heads),
                        "random_heads": untrained, "tree_nodes": option.tree.num_nodes})
    return methods


@contextmanager
def competing(threads: list[int], size: int):
    """Start one stock torch process per entry of `threads` (OpenMP's own defaults: none of OMP_VARS, whatever this
    process was started with), wait until each multiplies, stop them all on exit."""
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARS}
    procs = [subprocess.Popen([sys.executable, "-c", COMPETITOR, str(t), str(size)], env=env,
                              stdout=subprocess.PIPE, text=True) for t in threads]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"competitor {p.pid} did not start (exit code {p.poll()})")
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def omp_runtime() -> str:
    """Which OpenMP library this process loaded (libgomp reads OMP_WAIT_POLICY/GOMP_SPINCOUNT, libiomp5 KMP_*)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    found = sorted({lib for lib in ("libgomp", "libiomp5", "libomp") if f"/{lib}" in maps})
    return ",".join(found) or "none"


def run_setting(cfg: DictConfig, settings: dict) -> dict:
    """In a setting's own process: every method quiet, then under the competitors."""
    import torch

    setting = parse_setting(settings["child"], settings["threads"])
    if setting["threads"]:
        torch.set_num_threads(setting["threads"])
    model, tok = load_model(cfg)
    methods = build_methods(cfg, model, list(settings["methods"]))
    ids = long_prompt(tok, int(settings["prompt_tokens"]))
    n, cap = int(settings["new_tokens"]), float(settings["max_seconds"])
    info = {"setting": setting["name"], "threads": torch.get_num_threads(), "omp_runtime": omp_runtime(),
            "environment": {k: os.environ.get(k) for k in (*OMP_VARS, "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                                            omp.SWITCH)},
            "prompt_tokens": len(ids), "cpu_count": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}
    log.info("setting %s: %d torch threads, %s, %s", setting["name"], info["threads"], info["omp_runtime"],
             {k: v for k, v in info["environment"].items() if v is not None})
    for m in methods:                                                # warm up: first calls pack and allocate
        timed_decode(m["model"], ids[:64], m, 8, cap)
    phases = {}
    for phase in ("quiet", "loaded"):
        runs = {m["name"]: [] for m in methods}
        with competing(list(settings["competitors"]) if phase == "loaded" else [], int(settings["competitor_size"])):
            load = [os.getloadavg()[0]]
            for _ in range(int(settings["repeats"])):               # methods interleaved: drift hits all alike
                for m in methods:
                    runs[m["name"]].append(timed_decode(m["model"], ids, m, n, cap))
                    r = runs[m["name"]][-1]
                    log.info("%s %s %s: %.1f tokens/s, %.1f ms/step%s", setting["name"], phase, m["name"],
                             r["tokens_per_second"], r["ms_per_step"], " (cut short)" if r["cut_short"] else "")
            load.append(os.getloadavg()[0])
        phases[phase] = {"load_average": load, "methods": {k: summarize(v) for k, v in runs.items()}}
    rows = []
    for m in methods:
        q, ld = phases["quiet"]["methods"][m["name"]], phases["loaded"]["methods"][m["name"]]
        rows.append({"method": m["name"], "random_heads": m.get("random_heads", False),
                     "tree_nodes": m.get("tree_nodes"), "quiet": q, "loaded": ld, "slowdown": slowdown(q, ld)})
    return {**info, "load_average": {p: v["load_average"] for p, v in phases.items()}, "rows": rows}


def child_overrides() -> list[str]:
    """This run's command-line overrides, less bench.child*, for the settings' processes."""
    from hydra.core.hydra_config import HydraConfig

    return [o for o in HydraConfig.get().overrides.task if not o.lstrip("+~").startswith("bench.child")]


def run_in_process(setting: dict, overrides: list[str], module: str = "pipelines.bench.load") -> dict:
    """A benchmark's child (run_setting here) in a fresh `python -m <module>` with the setting's environment: what
    it wrote to +bench.child_out."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "setting.json"
        cmd = [sys.executable, "-m", module, *overrides, f"+bench.child={setting['name']}",
               f"+bench.child_out={out}"]
        code = subprocess.run(cmd, env=setting_environ(setting, os.environ), cwd=REPO_ROOT).returncode
        if code:
            raise RuntimeError(f"setting {setting['name']!r} failed (exit code {code}): its log is above")
        return json.loads(out.read_text())


def print_table(results: list[dict], settings: dict) -> None:
    print(f"\ndecoding under load: {settings['new_tokens']} new tokens after a {results[0]['prompt_tokens']}-token "
          f"prompt, median of {settings['repeats']}; loaded = with competitors of {settings['competitors']} threads "
          f"({results[0]['cpu_count']} cpus)")
    print(f"{'setting':>12} {'thr':>3} {'method':>28} {'quiet tok/s':>11} {'loaded tok/s':>12} {'slowdown':>8} "
          f"{'ms/step quiet':>13} {'ms/step loaded':>14}")
    for res in results:
        for r in res["rows"]:
            q, ld = r["quiet"], r["loaded"]
            name = r["method"] + (" (rnd)" if r["random_heads"] else "")
            cut = "*" if ld["cut_short"] else ""
            print(f"{res['setting']:>12} {res['threads']:>3} {name:>28} {q['tokens_per_second']:>11.1f} "
                  f"{ld['tokens_per_second']:>11.1f}{cut:1} {r['slowdown']['tokens_per_second']:>7.1f}x "
                  f"{q['ms_per_step']:>13.1f} {ld['ms_per_step']:>14.1f}")
    print("(rnd): random heads; *: a loaded decode was cut at max_seconds (its steps so far count)")
    for res in results:                                  # how quiet "quiet" was
        la = res["load_average"]
        print(f"{res['setting']}: 1-min load average {la['quiet'][0]:.1f} -> {la['quiet'][1]:.1f} quiet, "
              f"{la['loaded'][0]:.1f} -> {la['loaded'][1]:.1f} loaded")
    if len(results) > 1:                                 # does a setting cost speed on the quiet machine?
        ref = {r["method"]: r["quiet"]["tokens_per_second"] for r in results[0]["rows"]}
        for res in results[1:]:
            rel = ", ".join(f"{r['method']} {r['quiet']['tokens_per_second'] / ref[r['method']]:.2f}x"
                            for r in res["rows"] if r["method"] in ref)
            print(f"quiet tokens/s of {res['setting']} vs {results[0]['setting']}: {rel}")


@stage
def main(cfg: DictConfig) -> None:
    settings = {**DEFAULTS, **OmegaConf.to_container(OmegaConf.select(cfg, "bench", default=OmegaConf.create({})))}
    if settings["child"]:
        write_json(settings["child_out"], run_setting(cfg, settings))
        return
    if int(settings["new_tokens"]) < 2 or int(settings["repeats"]) < 1:
        raise ValueError("bench.new_tokens must be >= 2 (the first comes from the prefill) and bench.repeats >= 1")
    setups = [parse_setting(p, settings["threads"]) for p in settings["policies"]]
    overrides, load = child_overrides(), list(os.getloadavg())
    log.info("%s on %s, %d cpus, load average %.1f; settings %s", cfg.model.name,
             cpu_model(), os.cpu_count(), load[0],
             [s["name"] for s in setups])
    results = [run_in_process(s, overrides) for s in setups]
    print_table(results, settings)
    record = {"model": cfg.model.name, "machine": cpu_model(),
              "cpu_count": os.cpu_count(), "load_average_at_start": load,
              "pipelines_omp_policy": {"busy": omp.OMP_POLICY, "chosen_here": omp.CHOSEN}, "settings": settings,
              "results": results,
              "host": host_record("cpu")}         # CPU processes: the GPU host settings do not apply
    path = write_json(f"{cfg.paths.reports}/bench/bench_load.json", record)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
