"""Self-distillation: replayed turns see the model's own answers; an interrupted run resumes exactly."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from datasets import Dataset, DatasetDict, load_from_disk

from models.conversations import IGNORE_INDEX, tokenize_conversation
from models.distill_gen import GenerationSettings, Generated, HFGenerator, replay_conversations
from pipelines import distill
from pipelines.prepare import FEATURES


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread is faster than two, and the two cores are shared with other work."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def write_prepared(path, tokenizer, n_train=9, n_val=2):
    """A prepared DatasetDict in prepare's format: short two-turn conversations."""
    parts = {}
    for split, n in (("train", n_train), ("val", n_val)):
        rows = {"id": [], "messages": [], "input_ids": [], "labels": []}
        for i in range(n):
            msgs = [{"role": "user", "content": f"{split} question {i}?"}, {"role": "assistant", "content": "an answer"},
                    {"role": "user", "content": f"and {i}?"}, {"role": "assistant", "content": "more"}]
            ids, labels, _ = tokenize_conversation(tokenizer, msgs, 256)
            rows["id"].append(f"{split}{i}_0")
            rows["messages"].append(json.dumps(msgs))
            rows["input_ids"].append(ids)
            rows["labels"].append(labels)
        parts[split] = Dataset.from_dict(rows, features=FEATURES)
    DatasetDict(parts).save_to_disk(str(path))


class EchoGenerator:
    """Answers each prompt with its own length (as text), so a test can read what the model saw."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, prompts, seed, on_batch=None):
        return [Generated(self.tokenizer.encode(f"len{len(p)}", add_special_tokens=False), True) for p in prompts]


def test_later_turns_see_the_models_own_answers(tiny_tokenizer):
    convs, stats = replay_conversations(EchoGenerator(tiny_tokenizer), tiny_tokenizer, [["hi", "go on"], ["x" * 200]],
                                        max_prompt_tokens=100, seed=0)
    assert [m["role"] for m in convs[0]] == ["user", "assistant", "user", "assistant"]
    first = convs[0][1]["content"]
    # turn 2's prompt = template(user, the model's answer, user): its length is what the echo reports
    from models.distill_gen import chat_prompt
    expected = len(chat_prompt(tiny_tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first},
                                                 {"role": "user", "content": "go on"}]))
    assert convs[0][3]["content"] == f"len{expected}"
    assert convs[1] == [] and stats["turns_dropped"] == 1 and stats["turns"] == 2


def test_hf_generator_batches_match_single_prompts(tiny_model):
    model, tok = tiny_model
    gen = HFGenerator(model, tok, GenerationSettings(max_new_tokens=6, temperature=0.0, batch_size=3))
    prompts = [tok.encode("a", add_special_tokens=False), tok.encode("hello world", add_special_tokens=False),
               tok.encode("xyz", add_special_tokens=False)]
    batched = gen(prompts, seed=0)
    single = [gen([p], seed=0)[0] for p in prompts]
    assert [g.tokens for g in batched] == [g.tokens for g in single]   # left padding changes nothing (greedy)
    assert all(len(g.tokens) <= 6 for g in batched)


@pytest.fixture
def distill_cfg(compose_cfg, tiny_tokenizer, tmp_path):
    cfg = compose_cfg("profile=smoke", "profile.distill.num_conversations=10", "profile.distill.shard_size=3",
                      "profile.distill.batch_size=2", "profile.distill.max_new_tokens=4", "profile.distill.max_turns=2",
                      "profile.distill.max_prompt_tokens=200")
    write_prepared(cfg.data.prepared_dir, tiny_tokenizer)
    return cfg


def test_distill_interrupted_resumes_without_loss_or_duplicates(distill_cfg, monkeypatch):
    real_call = HFGenerator.__call__
    calls = {"n": 0}

    def failing(self, prompts, seed, on_batch=None):
        calls["n"] += 1
        if calls["n"] > 5:                      # killed in the middle of the 3rd shard
            raise KeyboardInterrupt("simulated kill")
        return real_call(self, prompts, seed, on_batch)

    monkeypatch.setattr(HFGenerator, "__call__", failing)
    with pytest.raises(KeyboardInterrupt):
        distill.run_distill(distill_cfg)
    shard_dir = distill_cfg.paths.data + "/distill-shards/" + distill_cfg.model.name
    import pathlib
    finished = {p: p.read_bytes() for p in pathlib.Path(shard_dir).glob("*/shard-*.jsonl")}
    assert len(finished) == 2 and not list(pathlib.Path(shard_dir).glob("*/*.tmp"))

    calls["n"] = -1000                          # no more failures; count the calls of the rerun
    stats = distill.run_distill(distill_cfg)
    assert stats["shards_generated_now"] == 2   # 3 train shards + 1 val shard, 2 were already done
    for path, content in finished.items():      # finished shards were not written again
        assert path.read_bytes() == content
    out = load_from_disk(distill_cfg.data.distilled_dir)
    assert set(out) == {"train", "val"} and out["train"].features == FEATURES
    ids = list(out["train"]["id"]) + list(out["val"]["id"])
    assert len(ids) == len(set(ids)) == 10
    assert list(out["train"]["id"]) == [f"train{i}_0" for i in range(8)] and list(out["val"]["id"]) == ["val0_0", "val1_0"]
    row = out["train"][0]
    msgs = json.loads(row["messages"])
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"] and msgs[1]["content"] != "an answer"
    labels = np.asarray(row["labels"])
    assert (labels != IGNORE_INDEX).any() and (labels == IGNORE_INDEX).any()
    assert np.array_equal(labels[labels != IGNORE_INDEX], np.asarray(row["input_ids"])[labels != IGNORE_INDEX])


def test_distill_settings_change_starts_over(distill_cfg):
    distill.run_distill(distill_cfg)
    distill_cfg.profile.distill.max_new_tokens = 3
    stats = distill.run_distill(distill_cfg)
    assert stats["shards_generated_now"] == 4 and stats["train"]["conversations"] == 8
