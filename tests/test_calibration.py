"""Tree calibration: greedy trees, accepted-length predictions, rank measurement, tree choice."""
import numpy as np
import pytest
import torch

from models.engine.drafting import heads_drafter
from models.base import build_tiny_model
from models.measure.latency import interpolate_cost
from models.measure.calibration import (accuracy_table, choose_budget, empirical_accept_length, greedy_continuations,
                                greedy_tree, predicted_accept_length, predicted_tokens_per_s,
                                replay_accept_length, replay_steps, sequence_ranks, simulate_accept_length,
                                top1_unconditional)
from models.shared import HeadsConfig
from models.methods import build_heads
from pipelines.common import REPO_ROOT

SPARSE64_HEAD = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0],
                 [0, 5], [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2],
                 [3, 0], [0, 9], [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1],
                 [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1]]


def decreasing_table(depth=4, top_k=10, seed=0):
    """A plausible acc table: each row decreasing in rank, summing to less than 1."""
    rng = np.random.default_rng(seed)
    rows = []
    for d in range(depth):
        w = np.sort(rng.dirichlet(np.ones(top_k + 1) * 0.5))[::-1]
        rows.append(w[:top_k] * (0.9 - 0.1 * d) / w[:top_k].sum())
    return np.array(rows)


# -- greedy construction -----------------------------------------------------------------------

def test_greedy_tree_is_a_chain_when_rank0_dominates():
    acc = np.array([[0.9, 0.05, 0.01], [0.8, 0.05, 0.01], [0.7, 0.05, 0.01], [0.6, 0.05, 0.01]])
    assert greedy_tree(acc, 4) == [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]
    # chain scores .9 .72 .504 .3024 > every sibling (<= .05): the 5th node is the best sibling, (1,)
    assert greedy_tree(acc, 5)[-1] == (1,)


def test_greedy_tree_branches_by_hand_computed_scores():
    acc = np.array([[0.5, 0.3, 0.1], [0.4, 0.25, 0.1]])
    # scores: (0,) .5, (1,) .3, (0,0) .2, (0,1) .125, (1,0) .12, (2,) .1, (1,1) .075, (0,2) .05, ...
    assert greedy_tree(acc, 6) == [(0,), (1,), (0, 0), (0, 1), (1, 0), (2,)]
    assert predicted_accept_length(acc, greedy_tree(acc, 6)) == pytest.approx(1 + .5 + .3 + .2 + .125 + .12 + .1)
    # all 3 + 9 nodes fit in a budget of 20: the construction stops when the frontier is empty
    assert len(greedy_tree(acc, 20)) == 12


def test_greedy_trees_are_nested_closed_and_optimal_per_size():
    acc = decreasing_table()
    big = greedy_tree(acc, 128)
    for n in (4, 8, 16, 32, 64):
        tree = greedy_tree(acc, n)
        assert tree == big[:n]
        present = set(tree)
        for p in tree:   # parent and previous sibling present: a valid rank tree
            assert len(p) == 1 or p[:-1] in present
            assert p[-1] == 0 or p[:-1] + (p[-1] - 1,) in present
    # no swap of a tree node for an outside candidate raises the predicted length
    tree = greedy_tree(acc, 16)
    worst = min(np.prod([acc[j, r] for j, r in enumerate(p)]) for p in tree)
    assert all(np.prod([acc[j, r] for j, r in enumerate(p)]) <= worst + 1e-12 for p in big[16:])


# -- accepted-length predictions ---------------------------------------------------------------

@pytest.mark.parametrize("paths_kind", ["greedy", "sparse"])
def test_predicted_accept_length_matches_simulation(paths_kind):
    acc = decreasing_table(seed=3)
    paths = greedy_tree(acc, 32) if paths_kind == "greedy" else SPARSE64_HEAD
    predicted = predicted_accept_length(acc, paths)
    simulated = simulate_accept_length(acc, paths, num_draws=200_000, seed=0)
    assert predicted > 1.5
    assert simulated == pytest.approx(predicted, abs=0.01)


