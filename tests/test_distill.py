"""Distillation data: greedy batches equal generate() alone, relabels are the model's argmax, runs resume exactly."""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset, DatasetDict, load_from_disk

from models.data.conversations import IGNORE_INDEX, tokenize_conversation
from models.data.distill_gen import GenerationSettings, Generated, HFGenerator, chat_prompt, replay_conversations
from models.data.relabel import relabel_conversations
from models.data import shards
from pipelines import distill
from pipelines.prepare import FEATURES
from tests.fields import without


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


class Spy:
    """Which conversations each generation call and each relabel call of a distill run served (read back from
    their tokens: the prepared questions name their conversation); run(cfg, kill={"gen": n}) raises
    KeyboardInterrupt at that run's n-th generation call instead (or relabel call), as a kill would."""

    def __init__(self, monkeypatch, tokenizer):
        self.tokenizer, self.calls, self.kill = tokenizer, {}, {}
        real_gen, real_relabel = HFGenerator.__call__, distill.relabel_conversations

        def gen(generator, prompts, seed, on_batch=None):
            self.record("gen", prompts)
            return real_gen(generator, prompts, seed, on_batch)

        def relabel(model, input_ids, *args, **kwargs):
            self.record("relabel", input_ids)
            return real_relabel(model, input_ids, *args, **kwargs)

        monkeypatch.setattr(HFGenerator, "__call__", gen)
        monkeypatch.setattr(distill, "relabel_conversations", relabel)

    def record(self, kind: str, token_lists) -> None:
        ids = []
        for tokens in token_lists:
            split, i = re.search(r"(train|val) question (\d+)\?", self.tokenizer.decode(list(tokens))).groups()
            ids.append(f"{split}{i}_0")
        self.calls[kind].append(ids)
        if self.kill.get(kind) == len(self.calls[kind]):
            raise KeyboardInterrupt(f"simulated kill in {kind} call {len(self.calls[kind])}")

    def run(self, cfg, kill: dict | None = None) -> dict | None:
        self.calls, self.kill = {"gen": [], "relabel": []}, kill or {}
        if not kill:
            return distill.run_distill(cfg)
        with pytest.raises(KeyboardInterrupt, match="simulated kill"):
            distill.run_distill(cfg)

    def served(self, kind: str) -> Counter:
        """How many calls of the last run each conversation was in."""
        return Counter(cid for call in self.calls[kind] for cid in call)


def shard_folder(cfg) -> Path:
    return Path(cfg.paths.data) / "distill-shards" / cfg.model.name


def shard_files(cfg) -> dict[str, bytes]:
    """{"self/train/shard-00000.jsonl": content, ...}: every finished shard file of both sources."""
    folder = shard_folder(cfg)
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.glob("*/*/shard-*.jsonl"))}


def manifest_entries(cfg) -> dict[str, dict]:
    """{"self/train/shard-00000": entry without its timing, ...} of both sources' manifests."""
    out = {}
    for source in distill.SOURCES:
        manifest = json.loads((shard_folder(cfg) / source / "manifest.json").read_text())
        out.update({f"{source}/{key}": {k: v for k, v in entry.items() if k != "seconds"}
                    for key, entry in manifest["shards"].items()})
    return out


def shard_work(whole_entries: dict, source: str, keys, turns: int) -> Counter:
    """The calls the shards `keys` of a source cost, per conversation: `turns` generation calls each for
    self (one per user turn), one relabel call for relabel."""
    return Counter({cid: turns for key in keys for cid in whole_entries[f"{source}/{key}"]["ids"]})


TIMINGS = ("generation_s", "new_tokens_per_s", "relabel_s", "tokens_per_s", "positions_per_s", "wall_time_s",
           "shards_generated_now", "shards_relabelled_now", "date")     # date: the run record's (run_record)


def without_timings(stats: dict) -> dict:
    """The run's report less what depends on the clock or on what this very run produced."""
    return without(stats, TIMINGS)


