"""pytest tests/test_batch.py: many answers decoded at once (models/engine/batch.py) on tiny random models.

Lossless row by row: with ragged prompts, stop tokens met at different steps and B up to 8, each sequence of a
batched greedy decode is its own batch-1 greedy answer token for token (float32), for the baseline and every
drafter kind: fixed trees of draft heads, a draft model that is the base itself (long accepted branching paths, so
the rows' caches grow apart), EAGLE, EAGLE-3 and DFlash (taps), a tree grown per step, prompt lookup and prompt
lookup merged into a tree; the context limit stops each sequence at its own step. Sampling: each sequence draws
from its own generator, so its answer does not depend on its neighbours, and the sampled tokens follow the base's
distribution row by row (chi-square), while acceptance read from a neighbour's rows fails it. Bad input is refused
by name.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from models.base import build_tiny_model
from models.engine import step as step_module
from models.engine.acceptance import SamplingConfig
from models.engine.batch import generate_batch
from models.engine.decoding import generate
from models.engine.drafting import heads_drafter, make_drafter
from models.engine.trees import GrownTree, tree_from_config
from models.methods import build_heads
from models.shared import HeadsConfig
from tests.test_decoding import cyclic_prompt
from tests.test_sampling import MAX_NEW, TOKENS, TOP_K, chi2_pvalue, first_tokens_distribution

pytestmark = pytest.mark.usefixtures("one_thread")

TREE = tree_from_config({"kind": "paths", "top_k": 3, "paths": [[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 0, 0, 0]]})
NEW = 24


@pytest.fixture(scope="module")
def tiny():
    model, tok = build_tiny_model(seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [cyclic_prompt(model, tok, known=k) for k in (6, 14)]                   # lookups match in these
    prompts += [torch.randint(3, 250, (n,), generator=g).tolist() for n in (3, 9, 17, 30, 5, 12)]
    return model, tok, prompts


def heads_of(model, family, layers=1, seed=0, **settings):
    torch.manual_seed(seed)
    config = HeadsConfig.for_base(model, family, num_heads=4, num_layers=layers, share_lm_head=True, **settings)
    return build_heads(config, model).eval()


DRAFTERS = {
    "baseline": lambda m: None,
    "medusa": lambda m: (lambda h: lambda: heads_drafter(h, TREE))(heads_of(m, "medusa")),
    "hydra_pp": lambda m: (lambda h: lambda: heads_drafter(h, TREE))(heads_of(m, "hydra_pp")),
    "the_base_as_draft_model": lambda m: (lambda h: lambda: heads_drafter(h, TREE))(heads_of(m, "draft_model", 2)),
    "eagle": lambda m: (lambda h: lambda: heads_drafter(h, TREE))(heads_of(m, "eagle")),
    "eagle3": lambda m: (lambda h: lambda: heads_drafter(h, TREE))(heads_of(m, "eagle3")),
    "dflash": lambda m: (lambda h: lambda: heads_drafter(h, TREE))(heads_of(m, "dflash")),
    "grown": lambda m: (lambda h: lambda: heads_drafter(h, GrownTree("g", 3, 3, 6)))(heads_of(m, "draft_model", 2)),
    "prompt_lookup": lambda m: lambda: make_drafter({"kind": "prompt_lookup"}),
    "lookup_merged": lambda m: (lambda h: lambda: heads_drafter(h, TREE, lookup=make_drafter(
        {"kind": "prompt_lookup"})))(heads_of(m, "hydra")),
}


def stop_token(answers: list[list[int]]) -> int:
    """A token that ends some answers early and others later or never: the commonest of positions 3..15 of the
    random prompts' answers that the two cyclic prompts' answers (where lookups match) never reach."""
    cyclic = set(answers[0]) | set(answers[1])
    return next(t for t, _ in Counter(t for a in answers[2:] for t in a[3:16]).most_common() if t not in cyclic)


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
def test_each_sequence_of_a_batch_is_its_own_batch_one_greedy_answer(tiny, kind):
    model, tok, prompts = tiny
    make = DRAFTERS[kind](model)
    plain = [generate(model, None, p, max_new_tokens=NEW, stop_token_ids=[]).new_tokens for p in prompts]
    stops = [stop_token(plain)]
    alone = [generate(model, None, p, make() if make else None, max_new_tokens=NEW, stop_token_ids=stops)
             for p in prompts]
    together = generate_batch(model, None, prompts, [make() for _ in prompts] if make else None,
                              max_new_tokens=NEW, stop_token_ids=stops)
    assert [r.new_tokens for r in together] == [r.new_tokens for r in alone]
    assert [r.stop_reason for r in together] == [r.stop_reason for r in alone]
    assert len({len(r.new_tokens) for r in together}) > 1                  # they stopped at different steps
    if kind == "the_base_as_draft_model":
        assert together[0].accept_lengths == alone[0].accept_lengths and max(together[0].accept_lengths) > 2
    if kind in ("prompt_lookup", "lookup_merged"):
        assert any(any(r.from_draft) for r in together)


@pytest.mark.parametrize("kind", ["baseline", "prompt_lookup"])
def test_a_row_left_alone_by_a_longer_neighbour_decodes_its_own_answer(tiny, kind):
    """The longer prompt stops first: the shorter row, left alone, takes plain 1-token steps on a cache that held
    its neighbour's longer columns (the bug the batch curve met at B = 2 on SmolLM2: one answer in 40 changed)."""
    model, _, prompts = tiny
    short, long = prompts[2], prompts[5]                                   # 3 and 30 tokens
    plain = [generate(model, None, p, max_new_tokens=NEW, stop_token_ids=[]).new_tokens for p in (short, long)]
    stops = [next(t for t in plain[1][2:] if t not in plain[0])]          # ends the long answer, never the short
    make = DRAFTERS[kind](model)
    alone = [generate(model, None, p, make() if make else None, max_new_tokens=NEW, stop_token_ids=stops).new_tokens
             for p in (short, long)]
    together = generate_batch(model, None, [short, long], [make(), make()] if make else None,
                              max_new_tokens=NEW, stop_token_ids=stops)
    assert len(alone[1]) < len(alone[0])                                   # the long one left first
    assert [r.new_tokens for r in together] == alone


