"""Many answers decoded at once: B sequences, one verify forward a step for all of them, each with its own drafter.

    from models.engine.batch import generate_batch
    results = generate_batch(model, tok, prompts, drafters=[make_drafter(spec, heads=heads) for _ in prompts])
    results = generate_batch(model, tok, prompts)            # no drafters: the autoregressive baseline, batched
    results[b].new_tokens, results[b].accept_lengths, ...     # one GenerationResult per prompt, in order

The layout: one base cache for the batch (kv_cache.GrowingLayer, [B, kv_heads, L, head_dim] a layer). Row b holds
its sequence's committed positions in columns 0..past_b - 1; its columns past_b..L - 1 are garbage (a shorter
prompt's padding, the rows of drafts it rejected), which its mask hides. The step is the engine's one step
(models/engine/step.py) over the live sequences, each with its own drafter and generator (seeded seed + b, so a
sequence's draws do not depend on its neighbours); what this module adds is only what batching needs: the
right-padded prefill, a sequence's seed, its token limit and stop, and its leaving.
A sequence that stops (a stop token, its token limit, the context) leaves the batch at once and its row is
dropped from the cache (freed, not masked: a masked row would still cost a row of every verify forward, and
B x N is what a step costs). Greedy decoding is lossless row by row: each sequence's answer is its own batch-1
answer (tests/test_batch.py). Prompts of different lengths are right-padded in the prefill, the padding masked.
The static step and graphed drafts are batch-1 only: a batch decodes eagerly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from models.engine.acceptance import SamplingConfig
from models.engine.decoding import GenerationResult, Output, checked_max_new_tokens, resolve_stop_ids
from models.engine.drafters.base import DraftContext, StepDrafter
from models.engine.kv_cache import cache_kwargs, cut_to, new_cache
from models.engine.projection import base_logits
from models.engine.step import BatchState, attention_masks, drafter_taps, first_token, step
from models.engine.taps import LayerTaps

@dataclass
class _Seq:
    """One sequence of the batch: its row in the cache, committed positions, root, drafter, output."""
    index: int                     # its place in the prompts (results come back in that order)
    past: int
    root: int
    drafter: StepDrafter | None
    generator: torch.Generator
    out: Output
    accept_lengths: list
    finished_at: float = 0.0


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


def _prefill(decoder, logits_of, prompts: list[list[int]], seqs: list[_Seq], sampling, cache, device,
             dtype) -> None:
    """The right-padded prompts through the base in one forward: each row causal over its own tokens."""
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    T = int(lengths.max())
    ids = torch.zeros(len(prompts), T, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(p, device=device)
    pos = torch.arange(T, device=device)
    visible = (pos[None, :, None] >= pos[None, None, :]) & (pos[None, None, :] < lengths[:, None, None])
    positions = pos.expand(len(prompts), T)
    mask = attention_masks(decoder.config, visible, positions, positions, dtype)
    with LayerTaps(decoder, drafter_taps(seqs[0].drafter)) as tapped:
        hidden = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         **cache_kwargs(decoder, cache)).last_hidden_state                                   # [B, T, h]
    features = hidden if not tapped.taps else tapped.features()
    last = logits_of(hidden[torch.arange(len(prompts), device=device), lengths - 1])       # [B, V]: one LM head
    for b, (s, p) in enumerate(zip(seqs, prompts)):
        s.past = len(p)
        s.root = first_token(last[b], sampling, s.generator, speculative=s.drafter is not None)
        if s.drafter is not None:
            s.drafter.start(DraftContext(ids[b, :len(p)], features[b, :len(p)], sampling, s.generator))


def _sequences(prompts, drafters, sampling: SamplingConfig, seeds, max_new_tokens: int, stops, device) -> list[_Seq]:
    """One _Seq per prompt with its own generator (seeds[b], else sampling.seed + b, else a fresh seed)."""
    seqs = []
    for b, d in enumerate(drafters):
        g = torch.Generator(device=device)
        seed = seeds[b] if seeds is not None else (None if sampling.seed is None else sampling.seed + b)
        g.manual_seed(seed) if seed is not None else g.seed()
        seqs.append(_Seq(b, 0, 0, d, g, Output(max_new_tokens, stops, None), []))
    return seqs


def _check_drafters(drafters, B: int) -> list:
    drafters = list(drafters) if drafters is not None else [None] * B
    if len(drafters) != B:
        raise ValueError(f"{len(drafters)} drafters for {B} prompts: give one drafter per prompt (or none)")
    if len({type(d) for d in drafters}) > 1 or len({drafter_taps(d) for d in drafters}) > 1:
        raise ValueError("the drafters of one batch must be of one kind (one verify forward records one set of taps)")
    if len({id(d) for d in drafters if d is not None}) < sum(d is not None for d in drafters):
        raise ValueError("one drafter was given for several prompts; each sequence needs its own (it holds its state)")
    return drafters


def _step(state: BatchState, live: list[_Seq], max_pos: int) -> None:
    """One step of every live sequence (models/engine/step.py), each at most as deep as its context and token limit
    allow; the tokens each emits go to its output."""
    depths = [min(max_pos - 1 - s.past, s.out.max_new - len(s.out.tokens) - 1) for s in live]
    for s, (tokens, drafted) in zip(live, step(state, live, [s.drafter for s in live], depths)):
        s.accept_lengths.append(s.out.emit(tokens, [True] * drafted + [False]))


@torch.inference_mode()
def generate_batch(model, tokenizer, prompts, drafters: list[StepDrafter | None] | None = None,
                   sampling: SamplingConfig | None = None, max_new_tokens: int = 128, stop_token_ids=None,
                   seeds: list[int] | None = None) -> list[GenerationResult]:
    """Decode one answer per prompt (token lists, or a [B, T] tensor), all at once (module docstring).
    drafters: one per prompt (each a fresh drafter: it holds that sequence's state), or None for the baseline.
    seeds: each sequence's generator seed (default: sampling.seed + b, or fresh ones without a seed). Each
    GenerationResult's wall_time is the batch's time until that sequence finished; its timings are the batch's."""
    max_new_tokens = checked_max_new_tokens(max_new_tokens)
    max_pos = int(getattr(model.config, "max_position_embeddings", 1 << 30))
    prompts = check_prompts(prompts, max_pos)
    drafters = _check_drafters(drafters, len(prompts))
    if seeds is not None and len(seeds) != len(prompts):       # extra seeds would be dropped without a word
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts: give one seed per prompt (or none)")
    sampling = sampling or SamplingConfig()
    device, dtype = next(model.parameters()).device, model.dtype
    seqs = _sequences(prompts, drafters, sampling, seeds, int(max_new_tokens),
                      resolve_stop_ids(model, tokenizer, stop_token_ids), device)
    if max_new_tokens == 0:
        return [GenerationResult([], "", [], 0, 0.0, [], stop_reason="max_new_tokens") for _ in prompts]
    decoder, logits_of = model.get_decoder(), base_logits(model)
    t0 = time.perf_counter()
    cache = new_cache()
    state = BatchState(decoder, logits_of, cache, sampling, dtype, device)
    _prefill(decoder, logits_of, prompts, seqs, sampling, cache, device, dtype)
    prefill_time = time.perf_counter() - t0
    for s in seqs:
        s.out.emit([s.root], [False])
    done, live = [], list(seqs)
    while live:
        for s in live:
            if s.past >= max_pos and not s.out.done:                        # no position left for its root
                s.out.stop_reason = "context_limit"
        live = _leave(cache, live, done, t0)
        if live:
            _step(state, live, max_pos)
    results = [None] * len(prompts)
    for s in done:
        text = tokenizer.decode(s.out.tokens, skip_special_tokens=True) if tokenizer is not None else ""
        results[s.index] = GenerationResult(s.out.tokens, text, s.accept_lengths, len(s.accept_lengths),
                                            s.finished_at, s.out.from_draft, prefill_time=prefill_time,
                                            timings=dict(state.timings), stop_reason=s.out.stop_reason)
    return results


def _leave(cache, live: list[_Seq], done: list[_Seq], t0: float) -> list[_Seq]:
    """The sequences still decoding; the others join `done` with their finishing time, their rows dropped."""
    staying = [s for s in live if not s.out.done]
    if len(staying) < len(live):
        now = time.perf_counter() - t0
        for s in live:
            if s.out.done:
                s.finished_at = now
                done.append(s)
        _drop_finished(cache, live, staying)
    return staying


def _drop_finished(cache, rows: list[_Seq], staying: list[_Seq]) -> None:
    """Keep the cache rows of `staying` (rows: the sequences the cache's rows hold now, in order)."""
    if len(staying) == len(rows) or cache.get_seq_length() == 0:
        return
    keep = [i for i, s in enumerate(rows) if any(s is t for t in staying)]
    if keep:
        cache.batch_select_indices(torch.tensor(keep, device=cache.layers[0].keys.device))
        cut_to(cache, max(s.past for s in staying))    # a dropped row may have been the longest: no column past it
