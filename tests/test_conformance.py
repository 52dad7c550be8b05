"""Our decoder against the authors' Medusa code, step for step, without the old environment: the official steps
for heads from a seed are in tests/golden/medusa_conformance.json (written by `make conformance`,
docs/conformance.md); the slow test rebuilds the same heads on the real SmolLM2 and replays every prompt and tree."""
from __future__ import annotations

import json

import pytest
import torch

from models.engine.trees import TreeBuffers, tree_from_config
from models.measure.conformance import accepted_counts, compare_steps
from models.methods.medusa.seeded import medusa_v01_tree
from pipelines.common import REPO_ROOT

GOLDEN = REPO_ROOT / "tests" / "golden" / "medusa_conformance.json"


def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def our_tree(name: str):
    import yaml
    if name == "v0.1":
        return medusa_v01_tree()
    return tree_from_config(yaml.safe_load((REPO_ROOT / "conf" / "tree" / "sparse64.yaml").read_text()))


def test_the_v01_tree_is_the_cartesian_product_of_top7_and_top6():
    buf = TreeBuffers.build(medusa_v01_tree())
    assert buf.num_tokens == 1 + 7 + 42 and buf.spec.depth == 2
    assert [len(buf.children[i]) for i in buf.children[0]] == [6] * 7


def test_compare_steps_names_the_first_mismatch():
    assert compare_steps([[1, 2], [3]], [[1, 2], [3]]) == {"compared": 2, "identical": True, "first_mismatch": None}
    out = compare_steps([[1, 2], [3, 4], [5]], [[1, 2], [3], [4, 5]])
    assert out == {"compared": 2, "identical": False, "first_mismatch": {"step": 1, "ours": [3, 4], "theirs": [3]}}
    assert not compare_steps([[1]], [[1], [2]])["identical"]


def test_the_harness_summary_names_the_question_and_step_of_a_mismatch():
    from pipelines.conformance import summarize

    runs = {"ours": [2.0, 3.0], "official": [1.0, 1.0]}
    same = {"question_id": 1, "ours": [[5, 6], [7]], "official": [[5, 6], [7]]}
    differ = {"question_id": 2, "ours": [[5], [6, 7]], "official": [[5], [6], [7]]}
    case = {"runs": {"v0.1": runs, "head63": runs}, "steps": {"v0.1": [same, same], "head63": [same, differ]}}
    out = summarize(case, {"tokens": [[5, 6, 7], [5, 6, 7]], "tokens_per_second": [1.0, 1.0]}, 3)
    assert out["v0.1"]["identical"] and out["v0.1"]["steps_compared"] == 4 and out["v0.1"]["steps_accepting_drafts"] == 2
    assert out["head63"]["first_mismatch"] == {"question_id": 2, "step": 1, "ours": [6, 7], "theirs": [6]}
    assert out["v0.1"]["ours_over_official_paired"] == {"median": 2.5, "min": 2.0, "max": 3.0}
    assert out["head63"]["matches_baseline"] == {"ours": True, "official": True}


def test_the_golden_file_is_informative():
    g = golden()
    assert set(g["steps"]) == {"v0.1", "head63"} and g["trees"]["head63"]["conf_tree"] == "sparse64"
    for tree, per_prompt in g["steps"].items():
        assert len(per_prompt) == len(g["prompts"])
        counts = [c for steps in per_prompt for c in accepted_counts(steps)]
        assert sum(c > 0 for c in counts) > 0, f"{tree}: no step accepted a draft, the comparison says little"
        for steps in per_prompt:
            assert sum(len(s) for s in steps) >= g["max_new_tokens"] or 2 in steps[-1]


@pytest.mark.slow
def test_our_decoder_takes_the_official_steps(smollm_dir, tmp_path):
    from models.base import load_base_model
    from models.engine.drafting import make_drafter
    from models.engine.fast_inference import prepare_heads_for_decoding
    from models.engine.path_choice import prepare_for_decoding
    from models.methods import export_heads, import_heads
    from models.measure.conformance import record_steps
    from models.methods.medusa.seeded import seeded_medusa_heads

    g = golden()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model, tok = load_base_model(str(smollm_dir))
        prepare_for_decoding(model)
        export_heads(seeded_medusa_heads(model, g["seed"], g["num_heads"], g["scale"]), model, tmp_path, "medusa")
        heads = import_heads(tmp_path, model, "medusa")          # the file the official code read
        prepare_heads_for_decoding(heads, bf16=False)
        for tree, per_prompt in g["steps"].items():
            drafter = make_drafter({"kind": "heads", "tree": our_tree(tree)}, heads=heads)
            for prompt, official in zip(g["prompts"], per_prompt):
                ours = record_steps(model, drafter, prompt["ids"], g["max_new_tokens"], tok.eos_token_id)["steps"]
                result = compare_steps(ours, official)
                assert result["identical"], f"{tree}, question {prompt['question_id']}: {result['first_mismatch']}"
    finally:
        torch.set_num_threads(before)