def test_the_context_stops_each_sequence_at_its_own_step():
    model, _ = build_tiny_model(seed=1, max_position_embeddings=40)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (20, 33, 38, 40)]
    make = DRAFTERS["the_base_as_draft_model"](model)
    alone = [generate(model, None, p, make(), max_new_tokens=30, stop_token_ids=[]) for p in prompts]
    together = generate_batch(model, None, prompts, [make() for _ in prompts], max_new_tokens=30, stop_token_ids=[])
    assert [r.new_tokens for r in together] == [r.new_tokens for r in alone]
    assert [r.stop_reason for r in together] == ["context_limit"] * 4
    assert [len(r.new_tokens) for r in together] == [21, 8, 3, 1]


def test_a_sequences_sampled_answer_does_not_depend_on_its_neighbours(tiny):
    model, _, prompts = tiny
    make = DRAFTERS["hydra_pp"](model)
    s = SamplingConfig(temperature=1.0, top_k=20, acceptance="sampling")
    runs = [generate_batch(model, None, [prompts[0], other], [make(), make()], sampling=s, max_new_tokens=16,
                           stop_token_ids=[], seeds=[7, 8])[0].new_tokens for other in (prompts[3], prompts[5])]
    assert runs[0] == runs[1]


def _first_tokens(setup, n: int, rows: int = 4) -> list[Counter]:
    """Per row of a batch of `rows` copies of the prompt, the first TOKENS tokens over n batched generations."""
    model, _, ids, heads, _ = setup
    counts = [Counter() for _ in range(rows)]
    for i in range(n):
        s = SamplingConfig(temperature=1.0, top_k=TOP_K, acceptance="sampling")
        res = generate_batch(model, None, [ids] * rows, [heads_drafter(heads, TREE) for _ in range(rows)],
                             sampling=s, max_new_tokens=MAX_NEW, stop_token_ids=[],
                             seeds=[1000 * i + r for r in range(rows)])
        for r, out in enumerate(res):
            counts[r][tuple(out.new_tokens[:TOKENS])] += 1
    return counts


