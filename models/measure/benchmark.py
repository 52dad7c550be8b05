"""MT-Bench speed benchmark, framework-free parts: questions, prompts, per-turn records, Spec-Bench
metrics, the losslessness comparison and transformers' prompt lookup as a reference. `pipelines/evaluate.py`
drives it.

    questions = load_questions("artifacts/raw/mt_bench_question.jsonl", num_questions=16)
    ids = chat_input_ids(tok, ["Hi!"], [])                       # turn 1 prompt (chat template)
    rec = TurnRecord.from_generation(q, turn=1, method="pld_hf", run=0, result=prompt_lookup_generate(...))
    summary = summarize_method(runs_of_method, runs_of_baseline)  # speedups, accept length, per category

Metrics follow Spec-Bench (REFERENCE.md section 4): per-question throughput = new tokens of all its
turns / their wall time; speedup = mean per-question throughput of a method / the baseline's in the
same run, over the questions both ran; mean accepted tokens = mean over decoding steps of tokens
emitted per step (baseline 1); mean and (population) std over runs. Beside it, the decode-only
speedup: the same ratio with the prefill taken out, i.e. per question the new tokens after the first
/ the time after the prefill (about the same for every method, it dilutes the decoding's share).
"""
from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

from models.measure.intervals import bootstrap_columns

CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


# -- questions and prompts ---------------------------------------------------------------------
@dataclass(frozen=True)
class Question:
    question_id: int
    category: str
    turns: tuple[str, ...]


def load_questions(path: str | Path, num_questions: int | None = None) -> list[Question]:
    """MT-Bench questions from a jsonl file. With num_questions, take the first questions of every
    category in turn (round-robin), so any cut keeps the categories balanced."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"question file {path} does not exist; run `dvc repro assets` first")
    questions = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        missing = {"question_id", "category", "turns"} - row.keys()
        if missing:
            raise ValueError(f"{path}:{line_no} lacks {sorted(missing)}; MT-Bench rows have question_id, category, turns")
        questions.append(Question(int(row["question_id"]), str(row["category"]), tuple(row["turns"])))
    if num_questions is None or num_questions >= len(questions):
        return questions
    if num_questions < 1:
        raise ValueError(f"num_questions must be >= 1 or null (all), got {num_questions}")
    by_cat: dict[str, list[Question]] = defaultdict(list)
    for q in questions:
        by_cat[q.category].append(q)
    picked, depth = [], 0
    while len(picked) < num_questions:
        for cat_questions in by_cat.values():
            if depth < len(cat_questions) and len(picked) < num_questions:
                picked.append(cat_questions[depth])
        depth += 1
    return sorted(picked, key=lambda q: q.question_id)


def chat_input_ids(tokenizer, user_turns: list[str], answers: list[str]) -> list[int]:
    """Chat-template prompt for the next answer: user_turns[i] answered by answers[i]; len(answers) ==
    len(user_turns) - 1 (the last user turn is the one to answer)."""
    if len(answers) != len(user_turns) - 1:
        raise ValueError(f"need one answer per earlier turn: {len(user_turns)} user turns, {len(answers)} answers")
    messages = []
    for i, text in enumerate(user_turns):
        messages.append({"role": "user", "content": text})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):   # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def category_temperature(category: str, mode: str, temperatures: dict) -> float:
    """0 in greedy mode; REFERENCE.md section 4's per-category temperature in category mode."""
    if mode == "greedy":
        return 0.0
    if mode != "category":
        raise ValueError(f"temperature_mode {mode!r} is not known; use greedy or category")
    if category not in temperatures:
        raise ValueError(f"no temperature for category {category!r}; known: {sorted(temperatures)}")
    return float(temperatures[category])


