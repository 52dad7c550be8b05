"""Many answers decoded at once: B sequences, one verify forward a step for all of them, each with its own drafter.

    from models.engine.batch import generate_batch
    results = generate_batch(model, tok, prompts, drafters=[make_drafter(spec, heads=heads) for _ in prompts])
    results = generate_batch(model, tok, prompts)            # no drafters: the autoregressive baseline, batched
    results[b].new_tokens, results[b].accept_lengths, ...     # one GenerationResult per prompt, in order

generate_batch is the second door to the loop generate runs (decoding.decode: one prefill, one step, one loop for
every B); what this module adds is only what a batch's input needs checked: one prompt and one fresh drafter per
sequence, the drafters of one kind, a seed per sequence (seed + b by default, so a sequence's draws do not depend
on its neighbours).
The layout: one base cache for the batch (kv_cache.GrowingLayer, [B, kv_heads, L, head_dim] a layer). Row b holds
its sequence's committed positions in columns 0..past_b - 1; its columns past_b..L - 1 are garbage (a shorter
prompt's padding, the rows of drafts it rejected), which its mask hides (step.row_masks, step.prompt_inputs).
A sequence that stops (a stop token, its token limit, the context) leaves the batch at once and its row is
dropped from the cache (freed, not masked: a masked row would still cost a row of every verify forward, and
B x N is what a step costs). Greedy decoding is lossless row by row: each sequence's answer is its own batch-1
answer, and a batch of one decodes exactly as generate does (tests/test_batch.py).
The static step and graphed drafts are a lone sequence's: a batch decodes eagerly.
"""
from __future__ import annotations

import torch

from models.engine.acceptance import SamplingConfig
from models.engine.decoding import (GenerationResult, checked_max_new_tokens, decode, max_position, resolve_stop_ids,
                                    sequences)
from models.engine.drafters.base import StepDrafter
from models.engine.step import drafter_taps


def check_prompts(prompts, max_pos: int) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    prompts = [list(map(int, p.tolist() if isinstance(p, torch.Tensor) else p)) for p in prompts]
    if not prompts:
        raise ValueError("generate_batch needs at least one prompt, got none")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if len(p) > max_pos:
            raise ValueError(f"prompt {i} has {len(p)} tokens but the model's context is {max_pos} "
                             "(max_position_embeddings); shorten it")
    return prompts


def _check_drafters(drafters, B: int) -> list:
    drafters = list(drafters) if drafters is not None else [None] * B
    if len(drafters) != B:
        raise ValueError(f"{len(drafters)} drafters for {B} prompts: give one drafter per prompt (or none)")
    if len({type(d) for d in drafters}) > 1 or len({drafter_taps(d) for d in drafters}) > 1:
        raise ValueError("the drafters of one batch must be of one kind (one verify forward records one set of taps)")
    if len({id(d) for d in drafters if d is not None}) < sum(d is not None for d in drafters):
        raise ValueError("one drafter was given for several prompts; each sequence needs its own (it holds its state)")
    return drafters


@torch.inference_mode()
def generate_batch(model, tokenizer, prompts, drafters: list[StepDrafter | None] | None = None,
                   sampling: SamplingConfig | None = None, max_new_tokens: int = 128, stop_token_ids=None,
                   seeds: list[int] | None = None) -> list[GenerationResult]:
    """Decode one answer per prompt (token lists, or a [B, T] tensor), all at once (module docstring).
    drafters: one per prompt (each a fresh drafter: it holds that sequence's state), or None for the baseline.
    seeds: each sequence's generator seed (default: sampling.seed + b, or fresh ones without a seed). Each
    GenerationResult's wall_time is the batch's time until that sequence finished; its timings are the batch's."""
    max_new_tokens = checked_max_new_tokens(max_new_tokens)
    prompts = check_prompts(prompts, max_position(model))
    drafters = _check_drafters(drafters, len(prompts))
    if seeds is not None and len(seeds) != len(prompts):       # extra seeds would be dropped without a word
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts: give one seed per prompt (or none)")
    sampling = sampling or SamplingConfig()
    device = next(model.parameters()).device
    seqs = sequences(drafters, sampling, max_new_tokens, resolve_stop_ids(model, tokenizer, stop_token_ids), device,
                     seeds)
    return decode(model, tokenizer, [torch.tensor(p, device=device) for p in prompts], seqs, sampling)