@pytest.fixture(scope="module")
def sampling_setup():
    """A one-layer tiny base and a draft model that is its copy, perturbed: drafts accepted and rejected."""
    from tests.test_sampling import make_setup
    from tests.test_sampling_ar import perturb

    model, tok, ids, _, expected = make_setup("llama", num_layers=1)
    config = HeadsConfig.for_base(model, "draft_model", num_heads=4, num_layers=1, share_lm_head=True)
    heads = build_heads(config, model).eval()
    perturb(heads.draft_model, 0.05)
    return model, tok, ids, heads, expected


def test_batched_sampling_keeps_each_rows_distribution_and_its_control_fails(sampling_setup, monkeypatch):
    n = 150
    pooled = sum(_first_tokens(sampling_setup, n), Counter())
    assert chi2_pvalue(pooled, sampling_setup[-1], 4 * n) > 0.01
    model, _, ids, _, _ = sampling_setup
    other = [ids[0]] + list(reversed(ids[1:]))                          # rows whose distribution differs
    verify = step_module.verify

    def neighbours_rows(*args, **kw):                                   # acceptance reads the next row's states
        return verify(*args, **kw).roll(1, 0)

    monkeypatch.setattr(step_module, "verify", neighbours_rows)
    counts = Counter()
    heads = sampling_setup[3]
    for i in range(n):
        s = SamplingConfig(temperature=1.0, top_k=TOP_K, acceptance="sampling")
        res = generate_batch(model, None, [ids, other], [heads_drafter(heads, TREE) for _ in range(2)], sampling=s,
                             max_new_tokens=MAX_NEW, stop_token_ids=[], seeds=[2 * i, 2 * i + 1])
        counts[tuple(res[0].new_tokens[:TOKENS])] += 1
    assert chi2_pvalue(counts, first_tokens_distribution(model, ids), n) < 0.01


def test_bad_batches_are_refused_by_name(tiny):
    model, _, prompts = tiny
    with pytest.raises(ValueError, match="at least one prompt"):
        generate_batch(model, None, [])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate_batch(model, None, [[1, 2], []])
    with pytest.raises(ValueError, match=r"prompt 0 has 600 tokens but the model's context is 512"):
        generate_batch(model, None, [[5] * 600, [1, 2]])
    make = DRAFTERS["medusa"](model)
    with pytest.raises(ValueError, match="1 drafters for 2 prompts"):
        generate_batch(model, None, prompts[:2], [make()])
    d = make()
    with pytest.raises(ValueError, match="each sequence needs its own"):
        generate_batch(model, None, prompts[:2], [d, d])
    with pytest.raises(ValueError, match="max_new_tokens=-1"):
        generate_batch(model, None, prompts[:2], max_new_tokens=-1)
    with pytest.raises(ValueError, match="3 seeds for 2 prompts"):
        generate_batch(model, None, prompts[:2], seeds=[1, 2, 3])


