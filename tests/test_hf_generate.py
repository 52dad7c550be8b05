"""transformers' own greedy generate (method hf_generate) beside our baseline: the same tokens on a tiny model, a
peer of the references stage checked lossless like pld_hf, and the faster of the two autoregressive loops named
by the README's headline and the results document, with every speedup over it."""
from __future__ import annotations

import pytest
import torch

from analysis.comparisons import faster_ar_loop, label
from analysis.readme import headline_block
from analysis.results import ar_loops_note, headline_table
from models.base import build_tiny_model
from models.engine.decoding import generate
from models.measure.benchmark import TurnRecord
from models.measure.lossless import check_lossless
from models.measure.mtbench import Question, chat_input_ids
from models.measure.peers import greedy_generate

PROMPTS = ["Write a haiku about the sea.", "What is 12 * 7?", "abcabcabcabc"]


@pytest.mark.parametrize("arch,seed", [("llama", 0), ("llama", 1), ("qwen2", 2)])
def test_transformers_greedy_generate_equals_our_baseline_token_for_token(arch, seed):
    model, tok = build_tiny_model(arch, seed=seed)
    for text in PROMPTS:
        ids = chat_input_ids(tok, [text], [])
        with torch.inference_mode():
            ours = generate(model, tok, ids, max_new_tokens=24, stop_token_ids=[tok.eos_token_id])
            theirs = greedy_generate(model, ids, max_new_tokens=24, stop_token_ids=[tok.eos_token_id],
                                     pad_token_id=tok.pad_token_id)
        assert theirs.new_tokens == ours.new_tokens
        # one token a forward call: the prefill emits the first, every later call one more
        assert theirs.accept_lengths == [1] * (len(theirs.new_tokens) - 1) and theirs.steps == len(theirs.accept_lengths)
        assert 0 < theirs.prefill_time <= theirs.wall_time


def test_the_references_run_decodes_with_hf_generate_and_checks_it_against_the_baseline(compose_cfg):
    """eval.methods=references: hf_generate runs beside the prompt lookups (eval.hf_generate.enabled), its greedy
    turns, decoded as the stage decodes them (generate_turn, the model prepared for decoding), checked by the
    losslessness machinery against the baseline's; off by its switch, and not where the peers do not run."""
    from pipelines.common import load_model, stop_token_ids
    from pipelines.evaluate import generate_turn
    from pipelines.methods import Selection, build_methods, selection

    cfg = compose_cfg("profile=smoke", "eval.methods=references", "profile.eval.max_new_tokens=16")
    model, tok = load_model(cfg)
    methods = build_methods(cfg, model, selection(cfg))
    assert [m.name for m in methods] == ["baseline", "pld", "pld_hf", "hf_generate"]
    hf = methods[-1]
    assert (hf.kind, hf.reference, hf.describe()["reference"]) == ("hf_generate", "baseline", "baseline")
    stop = stop_token_ids(model, tok)
    records, prompts = {m.name: [[]] for m in methods}, {}
    for qid, text in enumerate(PROMPTS, 1):
        q, ids = Question(qid, "writing", (text,)), chat_input_ids(tok, [text], [])
        prompts[(0, qid, 1)] = ids
        for m in methods:
            with torch.inference_mode():
                result = generate_turn(m, tok, ids, cfg, 0.0, cfg.seed, stop)
            records[m.name][0].append(TurnRecord.from_generation(q, 1, m.name, 0, 0.0, result))
    assert [r.tokens for r in records["hf_generate"][0]] == [r.tokens for r in records["baseline"][0]]
    report = check_lossless(methods, records, prompts, 1e-3)
    assert report["passed"] and report["methods"]["hf_generate"] == {
        "reference": "baseline", "checked_turns": 3, "identical": 3, "ties": 0, "failures": 0}

    off = compose_cfg("profile=smoke", "eval.methods=references", "eval.hf_generate.enabled=false")
    assert "hf_generate" not in [m.name for m in build_methods(off, model, selection(off))]
    no_peers = Selection("heads", "x", "evaluate_x", [], [], peers=False)
    assert [m.name for m in build_methods(cfg, model, no_peers)] == ["baseline"]


# -- the faster autoregressive loop, named by the headline and the results document -------------------------
def test_the_faster_loop_and_the_factor_over_it():
    assert faster_ar_loop(9.0, 10.0) == ("hf_generate", pytest.approx(0.9))
    assert faster_ar_loop(12.0, 10.0) == ("baseline", 1.0)
    assert faster_ar_loop(12.0, None) == ("baseline", 1.0)
    assert label({"methods": {"hf_generate": {"kind": "hf_generate"}}}, "hf_generate") == \
        "transformers' greedy generate (no drafting)"


