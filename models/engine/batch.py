"""Many answers decoded at once: B sequences, one verify forward a step for all of them, each with its own drafter.

    from models.engine.batch import generate_batch
    results = generate_batch(model, tok, prompts, drafters=[make_drafter(spec, heads=heads) for _ in prompts])
    results = generate_batch(model, tok, prompts)            # no drafters: the autoregressive baseline, batched
    results[b].new_tokens, results[b].accept_lengths, ...     # one GenerationResult per prompt, in order

The layout: one base cache for the batch (kv_cache.GrowingLayer, [B, kv_heads, L, head_dim] a layer). Row b holds
its sequence's committed positions in columns 0..past_b - 1; its columns past_b..L - 1 are garbage (a shorter
prompt's padding, the rows of drafts it rejected), which its mask hides. A step (decoding.decode_step's, per row):
  1) draft:  each live sequence drafts below its own root with its own drafter (a drafter holds one sequence's
             state: its caches, its history), at most as deep as its own context and token limit allow; fixed
             trees of one kind are drafted together a depth at a time (drafters/tree.py draft_many: the
             autoregressive drafters run every sequence's frontier in one forward);
  2) verify: the B trees, padded to the largest, in ONE forward, written at columns L..L + N - 1 of every row;
             row b's queries sit at positions past_b + depth and see its committed columns, its tree's ancestors
             and themselves, nothing else (a padding query sees itself only, so its softmax stays finite);
  3) accept: each sequence's rule on its own rows of the LM head, with its own generator (sampling: one per
             sequence, seeded seed + b, so a sequence's draws do not depend on its neighbours);
  4) commit: row b's accepted tree columns move down to past_b.., the cache is cut to the longest row, and each
             drafter advances over its own accepted rows.
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

from models.engine import acceptance
from models.engine.acceptance import NodeLogits, SamplingConfig
from models.engine.decoding import GenerationResult, Output, checked_max_new_tokens, drafter_taps, first_token, \
    resolve_stop_ids, zero_timings
from models.engine.drafters.base import DraftContext, StepDrafter
from models.engine.drafters.tree import draft_many
from models.engine.kv_cache import cache_kwargs, keep_accepted_rows, new_cache
from models.engine.projection import base_logits
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


def attention_masks(config, visible: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor | dict:
    """visible [B, Q, K] bool -> the additive mask [B, 1, Q, K]; a model with a sliding window also hides keys a
    window or more behind their query (q_pos [B, Q], k_pos [B, K]): one mask when every layer slides, else
    {"full_attention", "sliding_attention"} (as decoding.verify_masks)."""
    lowest = torch.finfo(dtype).min
    full = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, lowest)[:, None]
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window or (types is not None and "sliding_attention" not in types):
        return full
    too_far = (q_pos[:, :, None] - k_pos[:, None, :] >= window)[:, None]
    sliding = full.masked_fill(too_far, lowest)
    return sliding if types is None else {"full_attention": full, "sliding_attention": sliding}


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


def _verify(decoder, drafts, seqs: list[_Seq], cache, device, dtype, taps) -> tuple[torch.Tensor, object]:
    """Every live sequence's tree (a plain step: its root alone) in one forward after the cache's L columns ->
    (hidden [B, N, h], the taps' recorder)."""
    L = cache.get_seq_length()
    sizes = [1 if d is None else d.buf.num_tokens for d in drafts]
    B, N = len(seqs), max(sizes)
    ids = torch.zeros(B, N, dtype=torch.long, device=device)
    depth = torch.zeros(B, N, dtype=torch.long, device=device)
    visible = torch.zeros(B, N, L + N, dtype=torch.bool, device=device)
    k_pos = torch.arange(L + N, device=device).expand(B, -1).clone()
    cols = torch.arange(L, device=device)
    for b, (s, d, n) in enumerate(zip(seqs, drafts, sizes)):
        visible[b, :, :L] = cols < s.past
        if d is None:
            ids[b, 0] = s.root
            visible[b, 0, L] = True
        else:
            ids[b, :n] = d.tokens.to(device)
            depth[b, :n] = d.buf.depth.to(device)
            visible[b, :n, L:L + n] = d.buf.tree_mask.reshape(n, n).to(device)            # ancestors + self
        visible[b, range(n, N), range(L + n, L + N)] = True               # padding queries: themselves only
        depth[b] += s.past
        k_pos[b, L:] = depth[b]
    mask = attention_masks(decoder.config, visible, depth, k_pos, dtype)
    with LayerTaps(decoder, taps) as tapped:
        hidden = decoder(input_ids=ids, attention_mask=mask, position_ids=depth, use_cache=True,
                         **cache_kwargs(decoder, cache)).last_hidden_state
    return hidden, tapped


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


def _batched_logits(hidden: torch.Tensor, drafts: list, logits_of) -> tuple[dict[int, torch.Tensor], float]:
    """The LM head over every row acceptance will read, for all sequences in one product where a sequence's rows
    are few (its root alone, or a tree of at most NodeLogits.EAGER_ROWS, which it reads whole anyway): on a CPU the
    product is bound by reading the LM head's weights, once for the batch instead of once a sequence. -> ({b: its
    rows' logits [n, V]}, seconds)."""
    sizes = {b: 1 if d is None else d.buf.num_tokens for b, d in enumerate(drafts)}
    eager = [b for b, n in sizes.items() if n <= NodeLogits.EAGER_ROWS]
    if not eager:
        return {}, 0.0
    t0 = time.perf_counter()
    out = logits_of(torch.cat([hidden[b, :sizes[b]] for b in eager]))
    return dict(zip(eager, out.split([sizes[b] for b in eager]))), time.perf_counter() - t0


def _accept(live: list[_Seq], drafts: list, hidden: torch.Tensor, logits_of, sampling: SamplingConfig):
    """Each sequence's rule on its own rows -> (paths, (drafted tokens, bonus) per sequence, LM-head seconds)."""
    rule = acceptance.rule_for(sampling)
    computed, lm_head = _batched_logits(hidden, drafts, logits_of)
    paths, emitted = [], []
    for b, (s, d) in enumerate(zip(live, drafts)):
        if d is None:                                                   # a plain step: the root's row alone
            paths.append([0])
            emitted.append(([], first_token(computed[b][0], sampling, s.generator, speculative=s.drafter is not None)))
            continue
        node_logits = NodeLogits(hidden[b, :d.buf.num_tokens], logits_of)
        if b in computed:
            node_logits.cache = dict(enumerate(computed[b]))
        path, bonus = rule(d.tokens, d.buf, node_logits, sampling, s.generator, d.draft_q)
        lm_head += node_logits.seconds
        paths.append(path)
        emitted.append((d.tokens[path[1:]].tolist(), bonus))
    return paths, emitted, lm_head


def _commit(cache, L: int, live: list[_Seq], paths, emitted, features: torch.Tensor) -> None:
    """Each row's accepted columns kept, each drafter advanced over its own rows, the tokens emitted."""
    keep_accepted_rows(cache, L, [s.past for s in live], paths)
    for b, (s, path, (drafted, bonus)) in enumerate(zip(live, paths, emitted)):
        if s.drafter is not None:
            s.drafter.advance(features[b][path], [s.root, *drafted], s.past)
        s.past, s.root = s.past + len(path), bonus
        s.accept_lengths.append(s.out.emit(drafted + [bonus], [True] * len(drafted) + [False]))


def _step(decoder, logits_of, cache, live: list[_Seq], sampling, taps, max_pos: int, timings: dict) -> None:
    """One batched step: draft -> verify -> accept -> commit (module docstring)."""
    device, dtype = cache.layers[0].keys.device, cache.layers[0].keys.dtype
    t1 = time.perf_counter()
    drafts = [None] * len(live)
    if live[0].drafter is not None:                  # fixed trees drafted together where the drafters can (tree.py)
        depths = [min(max_pos - 1 - s.past, s.out.max_new - len(s.out.tokens) - 1) for s in live]
        drafts = [None if d is None or d.buf.num_tokens == 1 else d
                  for d in draft_many([s.drafter for s in live], [s.root for s in live], depths)]
    t2 = time.perf_counter()
    L = cache.get_seq_length()
    hidden, tapped = _verify(decoder, drafts, live, cache, device, dtype, taps)
    t3 = time.perf_counter()
    paths, emitted, lm_head = _accept(live, drafts, hidden, logits_of, sampling)
    t4 = time.perf_counter()
    _commit(cache, L, live, paths, emitted, hidden if not tapped.taps else tapped.features())
    for k, v in (("draft", t2 - t1), ("verify", t3 - t2 + lm_head), ("lm_head", lm_head),
                 ("accept", t4 - t3 - lm_head), ("commit", time.perf_counter() - t4)):
        timings[k] += v


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
    timings, taps = zero_timings(), drafter_taps(drafters[0])
    t0 = time.perf_counter()
    cache = new_cache()
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
            _step(decoder, logits_of, cache, live, sampling, taps, max_pos, timings)
    results = [None] * len(prompts)
    for s in done:
        text = tokenizer.decode(s.out.tokens, skip_special_tokens=True) if tokenizer is not None else ""
        results[s.index] = GenerationResult(s.out.tokens, text, s.accept_lengths, len(s.accept_lengths),
                                            s.finished_at, s.out.from_draft, prefill_time=prefill_time,
                                            timings=dict(timings), stop_reason=s.out.stop_reason)
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
