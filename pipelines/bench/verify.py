"""python -m pipelines.bench.verify        (make bench)    [+bench.repeats=9 +bench.threads=2 model=...]

A benchmark, not a test: on this machine, for the configured base model (SmolLM2 by default),
  1) the verify step with n tree tokens (n = 1, 4, 8, 16, 32, 64) relative to a 1-token step
     (median of repeats after a ~300-token prefix; models.measure.latency.verify_latency_profile), for the
     model as transformers loads it ("stock") and as the decoders run it (models.engine.fast_inference:
     prepacked linears, grouped-query attention without copying the cache); the targets:
     4 tokens <= 1.20x and 8 tokens <= 1.35x of a 1-token step;
  2) drafting + bookkeeping (acceptance rule, KV pruning, drafter state) per decoding step as a
     share of the verify step (forward + LM head), per head family of `pipeline_heads` (Medusa, Hydra,
     Hydra++, EAGLE, the draft model of `sps`; rows per family, named by its first head config) on the
     fixed sparse64 tree and the trees grown per step (eagle2: the authors' 59 nodes, eagle2_cpu: 12; draft
     heads stop at their number of levels) with freshly initialised heads on the profile's draft vocabulary (their quality does not
     matter for timing; the draft model starts as copies of base layers, EAGLE's layer as random weights); beside
     each grown tree, a fixed tree of as many verified tokens (sparse64's first nodes, `fixed<n>`), and the grown
     step (draft + verify + accept + commit) over that fixed tree's (`grown_over_fixed`).
Prints both tables and writes reports/bench/bench_verify.json.
"""
from __future__ import annotations

from pipelines import omp  # noqa: F401,I001  (first: OpenMP's wait policy is read when torch loads)
import os
import statistics

import torch
from omegaconf import DictConfig, OmegaConf

from models.engine.decoding import SamplingConfig, generate
from models.engine.drafting import make_drafter
from models.engine.fast_inference import prepare_heads_for_decoding
from models.engine.path_choice import prepare_for_decoding
from models.measure.latency import verify_latency_profile
from models.engine.trees import GrownTree, TreeSpec, tree_from_config
from models.hardware import cpu_model
from pipelines.methods import random_heads
from pipelines.common import conf_option, load_model, log, stage, write_json
from pipelines.host import apply_host, static_step

DEFAULTS = {"sizes": [1, 2, 4, 8, 16, 32, 64], "profile": False, "repeats": 7, "prefix_len": 300, "new_tokens": 48, "threads": None,
            "tree": None, "trees": ["sparse64", "eagle2_cpu", "eagle2"]}   # tree=X: that tree alone


def bench_trees(settings) -> dict:
    """{name: tree} of the trees timed: the fixed ones and the grown ones (EAGLE-2's, and it sized for a CPU), each
    grown one followed by a fixed tree of as many verified tokens."""
    names = [settings["tree"]] if settings["tree"] else list(settings["trees"])
    return with_fixed_twins({name: tree_from_config(conf_option("tree", name)) for name in names})


def with_fixed_twins(trees: dict) -> dict:
    """The trees, each grown one followed by a fixed tree of as many verified tokens (sparse64's first nodes)."""
    out = {}
    for name, tree in trees.items():
        out[name] = tree
        if isinstance(tree, GrownTree):
            twin = same_size_fixed(tree_from_config(conf_option("tree", "sparse64")), tree.nodes)
            out[twin.name] = twin
    return out


def same_size_fixed(spec: TreeSpec, nodes: int) -> TreeSpec:
    """The first `nodes` paths of `spec` whose parents come before them: a fixed tree of nodes drafts."""
    kept: list[tuple[int, ...]] = []
    for path in spec.paths:
        if len(kept) < nodes and (len(path) == 1 or tuple(path[:-1]) in kept):
            kept.append(tuple(path))
    return TreeSpec(f"fixed{len(kept)}", tuple(kept), spec.top_k)


def step_ms(row: dict) -> float:
    return row["draft_ms"] + row["verify_ms"] + row["accept_ms"] + row["commit_ms"]


def overhead_per_family(cfg, model, settings, static: bool = False) -> list[dict]:
    trees = bench_trees(settings)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(model.config.vocab_size, (settings["prefix_len"],), generator=g).tolist()
    rows = []
    base = generate(model, None, prompt, max_new_tokens=settings["new_tokens"], stop_token_ids=[], static=static)
    rows.append({"family": "baseline", "tokens_per_second": base.tokens_per_second,
                 "verify_ms": 1e3 * base.timings["verify"] / base.steps})
    seen = set()
    for conf_name in cfg.pipeline_heads:                                # one row per family: its first head config
        h = conf_option("heads", conf_name)
        family, layers = str(h.family), int(h.num_layers)
        if family in seen:
            continue
        seen.add(family)
        heads = random_heads(cfg, model, h)                             # the profile's draft vocabulary and sharing
        prepare_heads_for_decoding(heads)                               # as the decoders run them
        grown = None
        for tree_name, tree in trees.items():
            row = time_drafter(model, prompt, make_drafter({"kind": "heads", "tree": tree}, heads=heads), settings,
                               static)
            rows.append({"family": family, "heads": conf_name, "heads_layers": layers, "tree": tree_name,
                         "tree_nodes": tree.num_nodes, **row})
            if isinstance(tree, GrownTree):
                grown = rows[-1]
            elif grown is not None and tree.num_nodes == grown["tree_nodes"]:   # the grown tree's fixed twin
                grown["grown_over_fixed"] = step_ms(grown) / step_ms(rows[-1])
                grown = None
    return rows