def readme_metrics(hf_tps: float | None) -> dict:
    """reports/metrics as analysis.readme reads them: the baseline at 9.0 tokens/s, pld 1.50x, hydra 1.20x, and
    hf_generate at hf_tps tokens/s (none when None)."""
    def row(speedup, tps):
        return {"questions": 2, "speedup": speedup, "speedup_ci": [speedup - 0.1, speedup + 0.1],
                "accept_length": 1.4, "accept_length_ci": None, "tokens_per_s": tps}
    methods = {"pld": row(1.5, 13.5), "hydra-optimal": row(1.2, 10.8)}
    if hf_tps is not None:
        methods = {"hf_generate": {**row(hf_tps / 9.0, hf_tps), "accept_length": 1.0}, **methods}
    return {"num_questions": 2, "max_new_tokens": 8, "baseline_tokens_per_s": 9.0, "lossless": True,
            "lossless_checked_turns": 6, "methods": methods}


def test_the_readme_headline_names_transformers_loop_when_it_is_the_faster():
    block = headline_block(readme_metrics(10.0))
    assert ("batch 1; the baseline decoded 9.0 tokens/s, transformers' greedy generate 10.0 tokens/s: transformers' "
            "is the faster autoregressive loop on this machine, so the last column gives each speedup over it (the "
            "speedup over the baseline x 0.90). Speedup:") in block
    assert "| accepted tokens a step (95% interval) | speedup over the faster loop |" in block
    assert "| transformers' greedy generate (no drafting) | 2 | 1.11x (1.01 to 1.21) | 1.00 | 1.00x |" in block
    assert "| prompt lookup (this decoder) | 2 | 1.50x (1.40 to 1.60) | 1.40 | 1.35x |" in block
    assert "| Hydra, calibrated tree | 2 | 1.20x (1.10 to 1.30) | 1.40 | 1.08x |" in block


def test_the_readme_headline_says_the_figures_stand_when_the_baseline_is_the_faster():
    block = headline_block(readme_metrics(8.1))
    assert ("batch 1; the baseline decoded 9.0 tokens/s, transformers' greedy generate 8.1 tokens/s: the baseline is "
            "the faster autoregressive loop on this machine, so the speedups over it stand. Speedup:") in block
    assert "faster loop |" not in block
    assert "| transformers' greedy generate (no drafting) | 2 | 0.90x (0.80 to 1.00) | 1.00 |" in block
    assert "| Hydra, calibrated tree | 2 | 1.20x (1.10 to 1.30) | 1.40 |" in block


def test_without_hf_generate_the_headline_is_as_before():
    block = headline_block(readme_metrics(None))
    assert "batch 1; the baseline decoded 9.0 tokens/s. Speedup: mean per-question tokens/s" in block
    assert "greedy generate" not in block and "faster" not in block
    assert "| Hydra, calibrated tree | 2 | 1.20x (1.10 to 1.30) | 1.40 |" in block.splitlines()


def results_summary(hf_tps: float | None) -> dict:
    """A merged evaluate summary: the baseline at 9.0 tokens/s, pld 1.50x, hydra-optimal 1.20x, and hf_generate at
    hf_tps tokens/s (none when None)."""
    def m(kind, speedup, tps, heads=None, tree=None):
        iv = {k: {"value": speedup, "ci": [speedup - 0.1, speedup + 0.1]}
              for k in ("speedup", "mean_of_ratios", "pooled", "decode_speedup")}
        return {"kind": kind, "heads": heads, "tree": tree, "questions": 2, "speedup": {"mean": speedup},
                "throughput": {"mean": tps}, "intervals": {**iv, "accept_length": {"value": 1.0, "ci": None}}}
    methods = {"baseline": m("baseline", 1.0, 9.0), "pld": m("pld", 1.5, 13.5),
               "hydra-optimal": m("heads", 1.2, 10.8, "hydra", "optimal")}
    if hf_tps is not None:
        methods["hf_generate"] = m("hf_generate", hf_tps / 9.0, hf_tps)
    return {"methods": methods}


def test_the_results_document_gives_every_speedup_over_the_faster_loop():
    fast = results_summary(10.0)
    note = ar_loops_note(fast)
    assert "the baseline (this decoder) decoded 9.0 tokens/s, transformers' greedy generate (`hf_generate`) 10.0 " \
           "tokens/s" in note
    assert "Transformers' is the faster loop on this machine: every speedup over it is the speedup over the baseline " \
           "x 0.90 (9.0 / 10.0), the last column." in note
    table = headline_table(fast)
    assert table.splitlines()[0].endswith("| Accepted tokens/step | Over the faster AR loop |")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()[2:]}
    assert rows["hydra-optimal"].endswith("| 1.00 | 1.08x |") and rows["pld"].endswith("| 1.35x |")
    assert rows["hf_generate"].startswith("| hf_generate | 2 | 1.11x (1.01 to 1.21) |") and \
        rows["hf_generate"].endswith("| 1.00x |")

    slow = results_summary(8.1)
    assert "The baseline is the faster loop on this machine: the speedups over it stand" in ar_loops_note(slow)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in headline_table(slow).splitlines()[2:]}
    assert rows["hydra-optimal"].endswith("| 1.00 | 1.20x |") and rows["hf_generate"].endswith("| 0.90x |")

    plain = results_summary(None)
    assert ar_loops_note(plain) == "" and "faster" not in headline_table(plain)
    assert headline_table(plain).splitlines()[0].endswith("| Accepted tokens/step |")