@pytest.fixture
def resume_case(distill_cfg, tmp_path, tiny_tokenizer, monkeypatch):
    """(spy, uninterrupted cfg, its report, its manifest entries, cfg of the run to kill and resume).

    The uninterrupted run: 4 self shards (train 3+3+2, val 2 conversations) of 2 generation calls each (one
    per user turn, none dropped), and relabel shards of 1 relabel call each."""
    spy = Spy(monkeypatch, tiny_tokenizer)
    whole = distill_cfg(f"paths.data={tmp_path / 'whole'}", f"paths.reports={tmp_path / 'whole_reports'}")
    stats = spy.run(whole)
    entries = manifest_entries(whole)
    self_keys = [k.split("/", 1)[1] for k in entries if k.startswith("self/")]
    relabel_keys = [k.split("/", 1)[1] for k in entries if k.startswith("relabel/")]
    assert self_keys == ["train/shard-00000", "train/shard-00001", "train/shard-00002", "val/shard-00000"]
    assert len(relabel_keys) >= 2 and stats["self"]["turns_dropped"] == 0
    assert len(spy.calls["gen"]) == 8 and spy.served("gen") == shard_work(entries, "self", self_keys, 2)
    assert (len(spy.calls["relabel"]) == len(relabel_keys)
            and spy.served("relabel") == shard_work(entries, "relabel", relabel_keys, 1))
    return spy, whole, stats, entries, distill_cfg()


def assert_resumed_to_the_uninterrupted_run(cfg, resumed: dict, whole, stats: dict, entries: dict) -> None:
    """Same shard files (no record lost or written twice), same manifest entries (stats included), no temporary
    file left, the same dataset records in the same order, the same report."""
    assert not list(shard_folder(cfg).rglob("*.tmp"))
    assert shard_files(cfg) == shard_files(whole)
    assert manifest_entries(cfg) == entries
    assert dataset_rows(cfg.data.distilled_dir) == dataset_rows(whole.data.distilled_dir)
    assert without_timings(resumed) == without_timings(stats)


def test_both_sources_resume_after_kills_to_the_uninterrupted_dataset(resume_case):
    spy, whole, stats, entries, cfg = resume_case
    relabel_keys = [k.split("/", 1)[1] for k in entries if k.startswith("relabel/")]
    # 1) killed in the 3rd self shard's first call: train shards 0 and 1 finished, no relabel yet
    spy.run(cfg, kill={"gen": 5})
    assert not list(shard_folder(cfg).rglob("*.tmp"))
    assert list(shard_files(cfg)) == ["self/train/shard-00000.jsonl", "self/train/shard-00001.jsonl"]
    # 2) rerun, killed in the 2nd relabel call: only the self shards left over were generated
    spy.run(cfg, kill={"relabel": 2})
    assert len(spy.calls["gen"]) == 4
    assert spy.served("gen") == shard_work(entries, "self", ["train/shard-00002", "val/shard-00000"], 2)
    assert spy.calls["relabel"][0] == entries["relabel/train/shard-00000"]["ids"]   # then killed in the next one
    assert not list(shard_folder(cfg).rglob("*.tmp"))
    finished = {p: (p.stat().st_ino, p.read_bytes()) for p in shard_folder(cfg).glob("*/*/shard-*.jsonl")}
    assert len(finished) == 5                                                       # all 4 self + 1 relabel shard
    # 3) rerun to the end: no generation, the relabel shards after the first only
    resumed = spy.run(cfg)
    assert spy.calls["gen"] == [] and len(spy.calls["relabel"]) == len(relabel_keys) - 1
    assert spy.served("relabel") == shard_work(entries, "relabel", relabel_keys[1:], 1)
    for path, (inode, content) in finished.items():    # finished shards were not written again
        assert (path.stat().st_ino, path.read_bytes()) == (inode, content)
    assert resumed["self"]["shards_generated_now"] == 0
    assert resumed["relabel"]["shards_relabelled_now"] == resumed["relabel"]["shards"] - 1
    assert_resumed_to_the_uninterrupted_run(cfg, resumed, whole, stats, entries)


