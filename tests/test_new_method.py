"""Adding a method is one package, one entry in models.methods.METHODS and one config: tests/toy_method declares a
family, a training module and a proposer (a bigram table that drafts a chain) in one Method, and its config goes through the train stage and the evaluate stage as any
method's does; every greedy answer equals the baseline's token for token."""
from __future__ import annotations

import json
import math

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

import tests.toy_method as toy
from models.base import build_tiny_model
from models.engine.acceptance import SamplingConfig
from models.engine.drafting import DraftContext, make_drafter
from models.engine.trees import tree_from_config
from models.methods import load_heads
from pipelines.common import CONF_DIR
from tests.test_evaluate import QUESTIONS
from tests.test_training import save_distilled


def toy_cfg(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    qfile = tmp_path / "questions.jsonl"
    qfile.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    overrides = ["model=tiny_random", "profile=smoke", f"paths.results={tmp_path / 'results'}",
                 f"paths.data={tmp_path / 'data'}", f"paths.reports={tmp_path / 'reports'}",
                 f"data.questions_file={qfile}", "profile.train.batch_positions=100",
                 "profile.train.draft_vocab_size=64", "profile.train.max_length=96", "profile.train.progress_bar=false",
                 "profile.eval.num_questions=null", "profile.eval.turns=1", "profile.eval.max_new_tokens=16",
                 "profile.eval.repeats=1", "profile.eval.warmup=0", "profile.eval.trees=[chain4,sparse64]",
                 "profile.eval.tree_questions=null", "eval.num_threads=1"]
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    with open_dict(cfg):
        cfg.heads = OmegaConf.create(toy.CONFIG)            # the method's one config, as conf/heads/<name>.yaml
    save_distilled(cfg.data.distilled_dir)
    return cfg


def test_a_toy_method_trains_and_evaluates_through_the_stages(tmp_path, monkeypatch):
    with toy.listed():
        through_the_stages(tmp_path, monkeypatch)


def through_the_stages(tmp_path, monkeypatch):
    from pipelines.evaluate import run_evaluation
    from pipelines.train import run_train

    cfg = toy_cfg(tmp_path, monkeypatch)
    metrics = run_train(cfg)
    assert metrics["family"] == toy.NAME and metrics["kind"] == toy.NAME
    # the summed loss of the 4 depths, below a table of zeros' (uniform over the 64 draft tokens at every depth)
    assert metrics["val_loss"] < 4 * math.log(64)
    _, heads = load_heads(tmp_path / "results" / "heads" / toy.NAME, build_tiny_model()[0])
    assert heads.lookup.weight.abs().sum() > 0                          # trained: the table moved off zero
    cfg.eval.methods = "heads"
    summary = run_evaluation(cfg)
    assert set(summary["methods"]) == {"baseline", f"{toy.NAME}-chain4", f"{toy.NAME}-sparse64"}
    report = json.loads((tmp_path / "results" / "eval" / toy.NAME / "lossless_report.json").read_text())
    assert report["passed"] and report["methods"][f"{toy.NAME}-chain4"]["identical"] == len(QUESTIONS)
    assert all(summary["methods"][f"{toy.NAME}-{t}"]["accept_length"]["mean"] >= 1.0 for t in ("chain4", "sparse64"))
    # what the decoder verified is the toy's chain: from any root, the table's argmax, token after token
    drafter = make_drafter({"kind": "heads", "tree": tree_from_config({"kind": "chain", "depth": 4})}, heads=heads)
    drafter.start(DraftContext(torch.tensor([5, 6]), torch.zeros(2, 64), SamplingConfig()))
    chain, token = [], 7
    for _ in range(4):
        token = int(heads.draft_ids[heads.lookup.weight[token].argmax()])
        chain.append(token)
    assert drafter.draft(7, 4).tokens.tolist() == [7, *chain]


@pytest.mark.parametrize("base, method", [
    ("models.shared.autoregressive.draft:AutoregressiveDraft", "inputs"),
    ("models.shared.autoregressive.heads:AutoregressiveFamily", "build_draft"),
    ("models.shared.heads_proposer:HeadsProposer", "scores"),
])
def test_a_base_class_names_the_method_a_new_method_must_write(base, method):
    """The bases' placeholders are abstract: a subclass without its own stops where it is made, naming the method
    (not at its first draft, deep in a decode), and every shipped subclass has its own."""
    import importlib

    import models.methods  # noqa: F401  (every shipped method's subclasses loaded)

    module, name = base.split(":")
    cls = getattr(importlib.import_module(module), name)
    assert cls.__abstractmethods__ == frozenset({method})
    with pytest.raises(TypeError, match=f"abstract method.*{method}"):
        type(f"Incomplete{name}", (cls,), {})()
    found, todo = [], list(cls.__subclasses__())
    while todo:
        found.append(todo.pop())
        todo += found[-1].__subclasses__()
    shipped = [c for c in found if c.__module__.startswith("models.")]          # not the incomplete one above
    assert shipped and [c.__name__ for c in shipped if c.__abstractmethods__] == []