def test_the_generate_command_decodes_a_file_of_prompts_as_one_batch(tmp_path, compose_cfg):
    """prompts_file= (one prompt a line) with random EAGLE heads: every answer printed and written, each the one
    prompt= gives alone; a cut-off JSON list and two prompt options at once are refused by name. The batch runs as
    the command itself; the rest through the same main() in this process (a subprocess costs its imports)."""
    import json
    import os
    import subprocess
    import sys

    from pipelines import generate as generate_cmd
    from pipelines.common import REPO_ROOT

    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    (tmp_path / "prompts.txt").write_text("Hello there\nName three rivers\n\nWhy is the sky blue?\n")
    opts = ["heads=eagle", "random_heads=true", "tree=chain4", "max_new_tokens=10"]   # compose_cfg adds the tiny model
    proc = subprocess.run([sys.executable, "-m", "pipelines.generate", "model=tiny_random", *opts, "threads=1",
                           f"hydra.run.dir={tmp_path / 'hydra'}", f"prompts_file={tmp_path / 'prompts.txt'}",
                           f"output={tmp_path / 'batch.json'}"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "batch of 3" in proc.stdout and "-- [2] Why is the sky blue?" in proc.stdout
    answers = json.loads((tmp_path / "batch.json").read_text())["answers"]
    generate_cmd.main(compose_cfg(*opts, "prompt=Name three rivers", f"output={tmp_path / 'one.json'}"))
    assert answers[1]["new_tokens"] == json.loads((tmp_path / "one.json").read_text())["new_tokens"]
    (tmp_path / "cut.json").write_text('["Hello there", "Name thr')
    with pytest.raises(ValueError, match="cut off"):
        generate_cmd.main(compose_cfg(*opts, f"prompts_file={tmp_path / 'cut.json'}"))
    with pytest.raises(ValueError, match="give one of prompt"):
        generate_cmd.main(compose_cfg(*opts, "prompt=Hi", "prompts=[Hello]"))


BATCH_QUESTIONS = [{"question_id": i, "category": c, "turns": [t, "And then?"]} for i, (c, t) in enumerate([
    ("writing", "Write a haiku about the sea."), ("math", "What is 12 * 7?"), ("coding", "Reverse a list in Python."),
    ("roleplay", "You are a pirate. Greet me."), ("stem", "Why is the sky blue?")], start=1)]


def batch_cfg(tmp_path, heads: str, *extra: str):
    import json

    from hydra import compose, initialize_config_dir

    from pipelines.common import CONF_DIR

    qfile = tmp_path / "questions.jsonl"
    qfile.write_text("\n".join(json.dumps(q) for q in BATCH_QUESTIONS) + "\n")
    overrides = ["model=tiny_random", "profile=smoke", f"heads={heads}", f"paths.results={tmp_path / 'results'}",
                 f"paths.data={tmp_path / 'data'}", f"paths.reports={tmp_path / 'reports'}",
                 f"data.questions_file={qfile}", "profile.eval.num_questions=null", "profile.eval.turns=1",
                 "profile.eval.max_new_tokens=12", "profile.eval.repeats=1", "profile.eval.warmup=0",
                 "profile.eval.batch_sizes=[1,2,4]", "eval.num_threads=1", *extra]
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose(config_name="config", overrides=overrides)


def test_the_batch_curve_stage_decodes_every_question_in_batches_and_checks_each_answer(tmp_path, monkeypatch):
    """references (batch 1) -> batch_baseline and batch@hydra: 5 questions in batches of 2 (2, 2, 1) and 4 (4, 1),
    the heads on the tree calibrate chose for each B, alone and with prompt lookup; every answer equal to the
    references stage's; a rerun reads the stored records back instead of decoding."""
    import json

    from pipelines import evaluate_batch
    from pipelines.evaluate import run_evaluation

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    model, _ = build_tiny_model()
    heads_of(model, "hydra").save(tmp_path / "results" / "heads" / "hydra")
    cal = tmp_path / "results" / "calibrate" / "hydra"
    cal.mkdir(parents=True)
    (cal / "batch_trees.json").write_text(json.dumps({"heads": "hydra", "trees": {
        "1": {"paths": [[0], [1], [0, 0]], "top_k": 10, "budget": 3},
        "2": {"paths": [[0], [1], [0, 0]], "top_k": 10, "budget": 3},
        "4": {"kind": "grown", "depth": 1, "top_k": 2, "nodes": 3, "budget": 3}}}))     # each sequence grows its own
    refs = batch_cfg(tmp_path, "none", "eval.methods=references")
    run_evaluation(refs)
    baseline = evaluate_batch.run_batch_curve(batch_cfg(tmp_path, "none"))
    assert baseline["lossless"] and baseline["batch_sizes"] == [2, 4]
    assert [b["questions"] for b in baseline["methods"]["baseline"]["2"]["batches"]] == [[1, 2], [3, 4], [5]]
    hydra = evaluate_batch.run_batch_curve(batch_cfg(tmp_path, "hydra"))
    assert set(hydra["methods"]) == {"hydra-batch", "hydra-batch_pld"} and hydra["lossless"]
    assert all(r["lossless"]["identical"] == 5 for m in hydra["methods"].values() for r in m.values())
    assert json.loads((tmp_path / "reports" / "metrics" / "batch_hydra.json").read_text())["lossless"]
    from analysis.batch_curve import batch_markdown, batch_rows, load_batch_runs

    rows = batch_rows(None, load_batch_runs(tmp_path / "results" / "batch"))
    assert [(r["variant"], r["batch_size"], r["batches"]) for r in rows] == [
        ("alone", 2, 3), ("alone", 4, 2), ("with prompt lookup", 2, 3), ("with prompt lookup", 4, 2)]
    assert all(r["speedup"] > 0 and r["ci"][0] <= r["ci"][1] for r in rows)
    assert batch_markdown(rows).splitlines()[0] == "| method | B = 2 | B = 4 |"
    assert batch_markdown(rows).rstrip().endswith(f"B > 1 on {len(BATCH_QUESTIONS)} questions in batches of B.")
    monkeypatch.setattr(evaluate_batch, "decode_batches", lambda *a, **k: pytest.fail("decoded again"))
    again = evaluate_batch.run_batch_curve(batch_cfg(tmp_path, "hydra"))
    assert again["methods"]["hydra-batch"]["4"]["tokens"] == hydra["methods"]["hydra-batch"]["4"]["tokens"]


def test_a_batch_size_above_the_questions_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    """B = 8 from 5 questions would decode one batch of 5 and record it under 8: refused, naming both numbers, before
    a model loads; decode_batches refuses it too (the questions the references hold may be fewer)."""
    from pipelines import evaluate_batch

    monkeypatch.setattr(evaluate_batch, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ValueError, match=r"profile\.eval\.batch_sizes=\[1, 2, 8\] asks for B=8 but "
                                         r"profile\.eval\.num_questions=null \(all\) selects 5 questions; use batch sizes "
                                         r"at most 5 or more questions"):
        evaluate_batch.run_batch_curve(batch_cfg(tmp_path, "none", "profile.eval.batch_sizes=[1,2,8]"))
    with pytest.raises(ValueError, match="batches of 4 from 3 questions"):
        evaluate_batch.decode_batches(None, [[1, 2]] * 3, [1, 2, 3], 4, None, 8, [])



def test_the_curve_decodes_its_stated_subset_and_refuses_a_batch_above_it(tmp_path, monkeypatch):
    """profile.eval.batch_questions = N: N of the questions, spread over the categories (every other of ten when N is
    five); a B above N is refused naming both settings, before a model loads."""
    from omegaconf import OmegaConf

    from pipelines import evaluate_batch

    questions = list(range(10))
    cfg = OmegaConf.create({"profile": {"eval": {"batch_questions": 5}}})
    assert evaluate_batch.curve_questions(cfg, questions) == [0, 2, 4, 6, 8]
    cfg.profile.eval.batch_questions = None
    assert evaluate_batch.curve_questions(cfg, questions) == questions
    cfg.profile.eval.batch_questions = 0
    with pytest.raises(ValueError, match=r"profile\.eval\.batch_questions=0: use a whole number >= 1"):
        evaluate_batch.curve_questions(cfg, questions)
    monkeypatch.setattr(evaluate_batch, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ValueError, match=r"B=4 but profile\.eval\.num_questions=null \(all\) and "
                                         r"profile\.eval\.batch_questions=3 select 3 questions"):
        evaluate_batch.run_batch_curve(batch_cfg(tmp_path, "none", "profile.eval.batch_sizes=[1,2,4]",
                                                 "profile.eval.batch_questions=3"))

def test_the_tree_per_batch_size_weighs_the_batched_draft_and_the_grown_trees():
    """At B = 8 a tree whose drafts batch (one forward a depth for every sequence) beats a cheap chain that wins when
    drafting is counted B times; a grown tree (each sequence grows its own: B drafts) is a candidate, chosen at B = 1
    and written with its settings."""
    from pipelines.calibrate_batch import batch_choices

    batch = {"batch_sizes": [1, 8], "sizes": [1, 4, 16], "seconds": [[0.010, 0.011, 0.014], [0.020, 0.050, 0.160]]}
    parts = {"accept": 0.0002, "commit": 0.0002}
    tree = {"budget": 3, "paths": [[0], [1], [0, 0]], "predicted_accept_length": 2.0, "overhead_s": 0.0044,
            "step_parts_s": {"draft": 0.004, **parts}, "batch_draft_s": {"8": 0.006}}
    chain = {"budget": 1, "paths": [[0]], "shape": "chain", "predicted_accept_length": 1.3, "overhead_s": 0.0014,
             "step_parts_s": {"draft": 0.001, **parts}}
    grown = {"depth": 1, "top_k": 2, "nodes": 2, "drafts": 2, "predicted_accept_length": 2.1,
             "overhead_s": 0.0034,
             "step_parts_s": {"draft": 0.003, **parts}}
    chosen = batch_choices([tree, chain], batch, [grown])
    assert chosen["1"]["kind"] == "grown" and (chosen["1"]["depth"], chosen["1"]["top_k"], chosen["1"]["nodes"]) == (1, 2, 2)
    assert chosen["8"]["paths"] == tree["paths"]
    unbatched = batch_choices([{k: v for k, v in tree.items() if k != "batch_draft_s"}, chain], batch, [grown])
    assert unbatched["8"]["paths"] == chain["paths"]


def test_a_batch_draft_is_timed_for_each_batch_size():
    from models.measure.calibration import batch_draft_timings
    from models.engine.trees import TreeSpec

    model, _ = build_tiny_model()
    times = batch_draft_timings(model, heads_of(model, "eagle"), TreeSpec("t", ((0,), (1,), (0, 0)), 10), [2, 4],
                                repeats=2, prefix_len=20)
    assert set(times) == {"2", "4"} and all(t > 0 for t in times.values())


def test_the_batch_claims_are_judged_where_the_curve_reaches_and_left_unjudged_short_of_it():
    from analysis.claims import claim_rows
    from tests.test_intervals import _summary

    curve = [{"heads": "eagle3", "variant": "alone", "batch_size": b, "speedup": s, "ci": (s - 0.1, s + 0.1)}
             for b, s in ((1, 1.5), (8, 1.2))]
    curve += [{"heads": "eagle", "variant": "alone", "batch_size": b, "speedup": s, "ci": (s - 0.05, s + 0.05)}
              for b, s in ((8, 1.1), (32, 0.8))]
    rows = {r["claim"]: r for r in claim_rows(_summary(), batch=curve)}
    short = rows["EAGLE-3 still pays at batch 64"]
    assert short["verdict"] == "not judged here" and "stops at batch 8" in short["reason"]
    assert "1.20x" in short["ours"] and "at batch 8" in short["ours"]
    reached = rows["EAGLE-1 falls below 1x by batch 24"]
    assert reached["verdict"] == "reproduced" and "0.80x" in reached["ours"] and "at batch 32" in reached["ours"]


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "granite"])
def test_other_architectures_batch_losslessly(arch):
    """A sliding window (Qwen2's per-layer types; Mistral's, unlimited here as in batch 1) and Granite's logit scaling
    through the batched prefill and verify: each sequence its batch-1 answer."""
    overrides = {"sliding_window": 24, "use_sliding_window": True, "max_window_layers": 1} if arch == "qwen2" else {}
    model, tok = build_tiny_model(arch=arch, seed=3, **overrides)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (4, 19, 11)]
    make = DRAFTERS["the_base_as_draft_model"](model)
    alone = [generate(model, None, p, make(), max_new_tokens=20, stop_token_ids=[]).new_tokens for p in prompts]
    together = generate_batch(model, None, prompts, [make() for _ in prompts], max_new_tokens=20, stop_token_ids=[])
    assert [r.new_tokens for r in together] == alone


