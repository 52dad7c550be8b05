"""Our EAGLE-1 decoder against the authors' code (eagle-llm 1.2.1), step for step, without the old environment: the
official steps for a draft layer from a seed are in tests/golden/eagle_conformance.json (written by
`make conformance-eagle`, docs/conformance.md); the slow test rebuilds the same layer on the real SmolLM2, passes
it through the authors' file format and replays every prompt on the same static tree."""
from __future__ import annotations

import json

import pytest
import torch

from models.base import build_tiny_model
from models.engine.trees import TreeBuffers
from models.measure.conformance import accepted_counts, compare_steps, paths_tree
from models.methods.eagle.seeded import seeded_eagle_module
from pipelines.common import REPO_ROOT

GOLDEN = REPO_ROOT / "tests" / "golden" / "eagle_conformance.json"


def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def test_the_golden_tree_is_eagle_llms_static_25_node_tree():
    g = golden()
    buf = TreeBuffers.build(paths_tree(g["tree"]["name"], g["tree"]["paths"]))
    assert buf.num_tokens == 26 and buf.spec.depth == 5
    assert [len(buf.children[i]) for i in buf.children[0]] == [3, 2, 2, 1]       # [0] [1] [2] [3]


def test_the_golden_file_is_informative():
    g = golden()
    assert len(g["steps"]) == len(g["prompts"]) == len(g["output_tokens"])
    counts = [c for steps in g["steps"] for c in accepted_counts(steps)]
    assert sum(c > 0 for c in counts) > 0, "no step accepted a draft: the comparison says little"
    for steps, out in zip(g["steps"], g["output_tokens"]):
        assert [t for s in steps for t in s] == out
        assert len(out) >= g["max_new_tokens"] or 2 in steps[-1]


def test_the_seeded_layer_is_reproducible_and_passes_the_feature_on():
    model, _ = build_tiny_model("llama", seed=0)
    a, b = seeded_eagle_module(model, 3), seeded_eagle_module(model, 3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    h = model.config.hidden_size
    w = a.fc.weight.detach()
    assert w.shape == (h, 2 * h)
    assert torch.allclose(w[:, h:], torch.eye(h), atol=0.2) and w[:, :h].abs().max() < 0.2
    assert not torch.equal(seeded_eagle_module(model, 4).fc.weight, w)


def test_the_eagle_harness_summary_names_the_question_and_step_of_a_mismatch():
    from pipelines.conformance_eagle import summarize

    runs = {"ours": [2.0, 3.0], "official": [1.0, 1.0]}
    same = {"question_id": 1, "ours": [[5, 6], [7]], "official": [[5, 6], [7]]}
    differ = {"question_id": 2, "ours": [[5], [6, 7]], "official": [[5], [6], [7]]}
    out = summarize({"runs": runs, "steps": [same, differ], "checks": {}}, None, 3)
    assert not out["identical"] and out["steps_compared"] == 4 and out["steps_identical"] == 3
    assert out["first_mismatch"] == {"question_id": 2, "step": 1, "ours": [6, 7], "theirs": [6]}
    assert out["ours_over_official_paired"] == {"median": 2.5, "min": 2.0, "max": 3.0}


@pytest.mark.slow
def test_our_eagle_decoder_takes_the_official_steps(smollm_dir, tmp_path):
    from models.base import load_base_model
    from models.engine.path_choice import prepare_for_decoding
    from models.methods import import_heads
    from models.methods.eagle.drafter import EagleDrafter
    from models.methods.eagle.eagle_format import write_eagle_module
    from models.measure.conformance import record_steps

    g = golden()
    before = torch.get_num_threads()
    torch.set_num_threads(g.get("threads", 2))             # as the golden run (float sums depend on it)
    try:
        model, tok = load_base_model(str(smollm_dir))
        prepare_for_decoding(model)
        write_eagle_module(seeded_eagle_module(model, g["seed"], g["scale"]), model, tmp_path)
        eagle = import_heads(tmp_path, model, "eagle").eagle                  # the file the official code read
        tree = paths_tree(g["tree"]["name"], g["tree"]["paths"])
        drafter = EagleDrafter(eagle, tree)
        for prompt, official in zip(g["prompts"], g["steps"]):
            ours = record_steps(model, drafter, prompt["ids"], g["max_new_tokens"], tok.eos_token_id)["steps"]
            result = compare_steps(ours, official)
            assert result["identical"], f"question {prompt['question_id']}: {result['first_mismatch']}"
    finally:
        torch.set_num_threads(before)