class KillInShardWrite:
    """models.data.shards' `os` (it writes distill's shards) whose fsync, at the n-th shard write of a run,
    kills it: the shard's temporary file stays behind whole (flushed, not renamed) or, partial=True, cut in
    half as if the kill came mid-write."""

    def __init__(self, n: int, partial: bool):
        self.n, self.partial, self.writes = n, partial, 0

    def __getattr__(self, name):
        return getattr(os, name)

    def fsync(self, fd: int) -> None:
        self.writes += 1
        if self.writes == self.n:
            if self.partial:
                os.ftruncate(fd, os.fstat(fd).st_size // 2)
            raise KeyboardInterrupt("simulated kill in a shard write")
        os.fsync(fd)


@pytest.mark.parametrize("partial", [False, True], ids=["whole_tmp", "partial_tmp"])
def test_a_leftover_temporary_shard_is_made_again(resume_case, monkeypatch, partial):
    spy, whole, stats, entries, cfg = resume_case
    relabel_keys = [k.split("/", 1)[1] for k in entries if k.startswith("relabel/")]
    # killed in the write of the 2nd self shard, before its rename
    monkeypatch.setattr(shards, "os", KillInShardWrite(2, partial))
    with pytest.raises(KeyboardInterrupt, match="simulated kill"):
        spy.run(cfg)
    monkeypatch.setattr(shards, "os", os)
    tmp = shard_folder(cfg) / "self" / "train" / "shard-00001.jsonl.tmp"
    left = tmp.read_bytes()
    whole_shard = shard_files(whole)["self/train/shard-00001.jsonl"]
    assert (left == whole_shard) if not partial else (0 < len(left) < len(whole_shard))
    assert list(shard_files(cfg)) == ["self/train/shard-00000.jsonl"]
    # the rerun makes the shard again (and those after it), not shard 0
    resumed = spy.run(cfg)
    assert len(spy.calls["gen"]) == 6
    assert spy.served("gen") == shard_work(entries, "self", ["train/shard-00001", "train/shard-00002",
                                                             "val/shard-00000"], 2)
    assert len(spy.calls["relabel"]) == len(relabel_keys)
    assert resumed["self"]["shards_generated_now"] == 3
    assert_resumed_to_the_uninterrupted_run(cfg, resumed, whole, stats, entries)


@pytest.mark.parametrize("source, key", [("self", "train/shard-00001"), ("relabel", "train/shard-00000")])
def test_a_kill_between_the_shard_rename_and_its_manifest_write(resume_case, monkeypatch, source, key):
    """The shard is in place, its manifest entry (with its stats) is not: the rerun makes it again, so that
    neither a record nor the shard's stats in the report are lost, and no record is there twice."""
    spy, whole, stats, entries, cfg = resume_case
    keys = {s: [k.split("/", 1)[1] for k in entries if k.startswith(f"{s}/")] for s in distill.SOURCES}
    real_write = distill.ShardStore._write_manifest

    def write_then_kill(store):
        if store.folder.name == source and key in store.manifest["shards"]:
            raise KeyboardInterrupt("simulated kill before the manifest write")
        real_write(store)

    monkeypatch.setattr(distill.ShardStore, "_write_manifest", write_then_kill)
    with pytest.raises(KeyboardInterrupt, match="simulated kill"):
        spy.run(cfg)
    monkeypatch.setattr(distill.ShardStore, "_write_manifest", real_write)
    assert f"{source}/{key}.jsonl" in shard_files(cfg)                               # renamed into place
    manifest = json.loads((shard_folder(cfg) / source / "manifest.json").read_text())
    assert key not in manifest["shards"]                                               # its entry not written
    resumed = spy.run(cfg)
    # the shard without a manifest entry and those after it are made again, the others are not
    later = keys[source][keys[source].index(key):]
    again = {"self": later if source == "self" else [], "relabel": later if source == "relabel" else keys["relabel"]}
    assert len(spy.calls["gen"]) == 2 * len(again["self"])
    assert spy.served("gen") == shard_work(entries, "self", again["self"], 2)
    assert len(spy.calls["relabel"]) == len(again["relabel"])
    assert spy.served("relabel") == shard_work(entries, "relabel", again["relabel"], 1)
    assert resumed["self"]["shards_generated_now"] == len(again["self"])
    assert resumed["relabel"]["shards_relabelled_now"] == len(again["relabel"])
    assert_resumed_to_the_uninterrupted_run(cfg, resumed, whole, stats, entries)


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
