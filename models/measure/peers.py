"""transformers' own generate, the references our decoder's methods are compared with: prompt lookup (method
pld_hf), a draft model as assistant (method sps_hf), and plain greedy autoregressive decoding, no drafting (method
hf_generate: the other autoregressive loop beside our baseline, so that a slow baseline cannot flatter a speedup).

    result = prompt_lookup_generate(model, input_ids, max_new_tokens=128, num_tokens=10, max_ngram=2)
    result = assisted_generate(model, assistant, input_ids, max_new_tokens=128, num_tokens=4)
    result = greedy_generate(model, input_ids, max_new_tokens=128)
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


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
    """transformers' prompt lookup decoding (`prompt_lookup_num_tokens`)."""
    return counted_generate(model, input_ids, max_new_tokens, temperature, stop_token_ids, pad_token_id,
                            prompt_lookup_num_tokens=num_tokens, max_matching_ngram_size=max_ngram)


@torch.no_grad()
def greedy_generate(model, input_ids: list[int], max_new_tokens: int, temperature: float = 0.0, stop_token_ids=None,
                    pad_token_id: int | None = None) -> PeerResult:
    """transformers' own autoregressive generate, no drafting: model.generate(do_sample=False, use_cache=True) at
    temperature 0 (sampled at the turn's temperature otherwise, as the other peers); one token a forward call."""
    return counted_generate(model, input_ids, max_new_tokens, temperature, stop_token_ids, pad_token_id,
                            use_cache=True)


@torch.no_grad()
def assisted_generate(model, assistant, input_ids: list[int], max_new_tokens: int, num_tokens: int = 4,
                      temperature: float = 0.0, stop_token_ids=None, pad_token_id: int | None = None) -> PeerResult:
    """transformers' assisted generation (`assistant_model`): `assistant` drafts a chain of num_tokens tokens a step
    (a constant schedule, no early stop on its confidence), the model verifies it."""
    config = assistant.generation_config
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = int(num_tokens), "constant"
    config.assistant_confidence_threshold = 0.0
    return counted_generate(model, input_ids, max_new_tokens, temperature, stop_token_ids, pad_token_id,
                            assistant_model=assistant)


def counted_generate(model, input_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                     stop_token_ids=None, pad_token_id: int | None = None, **speculation) -> PeerResult:
    """model.generate(**speculation); steps and tokens per step are read from the model's forward calls: call j
    (after the prefill) emits cache_len[j+1] - cache_len[j] tokens.

    transformers verifies the first drafts in the prefill call itself (prompt + drafts in one forward):
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
                             eos_token_id=stop or None, pad_token_id=pad_token_id, **speculation, **kwargs)
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
