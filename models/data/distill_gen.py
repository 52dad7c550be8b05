"""Self-distillation generation: replay the user turns of conversations through the base model.

    gen = HFGenerator(model, tokenizer, GenerationSettings(max_new_tokens=128, temperature=0.0, batch_size=48, workers=2))
    convs, stats = replay_conversations(gen, tokenizer, [["Hi!", "And then?"]], max_prompt_tokens=160, seed=0)
    convs[0]  # [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": <the model's answer>}, ...]

Turn i of every conversation is generated in one batched call, after turn i-1 of all of them, so a
later user turn sees the model's own earlier answers. `HFGenerator` decodes with the model's own
forward: prompts sorted by length, batches of similar lengths left-padded, one KV cache per batch
that grows in place, and a row leaves the batch (and its cache) as soon as it ends its turn, so a
batch costs what its longest answer costs only for the rows still writing; with workers > 1 that
many batches run at the same time, torch on one thread each (`map_batches`). Greedy by default
(temperature 0): the answer of a prompt is what `model.generate(do_sample=False)` gives it alone.
`VLLMGenerator` has the same interface and is used when vLLM is installed and the profile asks for it.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from models.engine.kv_cache import cache_kwargs, new_cache


@dataclass
class GenerationSettings:
    max_new_tokens: int = 128
    temperature: float = 0.0      # 0 = greedy
    top_p: float = 1.0
    batch_size: int = 48
    workers: int = 1              # batches decoded at the same time, each on one torch thread (see map_batches)


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
    """Batched decoding with a transformers causal LM: length-sorted batches, finished rows dropped."""

    def __init__(self, model, tokenizer, settings: GenerationSettings):
        if settings.temperature < 0 or not 0 < settings.top_p <= 1:
            raise ValueError(f"temperature={settings.temperature} must be >= 0 (0 = greedy) and top_p={settings.top_p} "
                             "in (0, 1]")
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.eos_ids = {tokenizer.eos_token_id} | set(_as_list(model.generation_config.eos_token_id))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def __call__(self, prompts: list[list[int]], seed: int, on_batch: Callable[[int], None] | None = None
                 ) -> list[Generated]:
        s = self.settings
        # batches of at most batch_size, as many as the workers at least, all of about the same size
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        n_batches = min(len(order), max(-(-len(order) // s.batch_size), s.workers))
        batches = [part.tolist() for part in np.array_split(order, n_batches)] if order else []

        def decode(k: int) -> list[Generated]:
            # one generator per (call, batch): a resumed run draws the same samples for the same shard
            rng = (torch.Generator(device=self.device).manual_seed(seed * 100_003 + k) if s.temperature > 0
                   else None)
            return self.decode_batch([prompts[i] for i in batches[k]], rng)

        results: list[Generated | None] = [None] * len(prompts)
        for idx, generated in zip(batches, map_batches(decode, range(len(batches)), s.workers)):
            for i, g in zip(idx, generated):
                results[i] = g
            if on_batch:
                on_batch(len(idx))
        return results

    @torch.no_grad()
    def decode_batch(self, prompts: list[list[int]], rng: torch.Generator | None) -> list[Generated]:
        """One batch: prefill the left-padded prompts, then one token per step for the rows still writing."""
        s, dev = self.settings, self.device
        # 1) prefill: [B, W] left-padded; position ids count each row's own tokens only
        B, W = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((B, W), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, W), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, W - len(p):] = torch.tensor(p)
            mask[row, W - len(p):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)                                    # [B, W]
        cache = new_cache()
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                            logits_to_keep=1, **cache_kwargs(self.model, cache)).logits[:, -1]                 # [B, V]
        next_pos = positions[:, -1] + 1                                                    # [b]
        rows = list(range(B))                  # prompt index of each row still in the batch
        new: list[list[int]] = [[] for _ in prompts]
        finished = [False] * B
        # 2) decode: pick, record, drop the rows that ended their turn, step the others
        for step in range(s.max_new_tokens):
            tokens = self.pick(logits, rng)                                                # [b]
            keep = []
            for j, (r, tok) in enumerate(zip(rows, tokens.tolist())):
                if tok in self.eos_ids:
                    finished[r] = True
                else:
                    new[r].append(tok)
                    keep.append(j)
            if not keep or step == s.max_new_tokens - 1:
                break
            if len(keep) < len(rows):
                sel = torch.tensor(keep, device=dev)
                cache.batch_select_indices(sel)
                rows = [rows[j] for j in keep]
                tokens, mask, next_pos = tokens[sel], mask[sel], next_pos[sel]
            mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)                 # [b, W + step + 1]
            logits = self.model(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                                use_cache=True, logits_to_keep=1, **cache_kwargs(self.model, cache)).logits[:, -1]
            next_pos = next_pos + 1
        return [Generated(new[r], finished[r]) for r in range(B)]

    def pick(self, logits: torch.Tensor, rng: torch.Generator | None) -> torch.Tensor:
        """logits [b, V] -> next tokens [b]: argmax, or a sample at the temperature within top_p."""
        s = self.settings
        if s.temperature == 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / s.temperature, dim=-1)                     # [b, V]
        if s.top_p < 1:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            outside = sorted_p.cumsum(-1) - sorted_p >= s.top_p                            # the top token always stays
            probs = probs.scatter(-1, order, sorted_p.masked_fill(outside, 0.0))
        return torch.multinomial(probs, 1, generator=rng).squeeze(1)


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


def map_batches(fn: Callable, items: Iterable, workers: int) -> Iterator:
    """fn(item) for each item, in order. workers > 1: that many items at a time in threads, torch on one
    thread each (on a 2-core CPU two single-threaded batches beat one batch on two threads: no thread
    barrier in each of the many small ops of a step, and no stall when another process takes a core)."""
    if workers <= 1:
        yield from map(fn, items)
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(workers) as pool:
            yield from pool.map(fn, items)
    finally:
        torch.set_num_threads(threads)


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