def test_the_autoregressive_drafters_expand_every_sequences_frontier_in_one_forward(tiny, monkeypatch):
    """A batch's fixed trees of one autoregressive drafter are drafted together (drafters/tree.py draft_many ->
    models/shared/autoregressive/batch.py): one draft-module forward a depth for all sequences, the same drafts as
    each sequence alone."""
    from models.shared.autoregressive import batch as together

    model, _, prompts = tiny
    calls = []
    scores = together.DraftBatch.scores
    monkeypatch.setattr(together.DraftBatch, "scores", lambda self, f: calls.append(len(f)) or scores(self, f))
    make = DRAFTERS["eagle3"](model)
    alone = [generate(model, None, p, make(), max_new_tokens=NEW, stop_token_ids=[]).new_tokens for p in prompts]
    res = generate_batch(model, None, prompts, [make() for _ in prompts], max_new_tokens=NEW, stop_token_ids=[])
    assert [r.new_tokens for r in res] == alone
    assert calls and max(calls) == len(prompts)           # every live sequence's frontier in one call


@pytest.mark.parametrize("family, from_anchor", [("dflash", False), ("dflash", True), ("dspark_rnn", True)])
def test_dflash_drafts_every_sequences_block_in_one_forward(tiny, monkeypatch, family, from_anchor):
    """A batch's DFlash blocks run in one forward of the module (DFlashProposer.begin_many: each row its own cached
    and new context, the padding hidden), and each sequence's answer is its batch-1 answer; with
    sample_from_anchor too (slot 0 drafting), and DSpark's rnn reading the batch's slots."""
    from models.methods.dflash.dflash import DFlashModule

    from models.methods.dflash.seeded import fit_to_greedy

    model, _, prompts = tiny
    heads = heads_of(model, family, layers=2, sample_from_anchor=from_anchor)
    seqs = [p + generate(model, None, p, max_new_tokens=NEW, stop_token_ids=[]).new_tokens for p in prompts]
    fit_to_greedy(model, heads, seqs, steps=15, depths=4)              # drafts accepted at some steps
    make = lambda: heads_drafter(heads, TREE)                           # noqa: E731
    alone = [generate(model, None, p, make(), max_new_tokens=NEW, stop_token_ids=[]) for p in prompts]
    assert any(max(r.accept_lengths) > 1 for r in alone)
    rows = []
    forward = DFlashModule.forward
    monkeypatch.setattr(DFlashModule, "forward", lambda self, f, b, *a, **k: rows.append(b.shape[0]) or
                        forward(self, f, b, *a, **k))
    res = generate_batch(model, None, prompts, [make() for _ in prompts], max_new_tokens=NEW, stop_token_ids=[])
    assert [r.new_tokens for r in res] == [r.new_tokens for r in alone]
    assert [r.accept_lengths for r in res] == [r.accept_lengths for r in alone]     # the same drafts accepted
    assert max(rows) == len(prompts)


