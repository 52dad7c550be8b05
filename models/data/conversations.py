"""Conversations: clean ShareGPT records, tokenise with the chat template, label assistant tokens only.

    cleaned = clean_record({"id": "a_0", "conversations": [{"from": "human", "value": "Hi"}, ...]})
    cleaned.messages  # [{"role": "user", "content": "Hi"}, {"role": "assistant", ...}] or None
    cleaned.reason    # why it was dropped (None: kept)
    input_ids, labels, truncated = tokenize_conversation(tokenizer, cleaned.messages, max_length=512)

labels equal input_ids on the tokens of each assistant reply, its end-of-turn token included
(`<|im_end|>` in ChatML), and -100 elsewhere (system prompt, user turns, role headers).
Assistant character spans come from rendering the conversation one message at a time with the
tokenizer's own chat template, so any template that renders messages in order works.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

IGNORE_INDEX = -100
USER_ROLES = {"human", "user"}
ASSISTANT_ROLES = {"gpt", "chatgpt", "assistant"}
# Only the characters this far before a cut are trusted to tokenise as in the full text:
# a pre-token (word, whitespace run) never spans more, so the tokens there do not change.
CUT_MARGIN_CHARS = 512


# ---------------------------------------------------------------------------------------------
# Cleaning


@dataclass
class Cleaned:
    """One record after cleaning: messages is None when dropped, with the reason."""
    id: str | None
    messages: list[dict] | None
    reason: str | None = None
    events: list[str] = field(default_factory=list)  # what was trimmed from a kept conversation


def _structure_error(record) -> str | None:
    """Why the record does not have ShareGPT's shape (None: it does)."""
    if not isinstance(record, dict):
        return "not_an_object"
    if "id" not in record or "conversations" not in record:
        return "missing_key"
    if not isinstance(record["id"], str) or not isinstance(record["conversations"], list):
        return "wrong_type"
    for turn in record["conversations"]:
        if not isinstance(turn, dict):
            return "wrong_type"
        if "from" not in turn or "value" not in turn:
            return "missing_key"
        if not isinstance(turn["from"], str) or not isinstance(turn["value"], str):
            return "wrong_type"
    return None


def _valid_text(text: str) -> bool:
    try:
        text.encode("utf-8")  # lone surrogates (from "\\ud800" escapes) cannot be tokenised
        return True
    except UnicodeEncodeError:
        return False


def clean_record(record) -> Cleaned:
    """Check shape, start at the first human turn, keep alternating user/assistant pairs.

    The conversation is cut at the first turn that breaks the pattern (empty, unknown role,
    two turns of the same side, undecodable text); it is kept when at least one full
    user+assistant pair remains before the cut, and dropped with the cut's reason otherwise.
    """
    # 1) shape: anything malformed drops the whole record
    reason = _structure_error(record)
    if reason:
        rid = record.get("id") if isinstance(record, dict) and isinstance(record.get("id"), str) else None
        return Cleaned(rid, None, reason)
    rid, turns = record["id"], record["conversations"]
    if not turns:
        return Cleaned(rid, None, "no_turns")
    # 2) start at the first human turn (ShareGPT splits long chats, so parts often begin with gpt)
    start = next((i for i, t in enumerate(turns) if t["from"] in USER_ROLES), None)
    if start is None:
        return Cleaned(rid, None, "no_human_turn")
    events = ["trimmed_leading_turns"] if start > 0 else []
    # 3) alternate user, assistant, user, ... until the first break
    messages, cut = [], None
    for i, turn in enumerate(turns[start:]):
        expected = "user" if i % 2 == 0 else "assistant"
        role = ("user" if turn["from"] in USER_ROLES else "assistant" if turn["from"] in ASSISTANT_ROLES
                else None)
        if role is None:
            cut = "unknown_role"
        elif not turn["value"].strip():
            cut = "empty_turn"
        elif role != expected:
            cut = "non_alternating"
        elif not _valid_text(turn["value"]):
            cut = "invalid_text"
        if cut:
            break
        messages.append({"role": role, "content": turn["value"]})
    # 4) end on an assistant reply; keep if a full pair is left
    if len(messages) % 2 == 1:
        messages.pop()
        if cut is None:
            events.append("trimmed_trailing_user")
    if not messages:
        return Cleaned(rid, None, cut or "no_assistant_reply")
    if cut:
        events.append(f"cut_at_{cut}")
    return Cleaned(rid, messages, None, events)