def test_accuracy_table_conditions_on_the_path_above():
    K = 3   # rows: ranks at depths 1, 2; K = missing, -1 = unknown
    R = torch.tensor([[0, 0], [0, 1], [1, 0], [K, 0], [2, K], [0, -1]])
    acc, counts = accuracy_table(R, top_k=K)
    assert counts.tolist() == [6, 4]                     # depth 2: only rows whose depth 1 is in the top-k and known
    assert acc[0].tolist() == pytest.approx([3 / 6, 1 / 6, 1 / 6])
    assert acc[1].tolist() == pytest.approx([2 / 4, 1 / 4, 0])
    assert top1_unconditional(R) == pytest.approx([3 / 6, 3 / 5])


def test_empirical_and_replay_accept_lengths_by_hand():
    K = 10
    R = torch.tensor([[0, 0], [0, 1], [1, 0], [K, 0], [0, 0], [0, 0]])
    chain = [[0], [0, 0]]
    # per position: depths 2, 1, 0, 0, 2, 2 -> mean 7/6 accepted + 1
    assert empirical_accept_length([R], chain) == pytest.approx(1 + 7 / 6)
    # decoding visits positions 0 (emits 3), 3 (emits 1), 4 (emits 3): 7 / 3
    assert replay_accept_length([R], chain) == pytest.approx(7 / 3)


def test_empirical_matches_formula_when_ranks_are_independent():
    acc = decreasing_table(depth=3, seed=5)
    rng = np.random.default_rng(1)
    probs = np.concatenate([acc, 1 - acc.sum(1, keepdims=True)], 1)
    R = torch.tensor(np.stack([rng.choice(11, size=50_000, p=p) for p in probs], 1))
    paths = greedy_tree(acc, 16)
    assert empirical_accept_length([R], paths) == pytest.approx(predicted_accept_length(acc, paths), abs=0.02)
    measured, _ = accuracy_table(R, top_k=10)
    assert np.abs(measured - acc).max() < 0.02


# -- tree choice on a latency curve ------------------------------------------------------------

def test_chosen_budget_maximises_tokens_per_s_on_a_synthetic_curve():
    acc = decreasing_table(seed=2)
    sizes, flat, steep = [1, 8, 32, 64, 128], [1.0, 1.0, 1.0, 1.02, 1.05], [1.0, 1.7, 4.1, 7.3, 13.7]
    assert interpolate_cost(sizes, steep, 16) == pytest.approx(1.7 + 8 * 2.4 / 24)
    assert interpolate_cost(sizes, steep, 129) == pytest.approx(13.7 + 6.4 / 64)
    chosen = {}
    for name, curve in [("flat", flat), ("steep", steep)]:
        rows = []
        for n in (1, 2, 4, 8, 16, 32, 64, 128):
            L = predicted_accept_length(acc, greedy_tree(acc, n))
            rows.append({"budget": n, "predicted_tokens_per_s": predicted_tokens_per_s(
                L, interpolate_cost(sizes, curve, n + 1), 0.01 * n)})
        chosen[name] = choose_budget(rows)
        assert chosen[name]["predicted_tokens_per_s"] == max(r["predicted_tokens_per_s"] for r in rows)
    assert chosen["steep"]["budget"] < chosen["flat"]["budget"]


# -- rank measurement on a tiny model ----------------------------------------------------------

def _noisy_heads(model, family, draft_ids=None):
    torch.manual_seed(0)
    size = None if draft_ids is None else len(draft_ids)
    heads = build_heads(HeadsConfig.for_base(model, family=family, num_heads=3, draft_vocab_size=size), model,
                        draft_ids)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return heads.eval()


