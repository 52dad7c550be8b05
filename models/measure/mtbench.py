"""MT-Bench's questions and the prompts a speed evaluation feeds the model (docs/reference.md#evaluation-protocol).

    questions = load_questions("artifacts/raw/mt_bench_question.jsonl", num_questions=16)   # spread over categories
    ids = chat_input_ids(tok, ["Hi!"], [])                       # turn 1 prompt (chat template)
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


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
    """0 in greedy mode; docs/reference.md#evaluation-protocol's per-category temperature in category mode."""
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