# ---------------------------------------------------------------------------------------------
# Chat template and labels


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer, messages: list[dict], stop_after_chars: int | None = None
                    ) -> tuple[str, list[tuple[int, int]], bool]:
    """(text, [(start, end) char span of each assistant reply + its end-of-turn], complete).

    Renders message prefixes: the reply of message i spans from the end of
    render(messages[:i], add_generation_prompt=True) to the end of render(messages[:i+1]) less
    trailing whitespace (what follows the end-of-turn token). With stop_after_chars, rendering
    stops at the first message boundary past that many characters (complete=False).
    """
    spans, prev = [], ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue  # a user turn's text shows up in the next render
        head = _render(tokenizer, messages[:i], add_generation_prompt=True)
        text = _render(tokenizer, messages[:i + 1])
        if not (head.startswith(prev) and text.startswith(head)):
            raise ValueError(f"the chat template of {tokenizer.name_or_path!r} does not render conversations "
                             f"incrementally (message {i} changes the text before it); assistant-only labels "
                             "need a template where each message appends text (set model.chat_template)")
        spans.append((len(head), max(len(head), len(text.rstrip()))))
        prev = text
        if stop_after_chars is not None and len(text) >= stop_after_chars and i + 1 < len(messages):
            return text, spans, False
    if messages and messages[-1]["role"] != "assistant":
        prev = _render(tokenizer, messages)
    return prev, spans, True


def _labels(input_ids: list[int], offsets, spans: list[tuple[int, int]]) -> list[int]:
    """input_ids where a token ends inside an assistant span, else IGNORE_INDEX.

    A token that straddles the start of a reply (BPE merging the header's "\n" with a reply that
    starts with spaces) carries reply text, so it counts as assistant.
    """
    ids = np.asarray(input_ids, dtype=np.int64)               # [T]
    ends = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)[:, 1]  # [T] char end of each token
    keep = np.zeros(len(ids), dtype=bool)
    for start, end in spans:
        keep |= (ends > start) & (ends <= end)
    return np.where(keep, ids, IGNORE_INDEX).tolist()


def tokenize_conversations(tokenizer, conversations: list[list[dict]], max_length: int
                           ) -> list[tuple[list[int], list[int], bool]]:
    """Batched tokenize_conversation: [(input_ids, labels, truncated)] in the same order.

    Long conversations are tokenised from a prefix of their text only: the tokens ending at
    least CUT_MARGIN_CHARS before the cut are those of the full text. When a prefix does not
    give max_length + 1 such tokens, the prefix grows (x4) up to the whole conversation.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} is not a fast tokenizer; assistant-only labels "
                         "need its character offsets (return_offsets_mapping)")
    results: list = [None] * len(conversations)
    todo = list(range(len(conversations)))
    budget = 6 * max_length + CUT_MARGIN_CHARS   # characters first tried (about 4 per token in English)
    while todo:
        texts, spans, limits = [], [], []
        for j in todo:
            text, sp, complete = assistant_spans(tokenizer, conversations[j], stop_after_chars=budget)
            cut = not complete or len(text) > budget
            texts.append(text[:budget] if cut else text)
            spans.append(sp)
            limits.append(budget - CUT_MARGIN_CHARS if cut else None)
        enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        retry = []
        for j, ids, offsets, sp, limit in zip(todo, enc["input_ids"], enc["offset_mapping"], spans, limits):
            if limit is not None:
                exact = int(np.searchsorted(np.asarray(offsets, dtype=np.int64).reshape(-1, 2)[:, 1], limit,
                                            side="right"))
                if exact <= max_length:
                    retry.append(j)   # not enough trusted tokens: try a longer prefix
                    continue
            truncated = len(ids) > max_length  # a cut text always has more than max_length tokens here
            ids, offsets = ids[:max_length], offsets[:max_length]
            results[j] = (list(ids), _labels(ids, offsets, sp), truncated)
        todo, budget = retry, budget * 4
    return results


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int) -> tuple[list[int], list[int], bool]:
    """(input_ids, labels, truncated) for one conversation of {"role": "user"|"assistant", "content"}."""
    return tokenize_conversations(tokenizer, [messages], max_length)[0]
