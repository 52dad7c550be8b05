"""python -m pipelines.bench.batch     (make bench-batch)     [+bench_batch.sizes=[1,2,4,8] +bench_batch.questions=16
                                                              heads=hydra +bench_batch.tree=chain4 model=...]

A benchmark, not a test: batched decoding's throughput on this machine (models/engine/batch.py). The first
`questions` MT-Bench first turns (chat-templated), `new_tokens` new tokens each, are decoded in batches of B for
each B of `sizes`, by the autoregressive baseline and, with heads=<h> (fresh random heads: their acceptance is not
the point, their cost is), by that drafter on `tree`; each batch once untimed first. Throughput: all new tokens
over all wall time (the prefills included). Prints tokens/s against B with the ratio to B = 1, and checks what the
batch promises: the baseline at B = 8 at least 3x its B = 1 throughput (the target; not asserted, reported).
Writes reports/bench/bench_batch.json.
"""
from __future__ import annotations

from pipelines import omp  # noqa: F401,I001  (first: OpenMP's wait policy is read when torch loads)
import json
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from models.engine.batch import generate_batch
from models.engine.drafting import make_drafter
from models.engine.fast_inference import prepare_heads_for_decoding
from models.engine.path_choice import prepare_for_decoding
from models.engine.trees import tree_from_config
from models.hardware import host_record
from pipelines.common import conf_option, load_model, log, stage, write_json
from pipelines.generate import prompt_ids
from pipelines.host import apply_host
from pipelines.methods import random_heads

DEFAULTS = {"sizes": [1, 2, 4, 8], "questions": 16, "new_tokens": 64, "threads": None, "tree": "chain4",
            "out": "reports/bench/bench_batch.json"}


def questions(cfg: DictConfig, tok, n: int) -> list[list[int]]:
    path = Path(cfg.data.questions_file)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the MT-Bench questions (`dvc repro assets` fetches them)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [prompt_ids(tok, r["turns"][0]) for r in rows[:n]]


def throughput(model, prompts, new_drafter, size: int, new_tokens: int) -> dict:
    """All new tokens over all wall time, decoding the prompts in consecutive batches of `size`."""
    tokens, wall = 0, 0.0
    for i in range(0, len(prompts), size):
        chunk = prompts[i:i + size]
        drafters = [new_drafter() for _ in chunk] if new_drafter else None
        t0 = time.perf_counter()
        res = generate_batch(model, None, chunk, drafters, max_new_tokens=new_tokens, stop_token_ids=[])
        wall += time.perf_counter() - t0
        tokens += sum(len(r.new_tokens) for r in res)
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}


@stage
def main(cfg: DictConfig) -> None:
    s = {**DEFAULTS, **OmegaConf.to_container(OmegaConf.select(cfg, "bench_batch", default=OmegaConf.create({})))}
    if s["threads"]:
        torch.set_num_threads(int(s["threads"]))
    model, tok = load_model(cfg)
    host = apply_host(cfg, str(next(model.parameters()).device))
    prepare_for_decoding(model)
    prompts = questions(cfg, tok, int(s["questions"]))
    methods = {"baseline": None}
    if cfg.heads.family != "none":
        heads = random_heads(cfg, model, cfg.heads)
        prepare_heads_for_decoding(heads)
        tree = tree_from_config(OmegaConf.to_container(conf_option("tree", s["tree"])))
        methods[f"{cfg.heads.name}-{s['tree']}"] = lambda: make_drafter({"kind": "heads", "tree": tree}, heads=heads)
    rows = {}
    for name, new_drafter in methods.items():
        rows[name] = {}
        for size in s["sizes"]:
            throughput(model, prompts[:size], new_drafter, size, 8)                  # warm-up
            rows[name][size] = throughput(model, prompts, new_drafter, size, int(s["new_tokens"]))
            log.info("%s B=%d: %.1f tokens/s", name, size, rows[name][size]["tokens_per_s"])
    print(f"\nthroughput against batch size ({cfg.model.name}, {len(prompts)} questions x {s['new_tokens']} tokens, "
          f"{torch.get_num_threads()} threads)")
    print(f"{'method':<24}" + "".join(f"{'B=' + str(b):>16}" for b in s["sizes"]))
    for name, row in rows.items():
        one = row[s["sizes"][0]]["tokens_per_s"]
        print(f"{name:<24}" + "".join(f"{r['tokens_per_s']:>8.1f} ({r['tokens_per_s'] / one:4.2f}x)"
                                      for r in row.values()))
    base = rows["baseline"]
    target = None
    if 1 in base and 8 in base:
        target = base[8]["tokens_per_s"] / base[1]["tokens_per_s"]
        print(f"baseline B=8 over B=1: {target:.2f}x (target: at least 3x)")
    write_json(s["out"], {"model": cfg.model.name, "settings": s, "host": host_record(str(next(model.parameters()).device)),
                          "apply_host": host, "rows": rows, "baseline_b8_over_b1": target})


if __name__ == "__main__":
    main()