@pytest.mark.parametrize("family", ["medusa", "hydra", "hydra_pp"])
@pytest.mark.parametrize("draft_vocab", [False, True])
def test_sequence_ranks_match_brute_force(family, draft_vocab):
    """Ranks of the base's greedy tokens in each head's top-k; with a draft vocabulary the heads rank its
    tokens only (head_logits is -inf outside it), and a token outside it is never found."""
    from models.shared.draft_vocab import answer_token_counts, most_frequent

    model, tok = build_tiny_model(seed=1)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi there"}], add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    (seq,) = greedy_continuations(model, [prompt], max_new_tokens=12)
    draft_ids = None
    if draft_vocab:   # the answer's tokens but its two most frequent ones, then unseen ids: 64 in all
        counts = answer_token_counts([seq[len(prompt):]], model.config.vocab_size)
        draft_ids = most_frequent(counts, 66)[2:]
    heads = _noisy_heads(model, family, draft_ids)
    assert len(seq) == len(prompt) + 12
    start = len(prompt) - 1
    K = 32 if draft_vocab else 128   # half the (draft) vocabulary: most ranks are found, so the alignment is checked
    R = sequence_ranks(model, heads, seq, start, top_k=K)
    assert R.shape == (len(seq) - 1 - start, 3)
    assert ((R >= 0) & (R < K)).sum() >= 8
    ids, outside = torch.tensor(seq), 0
    with torch.no_grad():
        for i in range(R.shape[0]):
            t = start + i
            h = model.get_decoder()(input_ids=ids[None, :t + 1]).last_hidden_state
            h = heads.read_hidden(h, torch.arange(t + 1)[None])[0, -1]
            for d in range(1, 4):
                if t + d > len(seq) - 1:
                    assert R[i, d - 1] == -1
                    continue
                truth = int(model(input_ids=ids[None, :t + d + 1]).logits[0, -1].argmax())
                top = heads.head_logits(d - 1, h, ids[t + 1:t + d + 1]).topk(K).indices.tolist()
                assert R[i, d - 1] == (top.index(truth) if truth in top else K)
                if draft_ids is not None and truth not in draft_ids.tolist():
                    assert R[i, d - 1] == K
                    outside += 1
    assert outside > 0 if draft_vocab else outside == 0


# -- the stage on a tiny model -----------------------------------------------------------------

def _tiny_stage_config(tmp_path, heads_name):
    from hydra import compose, initialize_config_dir

    from pipelines.common import CONF_DIR

    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=[
            "model=tiny_random", "profile=smoke", f"heads={heads_name}", f"paths.results={tmp_path}/results",
            f"paths.reports={tmp_path}/reports", f"data.distilled_dir={tmp_path}/distilled",
            "profile.calibrate.num_samples=3", "profile.calibrate.max_new_tokens=10",
            "profile.calibrate.latency_sizes=[1,4,16]", "profile.calibrate.latency_repeats=1",
            "profile.calibrate.latency_prefix=20", "profile.calibrate.budgets=[2,4,8]",
            "profile.eval.batch_sizes=[1,4]"])
    return cfg


def _write_tiny_distilled(folder, tok):
    from datasets import Dataset, DatasetDict

    rows = {"id": [], "messages": [], "input_ids": [], "labels": []}
    for i, (q, a) in enumerate([("Hi", "Hello!"), ("Name a fruit", "Apple."), ("2+2?", "4"), ("Bye", "Bye.")]):
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        reply = tok(a + "<|im_end|>")["input_ids"]
        rows["id"].append(str(i))
        rows["messages"].append("[]")
        rows["input_ids"].append(prompt + reply)
        rows["labels"].append([-100] * len(prompt) + reply)
    ds = Dataset.from_dict(rows)
    DatasetDict({"train": ds, "val": ds}).save_to_disk(str(folder))


