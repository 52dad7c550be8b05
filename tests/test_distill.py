"""Distillation data: greedy batches equal generate() alone, relabels are the model's argmax, runs resume exactly."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset, DatasetDict, load_from_disk

from models.data.conversations import IGNORE_INDEX, tokenize_conversation
from models.data.distill_gen import GenerationSettings, Generated, HFGenerator, chat_prompt, replay_conversations
from models.data.relabel import relabel_conversations
from pipelines import distill
from pipelines.prepare import FEATURES


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py: tiny tensors run fastest on one thread


def write_prepared(path, tokenizer, n_train=16, n_val=2):
    """A prepared DatasetDict in prepare's format: short two-turn conversations."""
    parts = {}
    for split, n in (("train", n_train), ("val", n_val)):
        rows = {"id": [], "messages": [], "input_ids": [], "labels": []}
        for i in range(n):
            msgs = [{"role": "user", "content": f"{split} question {i}?"}, {"role": "assistant", "content": "an answer"},
                    {"role": "user", "content": f"and {i}?"}, {"role": "assistant", "content": "more" * (i % 3 + 1)}]
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
    expected = len(chat_prompt(tiny_tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first},
                                                 {"role": "user", "content": "go on"}]))
    assert convs[0][3]["content"] == f"len{expected}"
    assert convs[1] == [] and stats["turns_dropped"] == 1 and stats["turns"] == 2