def spread(items: list, n: int | None) -> list:
    """n of the items, evenly spaced over the list (all of them when n is None or >= len(items)): on the
    question list, sorted by id and so by category, a subset that keeps the categories apart."""
    if n is None or n >= len(items):
        return list(items)
    if n < 1:
        raise ValueError(f"a subset needs n >= 1 (or null for all), got {n}")
    return [items[i * len(items) // n] for i in range(n)]


def rotated(items: list, shift: int) -> list:
    """items rotated left by shift: question i runs the methods starting at i mod n, so drift cancels."""
    if not items:
        return []
    shift %= len(items)
    return items[shift:] + items[:shift]


# -- per-turn records --------------------------------------------------------------------------
@dataclass
class TurnRecord:
    question_id: int
    category: str
    turn: int                      # 1-based
    method: str
    run: int
    temperature: float
    new_tokens: int
    wall_time: float               # seconds for the whole turn (prefill included)
    steps: int                     # decoding steps (base-model forward passes after the prefill)
    accept_lengths: list[int]      # tokens emitted by every step
    prefill_time: float = 0.0      # seconds of wall_time until the first new token (the prompt's forward)
    tokens: list[int] = field(default_factory=list, repr=False)   # kept in memory for the lossless check

    @property
    def decode_time(self) -> float:
        """Seconds after the prefill, in which the new tokens after the first were decoded."""
        return self.wall_time - self.prefill_time

    @classmethod
    def from_generation(cls, question: Question, turn: int, method: str, run: int, temperature: float, result):
        """From any object with new_tokens (list), wall_time, prefill_time, steps and accept_lengths
        (GenerationResult, PeerResult)."""
        return cls(question.question_id, question.category, turn, method, run, temperature,
                   len(result.new_tokens), float(result.wall_time), int(result.steps),
                   [int(a) for a in result.accept_lengths], float(result.prefill_time), list(result.new_tokens))

    def as_dict(self, with_tokens: bool = False) -> dict:
        d = {**asdict(self), "decode_time": self.decode_time}
        if not with_tokens:
            d.pop("tokens")
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TurnRecord":
        """The inverse of as_dict(with_tokens=True); a missing field raises KeyError (decode_time is derived)."""
        return cls(**{f.name: d[f.name] for f in fields(cls)})


# -- Spec-Bench metrics ------------------------------------------------------------------------
def mean_std(values: list[float]) -> dict:
    """{"mean", "std", "runs"}; std is the population std (numpy's default, as Spec-Bench)."""
    vals = [float(v) for v in values]
    if not vals:
        return {"mean": None, "std": None, "runs": []}
    m = sum(vals) / len(vals)
    return {"mean": m, "std": (sum((v - m) ** 2 for v in vals) / len(vals)) ** 0.5, "runs": vals}


def question_throughputs(records: list[TurnRecord], decode_only: bool = False) -> dict[int, float]:
    """Per question: new tokens of all its turns / their total wall time (tokens per second).

    decode_only: new tokens after each turn's first / the time after each turn's prefill; a question
    that decoded nothing after its first tokens (answers of one token) has no decode throughput."""
    tokens, times = Counter(), Counter()
    for r in records:
        tokens[r.question_id] += r.new_tokens - 1 if decode_only else r.new_tokens
        times[r.question_id] += r.decode_time if decode_only else r.wall_time
    return {q: tokens[q] / times[q] for q in tokens if times[q] > 0 and tokens[q] > 0}


def mean_throughput(records: list[TurnRecord], questions: set[int] | None = None,
                    decode_only: bool = False) -> float | None:
    tp = question_throughputs(records, decode_only)
    vals = [v for q, v in tp.items() if questions is None or q in questions]
    return sum(vals) / len(vals) if vals else None


def mean_accept_length(records: list[TurnRecord]) -> float | None:
    """Mean over all decoding steps of the tokens each step emitted."""
    lengths = [a for r in records for a in r.accept_lengths]
    return sum(lengths) / len(lengths) if lengths else None


def speedup(method_records: list[TurnRecord], baseline_records: list[TurnRecord],
            questions: set[int] | None = None, decode_only: bool = False) -> float | None:
    """Mean per-question throughput of the method / that of the baseline, over the questions both ran
    (decode_only: both throughputs without the prefill, see question_throughputs)."""
    shared = set(question_throughputs(method_records, decode_only))
    shared &= set(question_throughputs(baseline_records, decode_only))
    if questions is not None:
        shared &= questions
    m = mean_throughput(method_records, shared, decode_only)
    b = mean_throughput(baseline_records, shared, decode_only)
    return m / b if m is not None and b else None


def speedup_on_questions_of(runs: list[list[TurnRecord]], baseline_runs: list[list[TurnRecord]],
                            like_runs: list[list[TurnRecord]]) -> float | None:
    """Mean over runs of the speedup of `runs` on the questions like_runs[i] ran: another method's speedup,
    e.g. prompt lookup's, on the subset of the questions a method ran on (profile.eval.tree_questions)."""
    values = [speedup(recs, base, questions={r.question_id for r in like})
              for recs, base, like in zip(runs, baseline_runs, like_runs)]
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize_method(runs: list[list[TurnRecord]], baseline_runs: list[list[TurnRecord]]) -> dict:
    """Spec-Bench summary of one method. runs[i] and baseline_runs[i] are the records of run i."""
    if len(runs) != len(baseline_runs):
        raise ValueError(f"{len(runs)} runs of the method but {len(baseline_runs)} of the baseline")
    categories = sorted({r.category for run in runs for r in run}, key=_category_order)

    def block(run_filter):
        values = {"speedup": [], "decode_speedup": [], "throughput": [], "decode_throughput": [], "accept_length": []}
        for recs, base in zip(runs, baseline_runs):
            recs, base = run_filter(recs), run_filter(base)
            values["speedup"].append(speedup(recs, base))
            values["decode_speedup"].append(speedup(recs, base, decode_only=True))
            values["throughput"].append(mean_throughput(recs))
            values["decode_throughput"].append(mean_throughput(recs, decode_only=True))
            values["accept_length"].append(mean_accept_length(recs))
        return {k: mean_std([v for v in vals if v is not None]) for k, vals in values.items()}

    out = block(lambda recs: recs)
    out["per_category"] = {c: block(lambda recs, c=c: [r for r in recs if r.category == c]) for c in categories}
    all_recs = [r for run in runs for r in run]
    out["accept_length_histogram"] = {str(k): v for k, v in sorted(Counter(
        a for r in all_recs for a in r.accept_lengths).items())}
    out["new_tokens"] = sum(r.new_tokens for r in all_recs)
    out["wall_time"] = sum(r.wall_time for r in all_recs)
    out["prefill_time"] = sum(r.prefill_time for r in all_recs)
    out["steps"] = sum(r.steps for r in all_recs)
    out["turns"] = len(all_recs)
    out["questions"] = len({r.question_id for r in all_recs})
    out["per_question"] = per_question(runs, baseline_runs)
    out["intervals"] = speed_intervals(out["per_question"])
    return out


def per_question(runs: list[list[TurnRecord]], baseline_runs: list[list[TurnRecord]]) -> dict[str, dict]:
    """{question id (str): its figures over all runs} for the questions both the method and the baseline ran:
    tokens and seconds (end to end and after the prefill) of the method and the baseline, the method's steps and
    the tokens they emitted, and the question's speedups (its throughput over the baseline's) and accepted length.
    What intervals and paired comparisons resample (models/measure/intervals.py)."""
    def totals(recs):
        t = defaultdict(lambda: {"tokens": 0, "time": 0.0, "decode_tokens": 0, "decode_time": 0.0, "steps": 0,
                                 "emitted": 0, "category": None})
        for r in recs:
            q = t[r.question_id]
            q["tokens"] += r.new_tokens
            q["time"] += r.wall_time
            q["decode_tokens"] += r.new_tokens - 1
            q["decode_time"] += r.decode_time
            q["steps"] += len(r.accept_lengths)
            q["emitted"] += sum(r.accept_lengths)
            q["category"] = r.category
        return t

    mine = totals([r for run in runs for r in run])
    base = totals([r for run in baseline_runs for r in run])
    out = {}
    for qid in sorted(set(mine) & set(base)):
        m, b = mine[qid], base[qid]
        if not (m["time"] > 0 and b["time"] > 0 and m["tokens"] and b["tokens"]):
            continue
        row = {"category": m["category"], "tokens": m["tokens"], "time": m["time"], "base_tokens": b["tokens"],
               "base_time": b["time"], "decode_tokens": m["decode_tokens"], "decode_time": m["decode_time"],
               "base_decode_tokens": b["decode_tokens"], "base_decode_time": b["decode_time"],
               "steps": m["steps"], "emitted": m["emitted"],
               "speedup": (m["tokens"] / m["time"]) / (b["tokens"] / b["time"]),
               "accept_length": m["emitted"] / m["steps"] if m["steps"] else None}
        ok = m["decode_tokens"] > 0 and m["decode_time"] > 0 and b["decode_tokens"] > 0 and b["decode_time"] > 0
        row["decode_speedup"] = ((m["decode_tokens"] / m["decode_time"]) / (b["decode_tokens"] / b["decode_time"])
                                 if ok else None)
        out[str(qid)] = row
    return out


def speed_intervals(rows: dict[str, dict], resamples: int = 10_000, level: float = 0.95, seed: int = 0) -> dict:
    """Point figures and bootstrap intervals over questions from per_question rows, three ways to average:

    speedup         Spec-Bench's: mean per-question throughput / the baseline's (the headline figure)
    mean_of_ratios  the mean over questions of each question's throughput ratio
    pooled          all new tokens / all seconds, over the baseline's (long answers weigh more)
    decode_speedup  Spec-Bench's, with the prefill taken out
    accept_length   tokens emitted per decoding step, pooled over the questions' steps
    Each {"value", "ci": [lo, hi] or None}; the questions are resampled together for every figure."""
    rs = list(rows.values())
    if not rs:
        return {}
    col = lambda k: [r[k] for r in rs]      # noqa: E731
    kw = {"resamples": resamples, "level": level, "seed": seed}
    tp = {"m": [r["tokens"] / r["time"] for r in rs], "b": [r["base_tokens"] / r["base_time"] for r in rs]}
    dec = [r for r in rs if r["decode_speedup"] is not None]
    dtp = {"m": [r["decode_tokens"] / r["decode_time"] for r in dec],
           "b": [r["base_decode_tokens"] / r["base_decode_time"] for r in dec]}
    pool = {"t": col("tokens"), "s": col("time"), "bt": col("base_tokens"), "bs": col("base_time")}
    steps = [r for r in rs if r["steps"]]
    acc = {"e": [r["emitted"] for r in steps], "n": [r["steps"] for r in steps]}
    ratio_of_sums = lambda a, b: lambda c: c[a].sum(-1) / c[b].sum(-1)      # noqa: E731
    pooled = lambda c: (c["t"].sum(-1) / c["s"].sum(-1)) / (c["bt"].sum(-1) / c["bs"].sum(-1))   # noqa: E731
    mean = lambda c: c["v"].mean(-1)      # noqa: E731

    def entry(columns, stat):
        if not columns or not len(next(iter(columns.values()))):
            return {"value": None, "ci": None}
        value = float(stat({k: np.asarray(v, dtype=float) for k, v in columns.items()}))
        ci = bootstrap_columns(columns, stat, **kw)
        return {"value": value, "ci": None if ci is None else [ci[0], ci[1]]}

    return {"questions": len(rs), "level": level, "resamples": resamples,
            "speedup": entry(tp, ratio_of_sums("m", "b")),
            "mean_of_ratios": entry({"v": col("speedup")}, mean),
            "pooled": entry(pool, pooled),
            "decode_speedup": entry(dtp, ratio_of_sums("m", "b")),
            "accept_length": entry(acc, ratio_of_sums("e", "n"))}


def _category_order(c: str):
    return (CATEGORIES.index(c) if c in CATEGORIES else len(CATEGORIES), c)


# -- losslessness ------------------------------------------------------------------------------
def first_difference(reference: list[int], tokens: list[int]) -> int | None:
    """Index of the first token where the two sequences differ (a length mismatch counts); None if equal."""
    for i, (a, b) in enumerate(zip(reference, tokens)):
        if a != b:
            return i
    return None if len(reference) == len(tokens) else min(len(reference), len(tokens))


def token_agreement(records: list[TurnRecord], reference: list[TurnRecord]) -> dict:
    """How far one greedy model's answers are from another's on the same prompts (a LoRA-adapted backbone
    against the base): answers identical token for token, and the share of the reference's tokens
    before the first difference (after it the texts shift, so later tokens are not compared)."""
    ref = {(r.run, r.question_id, r.turn): r.tokens for r in reference}
    same, prefix, total, turns = 0, 0, 0, 0
    for r in records:
        other = ref.get((r.run, r.question_id, r.turn))
        if other is None:
            continue
        turns += 1
        pos = first_difference(other, r.tokens)
        same += pos is None
        prefix += len(other) if pos is None else pos
        total += len(other)
    return {"turns": turns, "identical_answers": same, "identical_prefix_share": prefix / total if total else None}


@torch.no_grad()
def greedy_margin(model, prompt_ids: list[int], reference: list[int], position: int, other_token: int | None) -> float | None:
    """Logit of the reference's token at `position` minus that of `other_token`, with the model
    teacher-forced on prompt + reference[:position]. A margin near 0 marks a numerical tie (two
    tokens equally likely up to float rounding), not a decoding bug."""
    if other_token is None or position >= len(reference):
        return None
    ids = torch.tensor([prompt_ids + reference[:position]], device=next(model.parameters()).device)
    logits = model(input_ids=ids).logits[0, -1].float()       # [V]
    return float(logits[reference[position]] - logits[other_token])


# -- prompt lookup decoding in transformers' generate, the reference ----------------------------
@dataclass
class PeerResult:
    new_tokens: list[int]
    wall_time: float
    steps: int
    accept_lengths: list[int]
    prefill_time: float = 0.0


class ForwardCounter:
    """Hooks on the base model: the KV-cache length before every forward call and the time it ended."""

    def __init__(self, model):
        self.cache_lengths: list[int] = []
        self.end_times: list[float] = []
        self._handles = [model.register_forward_pre_hook(self._before, with_kwargs=True),
                         model.register_forward_hook(self._after)]

    def _before(self, module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))    # `cache` from transformers 5.24 on
        self.cache_lengths.append(int(cache.get_seq_length()) if cache is not None else 0)

    def _after(self, module, args, output):
        self.end_times.append(time.perf_counter())

    def remove(self):
        for handle in self._handles:
            handle.remove()


@torch.no_grad()
def prompt_lookup_generate(model, input_ids: list[int], max_new_tokens: int, num_tokens: int = 10,
                           max_ngram: int = 2, temperature: float = 0.0, stop_token_ids=None,
                           pad_token_id: int | None = None) -> PeerResult:
    """transformers' prompt lookup decoding (`prompt_lookup_num_tokens`); steps and tokens per step are
    read from the forward calls: call j (after the prefill) emits cache_len[j+1] - cache_len[j] tokens.

    transformers verifies the first lookup in the prefill call itself (prompt + drafts in one forward):
    when drafts are accepted there, that call counts as a step of its own too (emitting those drafts;
    its bonus is the prefill token). prefill_time is the end of that call (drafts it accepted then count
    as decoded in no time: rare, and in favour of the reference)."""
    stop = list(stop_token_ids or [])
    device = next(model.parameters()).device
    ids = torch.tensor([input_ids], device=device)
    kwargs = dict(do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                  top_p=None, top_k=None)
    counter = ForwardCounter(model)
    try:
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             prompt_lookup_num_tokens=num_tokens, max_matching_ngram_size=max_ngram,
                             eos_token_id=stop or None, pad_token_id=pad_token_id, **kwargs)
        wall = time.perf_counter() - start
    finally:
        counter.remove()
    new = out[0, len(input_ids):].tolist()
    for i, t in enumerate(new):          # cut after the first stop token (the rest is padding)
        if t in stop:
            new = new[:i + 1]
            break
    # cache_lengths: [0 (prefill), P + a_0, P + a_0 + a_1, ...]; the prefill emits the first token and
    # a_0 (usually 0) accepted drafts; the last new token never enters the cache.
    starts = counter.cache_lengths[1:]
    ends = starts[1:] + [len(input_ids) + len(new) - 1]
    accept = [e - s for s, e in zip(starts, ends)]
    in_prefill = starts[0] - len(input_ids) if starts else 0
    if in_prefill:
        accept = [in_prefill, *accept]
    prefill_time = counter.end_times[0] - start if counter.end_times else wall
    return PeerResult(new_tokens=new, wall_time=wall, steps=len(accept), accept_lengths=accept,
                      prefill_time=prefill_time)
