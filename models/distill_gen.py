"""Self-distillation generation: replay the user turns of conversations through the base model.

    gen = HFGenerator(model, tokenizer, GenerationSettings(max_new_tokens=96, temperature=0.3, batch_size=16))
    convs, stats = replay_conversations(gen, tokenizer, [["Hi!", "And then?"]], max_prompt_tokens=256, seed=0)
    convs[0]  # [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": <the model's answer>}, ...]

Turn i of every conversation is generated in one batched call, after turn i-1 of all of them, so a
later user turn sees the model's own earlier answers. `VLLMGenerator` has the same interface and is
used when vLLM is installed and the profile asks for it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class GenerationSettings:
    max_new_tokens: int = 96
    temperature: float = 0.3      # 0 = greedy
    top_p: float = 1.0
    batch_size: int = 16


@dataclass
class Generated:
    tokens: list[int]             # new tokens, end-of-turn token and padding stripped
    finished: bool                # False: cut at max_new_tokens


def chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` in the chat template, ending with the assistant generation prompt."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return list(ids)


class HFGenerator:
    """Batched sampling with transformers' generate: prompts sorted by length, left-padded."""

    def __init__(self, model, tokenizer, settings: GenerationSettings):
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.eos_ids = {tokenizer.eos_token_id} | set(_as_list(model.generation_config.eos_token_id))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    @torch.no_grad()
    def __call__(self, prompts: list[list[int]], seed: int, on_batch: Callable[[int], None] | None = None
                 ) -> list[Generated]:
        s, device = self.settings, next(self.model.parameters()).device
        torch.manual_seed(seed)  # one seed per call: a resumed run draws the same samples for the same shard
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: list[Generated | None] = [None] * len(prompts)
        for b in range(0, len(order), s.batch_size):
            idx = order[b:b + s.batch_size]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.full((len(idx), width), self.pad_id, dtype=torch.long)       # [B, T] left-padded
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
                mask[row, width - len(prompts[i]):] = 1
            sample = s.temperature > 0
            out = self.model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=s.max_new_tokens,
                do_sample=sample, temperature=s.temperature if sample else None, top_p=s.top_p if sample else None,
                top_k=None, eos_token_id=sorted(self.eos_ids), pad_token_id=self.pad_id)  # [B, T + new]
            for row, i in enumerate(idx):
                results[i] = strip_at_eos(out[row, width:].tolist(), self.eos_ids)
            if on_batch:
                on_batch(len(idx))
        return results


class VLLMGenerator:
    """The same interface through vLLM (continuous batching does the batching)."""

    def __init__(self, model_source: str, tokenizer, settings: GenerationSettings, dtype: str = "auto"):
        from vllm import LLM

        self.llm, self.tokenizer, self.settings = LLM(model=model_source, dtype=dtype), tokenizer, settings
        self.eos_ids = {tokenizer.eos_token_id}

    def __call__(self, prompts: list[list[int]], seed: int, on_batch: Callable[[int], None] | None = None
                 ) -> list[Generated]:
        from vllm import SamplingParams

        s = self.settings
        params = SamplingParams(temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_new_tokens,
                                stop_token_ids=sorted(self.eos_ids), seed=seed)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if on_batch:
            on_batch(len(prompts))
        return [strip_at_eos(list(o.outputs[0].token_ids), self.eos_ids) for o in outs]


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
        return True
    except ImportError:
        return False


def replay_conversations(generate, tokenizer, conversations: list[list[str]], max_prompt_tokens: int, seed: int,
                         on_batch: Callable[[int], None] | None = None) -> tuple[list[list[dict]], dict]:
    """Answer every user turn with the model; turn i's prompt holds the model's own answers to turns < i.

    conversations: the user turns of each conversation. A conversation stops at the first turn whose
    prompt exceeds max_prompt_tokens (its earlier turns are kept). Returns (messages per conversation,
    stats: turns answered, turns dropped, answers cut at max_new_tokens, new tokens).
    """
    messages: list[list[dict]] = [[] for _ in conversations]
    alive = [True] * len(conversations)
    stats = {"turns": 0, "turns_dropped": 0, "answers_cut": 0, "new_tokens": 0}
    for turn in range(max((len(c) for c in conversations), default=0)):
        # 1) the prompts of this turn: history (with the model's answers) + the next user message
        todo, prompts = [], []
        for i, conv in enumerate(conversations):
            if not alive[i] or turn >= len(conv):
                continue
            candidate = messages[i] + [{"role": "user", "content": conv[turn]}]
            ids = chat_prompt(tokenizer, candidate)
            if len(ids) > max_prompt_tokens:
                alive[i] = False
                stats["turns_dropped"] += len(conv) - turn
                continue
            todo.append(i)
            prompts.append(ids)
        if not todo:
            break
        # 2) one batched generation per turn
        answers = generate(prompts, seed=seed * 1000 + turn, on_batch=on_batch)
        for i, ans in zip(todo, answers):
            text = tokenizer.decode(ans.tokens, skip_special_tokens=True)
            messages[i] += [{"role": "user", "content": conversations[i][turn]}, {"role": "assistant", "content": text}]
            stats["turns"] += 1
            stats["answers_cut"] += not ans.finished
            stats["new_tokens"] += len(ans.tokens)
    return messages, stats


def strip_at_eos(new: list[int], eos_ids) -> Generated:
    """Tokens before the first end-of-turn token (and the padding after it)."""
    for j, tok in enumerate(new):
        if tok in eos_ids:
            return Generated(new[:j], True)
    return Generated(new, False)


def _as_list(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]