def log_to_a_file_store(done: dict, tmp_path, monkeypatch) -> None:
    """The stage's MLflow logging of what calibrate() returned (its metrics hold the run and host records, which are
    not numbers: only their numeric leaves are logged)."""
    import mlflow

    from pipelines.calibrate import log_calibration

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")      # a throwaway store, fast to create
    mlflow.set_tracking_uri(f"file://{tmp_path / 'mlruns'}")
    mlflow.set_experiment("calibrate")         # not an earlier test's active experiment, which this store lacks
    with mlflow.start_run() as run:
        log_calibration(done)
    logged = mlflow.get_run(run.info.run_id).data.metrics
    assert logged["run.cpu_count"] >= 1 and "acc_top1_d1" in logged and "budget_predicted_accept_length" in logged


@pytest.mark.parametrize("heads_name,continuation", [("hydra_pp", "greedy"), ("medusa1", "data"), ("dflash", "greedy")])
def test_calibrate_stage_writes_a_loadable_optimal_tree(tmp_path, heads_name, continuation, monkeypatch):
    from models.measure.calibration import sort_paths
    import json

    from pipelines.calibrate import calibrate
    from pipelines.methods import resolve_tree, tree_config

    cfg = _tiny_stage_config(tmp_path, heads_name)
    cfg.profile.calibrate.continuation = continuation
    model, tok = build_tiny_model(seed=0)
    _write_tiny_distilled(tmp_path / "distilled", tok)
    heads = build_heads(HeadsConfig.for_base(model, family=cfg.heads.family, num_heads=cfg.heads.num_heads,
                                             num_layers=cfg.heads.num_layers, share_lm_head=True), model)
    heads.save(tmp_path / "results" / "heads" / heads_name)

    done = calibrate(cfg)
    log_to_a_file_store(done, tmp_path, monkeypatch)
    out = tmp_path / "results" / "calibrate" / heads_name
    result = json.loads((out / "calibration.json").read_text())
    assert [b["budget"] for b in result["budgets"]] == [2, 4, 8]
    assert np.array(result["acc"]).shape == (cfg.heads.num_heads, 10)
    D = cfg.heads.num_heads                      # chains of each budget the heads reach, and the deepest
    assert [c["budget"] for c in result["chains"]] == sorted({n for n in (2, 4, 8) if n <= D} | {D})
    assert all(c["paths"] == [[0] * d for d in range(1, c["budget"] + 1)] for c in result["chains"])
    tps = [b["predicted_tokens_per_s"] for b in result["budgets"] + result["chains"]]
    assert result["chosen"]["predicted_tokens_per_s"] == max(tps)          # a chain or a greedy tree
    assert (tmp_path / "results" / "calibrate" / "latency.json").is_file()
    machine = json.loads((tmp_path / "reports" / "metrics" / "calibrate_latency.json").read_text())
    assert machine["baseline_step_s"] > 0 and machine["weight_read"]["seconds"] > 0     # the cost model's two units
    assert json.loads((out / "choice.json").read_text())["choice"] in ("fixed", "grown")
    assert len(list((tmp_path / "results" / "cache" / "calibrate").glob("*.json"))) == (continuation == "greedy")
    # tree=optimal (conf/tree/optimal.yaml, kind: file) loads what the stage wrote
    spec = resolve_tree(cfg, tree_config(cfg, "optimal", heads_name), "optimal").tree
    assert spec.num_nodes == result["chosen_budget"]
    assert {p.name for p in done["files"]} >= {"acc_heatmap.png", "tokens_per_s.png"}
    metrics = json.loads((tmp_path / "reports" / "metrics" / f"calibrate_{heads_name}.json").read_text())
    assert metrics["chosen_budget"] == result["chosen_budget"]
    # the tree per batch size: from the batched verify profile, among the same trees and chains
    latency = json.loads((tmp_path / "results" / "calibrate" / "latency.json").read_text())
    assert latency["batch"]["batch_sizes"] == [1, 4] and len(latency["batch"]["seconds"]) == 2
    assert latency["run"]["cpu_count"] >= 1       # the run section reads calibrate_latency's time from its record
    batch = json.loads((out / "batch_trees.json").read_text())["trees"]
    assert set(batch) == {"1", "4"} and metrics["batch_chosen_budget"] == {B: t["budget"] for B, t in batch.items()}
    weighed = [sort_paths(r["paths"]) for r in result["budgets"] + result["chains"]]
    settings = [(g["depth"], g["top_k"], g["nodes"]) for g in result["grown"]]
    for t in batch.values():        # a fixed tree weighed above, or a grown setting (the faster here, by timing)
        assert (t["shape"] == "grown" and t["kind"] == "grown" and (t["depth"], t["top_k"], t["nodes"]) in settings
                if "paths" not in t else sort_paths(t["paths"]) in weighed)