@pytest.mark.parametrize("family", ["medusa", "hydra", "hydra_pp"])
def test_the_draft_heads_score_every_sequences_tree_together(tiny, family):
    """Medusa's heads run on every sequence's h_t in one product a head (MedusaProposer.begin_many), Hydra's and
    Hydra++'s on every sequence's frontier in one call a depth (HydraProposer.scores_many): the same drafts as each
    sequence drafting alone, and each answer its batch-1 answer."""
    from models.engine.drafters.proposer import draft_tree, draft_trees
    from models.engine.trees import TreeBuffers

    model, _, prompts = tiny
    heads = heads_of(model, family)
    res = generate_batch(model, None, prompts, [heads_drafter(heads, TREE) for _ in prompts], max_new_tokens=NEW,
                         stop_token_ids=[])
    assert [r.new_tokens for r in res] == [generate(model, None, p, heads_drafter(heads, TREE), max_new_tokens=NEW,
                                                    stop_token_ids=[]).new_tokens for p in prompts]
    buf = TreeBuffers.build(TREE)
    drafters = [heads_drafter(heads, TREE) for _ in prompts]
    calls = []
    head_hidden = type(heads).head_hidden
    with torch.inference_mode():
        for d, p in zip(drafters, prompts):
            generate(model, None, p, d, max_new_tokens=3, stop_token_ids=[])        # each its own h_t
        proposers, roots = [d.proposer for d in drafters], [5 + 7 * i for i in range(len(prompts))]
        heads.head_hidden = lambda *a, **k: calls.append(a[1].shape[0]) or head_hidden(heads, *a, **k)
        try:
            together = draft_trees(proposers, roots, buf, SamplingConfig(), [None] * len(prompts))
        finally:
            del heads.head_hidden
        alone = [draft_tree(p, r, buf, SamplingConfig())[0] for p, r in zip(proposers, roots)]
    assert all(torch.equal(a, b) for a, b in zip(together, alone))
    assert len(calls) == len(buf.levels) and min(calls) >= len(prompts)     # one call a depth, every sequence in it