def generate_alone(model, prompt: list[int], max_new_tokens: int, eos: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
    return out[0, len(prompt):].tolist()


def test_greedy_batches_equal_generate_alone(tiny_model):
    model, tok = tiny_model
    prompts = [tok.encode(text, add_special_tokens=False) for text in
               ("a", "hello world", "xyz", "a longer prompt here", "b", "qq", "the end")]
    # a second end-of-turn token the random model writes early for some prompts, so rows leave batches mid-way
    free = [generate_alone(model, p, 8, [tok.eos_token_id]) for p in prompts]
    early = next(t for out in free for t in out[1:4] if sum(t in o for o in free) < len(prompts))
    model.generation_config.eos_token_id = [tok.eos_token_id, early]
    alone = [generate_alone(model, p, 8, [tok.eos_token_id, early]) for p in prompts]
    for batch_size, workers in ((1, 1), (3, 1), (7, 1), (3, 2), (7, 2)):
        gen = HFGenerator(model, tok, GenerationSettings(max_new_tokens=8, temperature=0.0, batch_size=batch_size,
                                                         workers=workers))
        got = gen(prompts, seed=0)
        for g, ref in zip(got, alone):
            n = next((j for j, t in enumerate(ref) if t in (tok.eos_token_id, early)), None)
            assert g.tokens == ref[:n] and g.finished == (n is not None)
    assert any(g.finished for g in got) and not all(g.finished for g in got)   # rows did leave the batch early


def test_sampling_is_seeded_per_batch_and_top_p_near_zero_is_greedy(tiny_model):
    model, tok = tiny_model
    prompts = [tok.encode(t, add_special_tokens=False) for t in ("one", "two words", "3")]
    sample = HFGenerator(model, tok, GenerationSettings(max_new_tokens=6, temperature=1.0, batch_size=2))
    in_threads = HFGenerator(model, tok, GenerationSettings(max_new_tokens=6, temperature=1.0, batch_size=2, workers=2))
    first = [g.tokens for g in sample(prompts, seed=5)]
    assert first == [g.tokens for g in sample(prompts, seed=5)] == [g.tokens for g in in_threads(prompts, seed=5)]
    assert first != [g.tokens for g in sample(prompts, seed=6)]
    narrow = HFGenerator(model, tok, GenerationSettings(max_new_tokens=6, temperature=1.0, top_p=1e-6, batch_size=2))
    greedy = HFGenerator(model, tok, GenerationSettings(max_new_tokens=6, temperature=0.0, batch_size=2))
    assert [g.tokens for g in narrow(prompts, seed=1)] == [g.tokens for g in greedy(prompts, seed=0)]


def test_relabels_are_the_models_own_argmax(tiny_model):
    model, tok = tiny_model
    convs = [[{"role": "user", "content": "q" * n}, {"role": "assistant", "content": "answer " * (n % 4 + 1)}]
             for n in (3, 30, 7, 12)]
    convs[1].append({"role": "user", "content": "a last question, never answered"})
    ids, labels = zip(*[tokenize_conversation(tok, c, 256)[:2] for c in convs])
    new, stats = relabel_conversations(model, list(ids), list(labels), batch_tokens=2 * max(map(len, ids)),
                                       head_rows=5, workers=2)   # several batches, right padding, LM-head chunks
    for x, y, z in zip(ids, labels, new):
        with torch.no_grad():
            argmax = model(torch.tensor([x])).logits[0].argmax(-1).tolist()          # [T]: prediction of t+1
        expected = [argmax[t - 1] if t > 0 and y[t] != IGNORE_INDEX else IGNORE_INDEX for t in range(len(x))]
        assert z == expected and len(z) == len(x)
    assert stats["positions"] == sum(l != IGNORE_INDEX for y in labels for l in y[1:])
    last_answer = [max(t for t, l in enumerate(y) if l != IGNORE_INDEX) for y in labels]
    assert stats["tokens"] == sum(last_answer) <= stats["padded_tokens"]   # forwarded up to the last answer token


@pytest.fixture
def distill_cfg(compose_cfg, tiny_tokenizer):
    """Self: 8 train + 2 val conversations in shards of 3; relabel: train conversations for 60 positions."""
    def make(*extra):
        cfg = compose_cfg("profile=smoke", "profile.distill.num_conversations=10", "profile.distill.val_conversations=2",
                          "profile.distill.shard_size=3", "profile.distill.batch_size=2",
                          "profile.distill.max_new_tokens=4", "profile.distill.max_turns=2",
                          "profile.distill.max_prompt_tokens=200", "profile.distill.relabel_positions=60",
                          "profile.distill.relabel_batch_tokens=256", *extra)
        if not Path(cfg.data.prepared_dir).is_dir():
            write_prepared(cfg.data.prepared_dir, tiny_tokenizer)
        return cfg
    return make


def dataset_rows(folder) -> dict:
    out = load_from_disk(str(folder))
    return {split: out[split].to_list() for split in out}


def test_both_sources_resume_after_kills_to_the_uninterrupted_dataset(distill_cfg, tmp_path, monkeypatch):
    whole = distill_cfg(f"paths.data={tmp_path / 'whole'}", f"paths.reports={tmp_path / 'whole_reports'}")
    stats = distill.run_distill(whole)
    cfg = distill_cfg()
    # 1) killed in the 3rd self shard, 2) killed in the 2nd relabel shard, 3) finished
    real_gen, real_relabel = HFGenerator.__call__, distill.relabel_conversations
    calls = {"gen": 0, "relabel": 0}

    def gen_then_kill(self, prompts, seed, on_batch=None):
        calls["gen"] += 1
        if calls["gen"] == 5:
            raise KeyboardInterrupt("simulated kill")
        return real_gen(self, prompts, seed, on_batch)

    def relabel_then_kill(*args, **kwargs):
        calls["relabel"] += 1
        if calls["relabel"] == 2:
            raise KeyboardInterrupt("simulated kill")
        return real_relabel(*args, **kwargs)

    monkeypatch.setattr(HFGenerator, "__call__", gen_then_kill)
    monkeypatch.setattr(distill, "relabel_conversations", relabel_then_kill)
    shards = Path(cfg.paths.data) / "distill-shards" / cfg.model.name
    finished = []
    for _ in range(2):
        with pytest.raises(KeyboardInterrupt):
            distill.run_distill(cfg)
        assert not list(shards.glob("*/*/*.tmp"))
        finished.append({p: p.read_bytes() for p in shards.glob("*/*/shard-*.jsonl")})
    assert len(finished[0]) == 2 and all(p.parts[-3] == "self" for p in finished[0])   # 2 self shards, no relabel yet
    assert len(finished[1]) == 5                                                       # all 4 self + 1 relabel shard
    resumed = distill.run_distill(cfg)
    for path, content in finished[1].items():          # finished shards were not written again
        assert path.read_bytes() == content
    assert resumed["relabel"]["shards_relabelled_now"] == resumed["relabel"]["shards"] - 1
    assert dataset_rows(cfg.data.distilled_dir) == dataset_rows(whole.data.distilled_dir)
    for key in ("train", "val"):
        assert resumed[key] == stats[key]


def test_sources_are_disjoint_and_val_is_self_distilled_only(distill_cfg):
    cfg = distill_cfg()
    stats = distill.run_distill(cfg)
    out = load_from_disk(cfg.data.distilled_dir)
    prepared = load_from_disk(cfg.data.prepared_dir)
    assert set(out["val"]["source"]) == {"self"} and set(out["train"]["source"]) == {"self", "relabel"}
    by_source = {s: [r for r in out["train"] if r["source"] == s] for s in ("self", "relabel")}
    ids = {s: {r["id"] for r in rows} for s, rows in by_source.items()}
    assert not ids["self"] & ids["relabel"] and not set(out["val"]["id"]) & ids["relabel"]
    # self rows: the model's own answers are the labels; relabel rows: prepared input_ids, other labels
    row = by_source["self"][0]
    msgs = json.loads(row["messages"])
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"] and msgs[1]["content"] != "an answer"
    labels, inputs = np.asarray(row["labels"]), np.asarray(row["input_ids"])
    assert np.array_equal(labels[labels != IGNORE_INDEX], inputs[labels != IGNORE_INDEX])
    source_rows = {r["id"]: r for r in prepared["train"]}
    for row in by_source["relabel"]:
        assert row["input_ids"] == source_rows[row["id"]]["input_ids"] and row["messages"] == source_rows[row["id"]]["messages"]
        assert [l == IGNORE_INDEX for l in row["labels"]] == [l == IGNORE_INDEX for l in source_rows[row["id"]]["labels"]]
    # counts and shares in the report
    train = stats["train"]
    assert train["relabel"]["answer_positions"] >= 60 and stats["relabel"]["positions"] == train["relabel"]["answer_positions"]
    assert train["self"]["conversations"] == 8 and train["relabel"]["conversations"] == len(ids["relabel"])
    assert train["self"]["answer_positions"] + train["relabel"]["answer_positions"] == train["answer_positions"]
    assert train["self"]["share"] + train["relabel"]["share"] == pytest.approx(1.0, abs=1e-3)
    assert stats["val"]["relabel"]["conversations"] == 0


def test_a_settings_change_regenerates_only_its_source(distill_cfg):
    cfg = distill_cfg()
    distill.run_distill(cfg)
    cfg.profile.distill.max_new_tokens = 3
    stats = distill.run_distill(cfg)
    assert stats["self"]["shards_generated_now"] == 4 and stats["relabel"]["shards_relabelled_now"] == 0
    cfg.profile.distill.relabel_positions = 90
    stats = distill.run_distill(cfg)
    assert stats["self"]["shards_generated_now"] == 0 and stats["relabel"]["shards_relabelled_now"] >= 1
    assert stats["train"]["self"]["conversations"] == 8


def test_shards_keep_records_with_unicode_line_separators(tmp_path):
    """ShareGPT text holds U+2028 and U+0085, which json.dumps(ensure_ascii=False) writes raw: a shard must still
    read back one record per line (str.splitlines() would cut them, as a cpu-profile run found)."""
    from pipelines.distill import ShardStore

    records = [{"id": "a", "text": "line\u2028separator"}, {"id": "b", "text": "next\x85line\x1cfile"}]
    store = ShardStore(tmp_path / "shards", "f" * 16, {"shard_size": 2})
    store.write("train", 0, records, {"new_tokens": 3})
    again = ShardStore(tmp_path / "shards", "f" * 16, {"shard_size": 2})
    assert again.read("train", 0) == records and again.read_all("train", ["a", "b"]) == records