def time_drafter(model, prompt: list[int], drafter, settings, static: bool = False) -> dict:
    """Milliseconds per decoding step of each part, and drafting + bookkeeping as a share of the verify step."""
    generate(model, None, prompt[:32], drafter, max_new_tokens=4, stop_token_ids=[], static=static)   # warm up
    res = generate(model, None, prompt, drafter, sampling=SamplingConfig(), max_new_tokens=settings["new_tokens"],
                   stop_token_ids=[], static=static)
    per_step = {k: 1e3 * v / res.steps for k, v in res.timings.items()}
    overhead = per_step["draft"] + per_step["accept"] + per_step["commit"]
    return {"steps": res.steps, "mean_accepted_length": res.mean_accepted_length,
            "tokens_per_second": res.tokens_per_second, **{f"{k}_ms": v for k, v in per_step.items()},
            "overhead_share": overhead / per_step["verify"]}


@torch.inference_mode()
def op_profile(model, n: int, prefix_len: int, steps: int = 5) -> str:
    """Top operators (self CPU time) of `steps` verify steps of n tokens after a prefix_len-token cache."""
    from torch.profiler import ProfilerActivity, profile

    from models.engine.acceptance import SamplingConfig
    from models.engine.decoding import prefill, time_step
    from models.engine.drafting import FixedDrafter

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(model.config.vocab_size, (1, prefix_len), generator=g)
    state = prefill(model, ids, SamplingConfig())
    drafter = FixedDrafter(torch.randint(model.config.vocab_size, (n - 1,), generator=g))

    def step():                                   # the decoder's own step, rewound (models.engine.decoding.time_step)
        time_step(state, drafter, n, repeats=1, warmup=0)
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)


@stage
def main(cfg: DictConfig) -> None:
    settings = {**DEFAULTS, **OmegaConf.to_container(OmegaConf.select(cfg, "bench", default=OmegaConf.create({})))}
    if settings["threads"]:
        torch.set_num_threads(int(settings["threads"]))
    model, _ = load_model(cfg)
    host = apply_host(cfg, str(next(model.parameters()).device))   # on a CPU: nothing changes, recorded as such
    static = static_step(cfg, next(model.parameters()).device)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    log.info("%s on %s, %d torch threads, load average %.1f", cfg.model.name, cpu_model(),
             torch.get_num_threads(), load)

    stock = verify_latency_profile(model, settings["sizes"], settings["repeats"], settings["prefix_len"],
                                   static=static)
    prepared = prepare_for_decoding(model)
    prof = verify_latency_profile(model, settings["sizes"], settings["repeats"], settings["prefix_len"],
                                  static=static)
    print(f"\n1) verify step vs tree tokens ({cfg.model.name}, prefix {settings['prefix_len']}, "
          f"median of {settings['repeats']}, {torch.get_num_threads()} threads); decoding runs the prepared model "
          f"({prepared['packed_linears']} packed linears, attention {prepared['attention']})")
    print(f"{'n':>4} {'stock ms':>9} {'x 1-token':>10} {'prepared ms':>12} {'x 1-token':>10} {'fwd only x':>11}")
    for i, n in enumerate(prof["sizes"]):
        print(f"{n:>4} {1e3 * stock['forward_lm_head_s'][i]:>9.1f} {stock['relative'][i]:>10.2f} "
              f"{1e3 * prof['forward_lm_head_s'][i]:>12.1f} {prof['relative'][i]:>10.2f} {prof['relative_forward'][i]:>11.2f}")

    if settings["profile"]:
        for n in (1, 8):
            print(f"\ntorch.profiler, verify step of {n} token(s) + LM head, 5 steps, prepared model")
            print(op_profile(model, n, settings["prefix_len"]))

    rows = overhead_per_family(cfg, model, settings, static)
    print(f"\n2) per decoding step, {settings['new_tokens']} new tokens, random heads (grown trees: eagle2*)")
    print(f"{'heads':>22} {'tree':>11} {'draft ms':>9} {'verify ms':>10} {'accept ms':>10} {'commit ms':>10} {'overhead':>9} "
          f"{'tok/s':>7} {'grown/fixed step':>17}")
    for r in rows:
        if r["family"] == "baseline":
            print(f"{'baseline':>22} {'':>11} {'':>9} {r['verify_ms']:>10.1f} {'':>10} {'':>10} {'':>9} {r['tokens_per_second']:>7.1f}")
            continue
        name = f"{r['heads']} ({r['family']})"
        print(f"{name:>22} {r['tree']:>11} {r['draft_ms']:>9.2f} {r['verify_ms']:>10.1f} {r['accept_ms']:>10.2f} "
              f"{r['commit_ms']:>10.2f} {100 * r['overhead_share']:>8.1f}% {r['tokens_per_second']:>7.1f}"
              + (f" {r['grown_over_fixed']:>17.2f}" if "grown_over_fixed" in r else ""))
    record = {"model": cfg.model.name, "threads": torch.get_num_threads(), "load_average": load, "host": host,
              "machine": cpu_model(), "settings": settings, "verify_profile": prof,
              "verify_profile_stock": stock, "prepared": prepared,
              "overhead": rows, "median_overhead_share": statistics.median(
                  r["overhead_share"] for r in rows if "overhead_share" in r)}
    path = write_json(f"{cfg.paths.reports}/bench/bench_verify.json", record)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
