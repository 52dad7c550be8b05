"""python -m pipelines.bench.cut heads=hydra [+cut.tree=cut]        (make bench-cut HEADS="hydra hydra_pp")

A benchmark, not a stage: how much could cutting the draft tree per step gain on MT-Bench, for trained heads?
Decodes the evaluation's questions (profile.eval: first turns, max_new_tokens) greedily with the heads on the
whole tree `cut.tree` (default: tree=cut's calibrated 16-node tree, never cut), records per step the heads'
probability of every node and whether the base model accepted it (models/measure/cut_replay.py), checks the
answers against the baseline's, then replays the policies on this machine's latency profile
(results/calibrate/latency.json): fixed k-node trees, the heads' own cut (tree=cut), the cut with
recalibrated probabilities, and the oracle. Needs `dvc repro calibrate` first (heads, trees, latency).
Prints the table and writes reports/bench/cut_replay_<heads>.json.
"""
from __future__ import annotations

from pipelines import omp  # noqa: F401,I001  (first: OpenMP's wait policy is read when torch loads)
from dataclasses import replace
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from models.engine.decoding import generate
from models.engine.drafting import TreeDrafter
from models.shared import ADAPTER_DIR
from models.measure.mtbench import chat_input_ids, load_questions
from models.measure.cut_replay import RecordingDrafter, replay_policies
from models.methods import load_for_decoding
from pipelines.common import load_model, log, stage, stop_token_ids, write_json
from pipelines.methods import resolve_tree, step_cost_for, tree_config


@stage
def main(cfg: DictConfig) -> None:
    tree_name = str(OmegaConf.select(cfg, "cut.tree", default="cut"))
    name = str(cfg.heads.name)
    folder = Path(cfg.paths.results) / "heads" / name
    latency = Path(cfg.paths.results) / "calibrate" / "latency.json"
    if not latency.is_file():
        raise FileNotFoundError(f"{latency} does not exist: run `dvc repro calibrate_latency` first")
    if (folder / ADAPTER_DIR).exists():        # its greedy reference is another model: not this replay's premise
        raise ValueError(f"heads {name!r} change the backbone (LoRA): replay the frozen-backbone families only")
    model, tok = load_model(cfg)
    model, heads, _ = load_for_decoding(folder, model)
    option = resolve_tree(cfg, tree_config(cfg, tree_name, name), tree_name)
    if option.lookup:
        raise ValueError(f"cut.tree={tree_name!r} merges prompt lookup; use a heads-only tree (cut, optimal, ...)")
    tree = option.tree
    step_cost = step_cost_for(replace(option, cut_by_cost=str(latency)))    # the costs tree=cut is cut with

    questions = load_questions(cfg.data.questions_file, cfg.profile.eval.num_questions)
    stops, max_new = stop_token_ids(model, tok), int(cfg.profile.eval.max_new_tokens)
    steps = []
    for q in tqdm(questions, desc=f"{name} on {tree_name} ({tree.num_nodes} nodes)", unit="question"):
        ids = chat_input_ids(tok, [q.turns[0]], [])
        rec = RecordingDrafter(TreeDrafter(heads, tree, want_probs=True), group=q.question_id)
        res = generate(model, tok, ids, rec, max_new_tokens=max_new, stop_token_ids=stops)
        ref = generate(model, tok, ids, max_new_tokens=max_new, stop_token_ids=stops)
        if res.new_tokens != ref.new_tokens:
            raise RuntimeError(f"question {q.question_id}: the recorded greedy answer differs from the baseline's")
        steps += rec.steps

    table = replay_policies(steps, step_cost)
    print(f"\n{name}, tree {tree_name} ({tree.num_nodes} nodes), {len(questions)} MT-Bench first turns, "
          f"{len(steps)} steps; speed = tokens / verify cost over the baseline's, before drafting")
    print(f"{'policy':>13} {'nodes/step':>11} {'tokens/step':>12} {'speed':>7}")
    for policy, r in table.items():
        print(f"{policy:>13} {r.mean_nodes:>11.2f} {r.tokens_per_step:>12.3f} {r.relative_speed:>6.3f}x")
    record = {"heads": name, "tree": tree_name, "tree_nodes": tree.num_nodes, "questions": len(questions),
              "max_new_tokens": max_new, "steps": len(steps), "step_cost": step_cost,
              "policies": {k: vars(v) for k, v in table.items()}}
    path = write_json(Path(cfg.paths.reports) / "bench" / f"cut_replay_{name}.json", record)
    log.info("wrote %s", path)


if __name__ == "__main__":
    main()