def _fit_heads(model, heads, seqs, starts, steps=5, lr=1e-2):
    """Overfit the heads to the base's greedy tokens on these sequences, so that drafts get accepted."""
    data = []
    with torch.no_grad():
        for s, start in zip(seqs, starts):
            ids = torch.tensor(s)
            h = model.get_decoder()(input_ids=ids[None]).last_hidden_state
            data.append((ids, h, model.get_output_embeddings()(h)[0].argmax(-1), start))
    opt = torch.optim.Adam([p for p in heads.parameters() if p.requires_grad], lr=lr)
    heads.train()
    for _ in range(steps):
        loss = 0.0
        for ids, h, greedy, start in data:
            T = ids.numel()
            hid = heads.read_hidden(h, torch.arange(T)[None])[0]
            for d in range(1, heads.config.num_heads + 1):
                t = torch.arange(start, T - d)
                path = ids[t[:, None] + 1 + torch.arange(d)]
                logits = heads.head_logits(d - 1, hid[t], path)
                loss = loss + torch.nn.functional.cross_entropy(logits, greedy[t + d])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.eval()


@pytest.mark.parametrize("family,lr", [("medusa", 1e-2), ("hydra", 3e-3), ("hydra_pp", 3e-3)])
def test_replayed_steps_match_the_decoder(family, lr):
    """The calibration's definition of acceptance is the decoder's: on the base's greedy continuation,
    replaying the measured ranks through a tree gives the decoder's own tokens per step."""
    from models.engine.decoding import generate
    from models.engine.trees import TreeSpec

    torch.manual_seed(0)
    model, tok = build_tiny_model(seed=1)
    heads = build_heads(HeadsConfig.for_base(model, family=family, num_heads=3), model)
    for p in model.parameters():
        p.requires_grad_(False)
    prompts = []
    for q in ["Hi there", "What is 2+2?"]:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    N = 40
    seqs = greedy_continuations(model, prompts, N)
    starts = [len(p) - 1 for p in prompts]
    _fit_heads(model, heads, seqs, starts, lr=lr)             # partly fitted: some drafts accepted, some not
    ranks = [sequence_ranks(model, heads, s, start) for s, start in zip(seqs, starts)]
    acc, _ = accuracy_table(ranks)
    assert 0.1 < acc[0, 0] < 0.95
    paths = greedy_tree(acc, 12)
    for p, s, R in zip(prompts, seqs, ranks):
        res = generate(model, tok, p, heads_drafter(heads, TreeSpec("t", tuple(paths), 10)), max_new_tokens=N, stop_token_ids=[])
        assert res.new_tokens == s[len(p):]
        replayed = replay_steps(R, paths)
        k = next(i for i in range(len(res.accept_lengths)) if sum(res.accept_lengths[:i + 1]) > N - 5)
        assert res.accept_lengths[:k] == replayed[:k]          # the last steps differ: the token limit cuts trees
        assert max(res.accept_lengths[:k]) > 1


def test_calibrate_with_no_heads_names_the_heads_it_could_calibrate(tmp_path):
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "pipelines.calibrate", "heads=none", "model=tiny_random",
                          f"paths.results={tmp_path}"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HYDRA_FULL_ERROR": "0"})
    assert out.returncode != 0
    assert "heads=none has no draft heads to calibrate; use heads=<one of" in out.stderr and "hydra_pp" in out.stderr
