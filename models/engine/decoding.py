"""Speculative decoding on an unmodified transformers causal LM: one decode step shared by every drafter.

    from models.engine.decoding import generate, SamplingConfig
    from models.engine.drafting import make_drafter
    res = generate(model, tok, input_ids, drafter=make_drafter({"kind": "heads", "tree": spec}, heads=heads))
    res = generate(model, tok, input_ids, drafter=make_drafter({"kind": "prompt_lookup"}))
    res = generate(model, tok, input_ids)                      # no drafter: the autoregressive baseline
    res.new_tokens, res.text, res.accept_lengths, res.mean_accepted_length, res.tokens_per_second

    state = prefill(model, input_ids [1, T], sampling, generator, drafter)   # the loop, by hand
    tokens, drafted = decode_step(state, drafter, max_depth)                 # one step; tokens[-1] = state.root

The decoder never names a drafting strategy: a drafter (models/engine/drafters/) proposes a Draft, the step
verifies and accepts it, the drafter follows the accepted path.

One core for every batch size (decode): prefill_rows puts B prompts through the base in one forward (one prompt as
it is, several right-padded and masked), decode_rows steps every live row (models/engine/step.py;
docs/design.md#the-decode-step) until each has stopped. generate is its door for one sequence, generate_batch
(models/engine/batch.py) its door for B; at B = 1 they decode alike, on the same tensors.
  1) draft:  the drafter proposes a tree of tokens below the root x_{t+1} and names its buffers (a Draft:
             the heads' tree, a chain of context tokens, ...); m = 0 drafts (or no drafter) is a plain
             1-token step
  2) verify: ONE forward of the base decoder over root + tree nodes with a 4-D additive mask
             (prefix visible, tree part = tree mask) and position_ids = past + depth
  3) accept: greedy / typical / lossless sampling -> accepted path + bonus token
  4) commit: keep only the accepted path's KV rows; the drafter advances over the accepted path
The prefill token and every bonus token come from the base model, so len(new_tokens) ==
1 + sum(accept_lengths): accept_lengths[i] = tokens emitted by decoding step i (baseline: 1).
Stop rules (decode_rows, per sequence): the first stop token ends the answer (and is kept); tokens beyond
max_new_tokens are dropped; positions never exceed max_position_embeddings - 1 (the draft is cut
to the depth that still fits, then decoding stops cleanly).
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from models.engine.acceptance import SamplingConfig
from models.engine.drafters.base import DeviceTree, DraftContext, StepDrafter
from models.engine.kv_cache import GrowingLayer, cache_kwargs, new_cache
from models.engine.projection import base_logits
from models.engine.static_step import attach_static
from models.engine.step import (TIMED_PARTS, DecodeState, DeviceClock, Row, drafter_taps, first_token, prompt_inputs,
                                row_masks, step)
from models.engine.step import verify as step_verify
from models.engine.taps import LayerTaps
from models.engine.trees import TreeBuffers

__all__ = ["SamplingConfig", "GenerationResult", "DecodeState", "Row", "prefill", "prefill_rows", "decode_step",
           "time_step", "generate", "decode"]


@dataclass
class GenerationResult:
    new_tokens: list[int]
    text: str
    accept_lengths: list[int]          # tokens emitted per decoding step (after the prefill token)
    steps: int                         # decoding steps (forwards after the prefill)
    wall_time: float                   # seconds, prefill included
    from_draft: list[bool]             # per new token: True if it was an accepted draft
    prefill_time: float = 0.0
    timings: dict = field(default_factory=dict)   # seconds summed over steps: draft, verify (forward + LM
                                                  # head), accept (the rule alone), commit (KV + drafter state)
    stop_reason: str = ""              # eos | max_new_tokens | context_limit
    device_timings: dict = field(default_factory=dict)   # with a device_clock: seconds summed over steps on the
                                                         # device, step.DEVICE_PARTS

    @property
    def mean_accepted_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 1.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.new_tokens) / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def decode_time(self) -> float:
        """Seconds after the prefill: the decoding steps that emitted new_tokens[1:]."""
        return self.wall_time - self.prefill_time

    def to_dict(self) -> dict:
        return {"new_tokens": self.new_tokens, "text": self.text, "accept_lengths": self.accept_lengths,
                "steps": self.steps, "wall_time": self.wall_time, "from_draft": self.from_draft,
                "prefill_time": self.prefill_time, "decode_time": self.decode_time, "timings": self.timings,
                "stop_reason": self.stop_reason, "mean_accepted_length": self.mean_accepted_length,
                "tokens_per_second": self.tokens_per_second}


class Output:
    """Collects emitted tokens and applies the stop rules (shared by baseline and speculative loops)."""

    def __init__(self, max_new_tokens: int, stop_ids: set[int], on_tokens):
        self.max_new, self.stop_ids, self.on_tokens = max_new_tokens, stop_ids, on_tokens
        self.tokens: list[int] = []
        self.from_draft: list[bool] = []
        self.stop_reason = ""

    def emit(self, tokens: list[int], from_draft: list[bool]) -> int:
        n = 0
        for tok in tokens:
            if len(self.tokens) >= self.max_new:
                self.stop_reason = "max_new_tokens"
                break
            n += 1
            if tok in self.stop_ids:
                self.stop_reason = "eos"
                break
        self.tokens += tokens[:n]
        self.from_draft += from_draft[:n]
        if not self.stop_reason and len(self.tokens) >= self.max_new:
            self.stop_reason = "max_new_tokens"
        if self.on_tokens is not None and n:
            self.on_tokens(tokens[:n], from_draft[:n])
        return n

    @property
    def done(self) -> bool:
        return bool(self.stop_reason)


def resolve_stop_ids(model, tokenizer, stop_token_ids=None) -> set[int]:
    if stop_token_ids is not None:
        return {int(t) for t in stop_token_ids}
    ids = {tokenizer.eos_token_id} if tokenizer is not None and tokenizer.eos_token_id is not None else set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(gen_eos if isinstance(gen_eos, (list, tuple)) else [] if gen_eos is None else [gen_eos])
    return {int(t) for t in ids}


def verify_rows(state: DecodeState, drafts: list, L: int | None = None) -> torch.Tensor:
    """The decode step's verify by hand for a state's rows (step.verify): one forward over each row's draft (one with
    `buf` and `tokens`, or None: its root alone) after the cache's L columns (default: all of them) -> hidden
    [B, N, h]. The cache grows by N columns (crop them, or prune with kv_cache.keep_accepted); nothing is accepted."""
    return step_verify(state, state.rows, drafts, state.cache.get_seq_length() if L is None else L)


def verify_tree(decoder, tokens: torch.Tensor, buf: TreeBuffers | DeviceTree, cache, past: int,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One base forward over the tree tokens [N] after `past` cached positions -> hidden [N, h] (the decode step's
    verify at B = 1, by hand). The cache grows by N rows (prune them with kv_cache.keep_accepted)."""
    state = DecodeState(decoder, None, cache, None, dtype, tokens.device, [Row(past, int(tokens[0]))])
    return verify_rows(state, [SimpleNamespace(buf=buf, tokens=tokens)], past)[0]


def verify_masks(config, buf: TreeBuffers | DeviceTree, past: int, dtype: torch.dtype, device) -> torch.Tensor | dict:
    """The verify step's 4-D additive mask [1, 1, N, past + N] of one tree (step.row_masks at B = 1): every prefix
    column, the tree part from the tree (ancestors + self). A model with a sliding window gets the window too, as
    its own mask would have it (key visible iff query position - key position < window): one mask when every
    layer slides (Mistral), else {"full_attention": ..., "sliding_attention": ...} per layer type."""
    return row_masks(config, [buf], [past], past, dtype, device)[0]


def checked_max_new_tokens(max_new_tokens) -> int:
    """The token limit as an int; a bool, a fraction or a negative number is refused by name."""
    if isinstance(max_new_tokens, bool) or not hasattr(max_new_tokens, "__index__") or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: the number of tokens to generate is a whole number "
                         ">= 0 (0 returns an empty answer)")
    return int(max_new_tokens)


def max_position(model) -> int:
    """The model's context: its last position is this minus one."""
    return int(getattr(model.config, "max_position_embeddings", 1 << 30))


def _as_ids(input_ids, device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"generate decodes one sequence (batch size 1), got input_ids of shape {tuple(ids.shape)}")
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty list or [T] / [1, T] tensor, got shape {tuple(ids.shape)}")
    return ids                                                                   # [T]


# -- the prefill and the step, by hand -----------------------------------------------------------------
def prefill_rows(model, prompts: list[torch.Tensor], sampling: SamplingConfig, rows: list[Row], drafters: list,
                 static_drafts: bool = False) -> DecodeState:
    """The prompts (ids [T_b], one per row) through the base in one forward -> the state of `rows`: each row's past
    its prompt's length, its root the first new token (drawn with its own generator), its drafter started. One
    prompt runs as it is, several right-padded and masked (step.prompt_inputs); the LM head runs once over each
    row's last position. static_drafts: the drafter may replay its drafts as CUDA graphs (DraftContext.static), a
    lone sequence's only."""
    B = len(rows)
    if static_drafts and B > 1:
        raise ValueError(f"static drafts replay one sequence's drafts as CUDA graphs; this prefill has {B} rows "
                         "(decode a batch with eager drafts)")
    decoder, logits = model.get_decoder(), base_logits(model)        # checked against the model once per model
    cache = new_cache()
    ids, masks = prompt_inputs(decoder.config, prompts, model.dtype)                                    # [B, T]
    with LayerTaps(decoder, drafter_taps(drafters[0])) as tapped:
        hidden = decoder(input_ids=ids, use_cache=True, **masks, **cache_kwargs(decoder, cache)).last_hidden_state
    lengths = [len(p) for p in prompts]
    last = hidden[0, -1:] if B == 1 else hidden[torch.arange(B, device=ids.device),
                                                torch.tensor(lengths, device=ids.device) - 1]           # [B, h]
    last = logits(last)                                                                                  # [B, V]
    features = hidden if not tapped.taps else tapped.features()                                          # [B, T, w]
    for b, (r, drafter, n) in enumerate(zip(rows, drafters, lengths)):
        r.past = n
        r.root = first_token(last[b], sampling, r.generator, speculative=drafter is not None)
        if drafter is not None:
            drafter.start(DraftContext(ids[b, :n], features[b, :n], sampling, r.generator, static=static_drafts))
    return DecodeState(decoder, logits, cache, sampling, model.dtype, ids.device, list(rows))


def prefill(model, ids: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None = None,
            drafter: StepDrafter | None = None, static_drafts: bool = False) -> DecodeState:
    """The prompt ids [1, T] through the base model -> a state of one row, the first new token its root
    (prefill_rows for one prompt)."""
    return prefill_rows(model, [ids[0]], sampling, [Row(0, 0, generator)], [drafter], static_drafts)


def decode_step(state: DecodeState, drafter: StepDrafter | None = None, max_depth: int = 0) -> tuple[list[int], int]:
    """One step from state.root (models/engine/step.py for a state of one row): draft (at most max_depth deep) ->
    verify -> accept -> commit.

    Returns (tokens, drafted): the accepted drafts followed by the bonus token (the new state.root);
    the first `drafted` tokens are drafts. No drafter, or a draft of the root alone: a plain 1-token step.
    """
    return step(state, [state.only_row()], [drafter], [max_depth])[0]


@torch.inference_mode()
def time_step(state: DecodeState, drafter: StepDrafter | None, max_depth: int, repeats: int,
              warmup: int = 1) -> list[dict]:
    """Seconds of each part (TIMED_PARTS, and "step": their sum) of `repeats` decode steps all taken from the
    same state (each rewound after it), after `warmup` untimed ones: the step a decoder takes, timed."""
    past, root = state.past, state.root
    if state.device.type == "cuda":
        state.sync = functools.partial(torch.cuda.synchronize, state.device)
    out = []
    for i in range(warmup + repeats):
        before = dict(state.timings)
        decode_step(state, drafter, max_depth)
        state.rewind(past, root)
        if drafter is not None:
            drafter.rewind(past)
        if i >= warmup:
            parts = {k: state.timings[k] - before[k] for k in TIMED_PARTS}
            parts["step"] = sum(parts[k] for k in TIMED_PARTS if k != "lm_head")   # lm_head is inside verify
            out.append(parts)
    state.sync = None
    return out


# -- the loop: generate and generate_batch (models/engine/batch.py) are its two doors ------------------------------
@dataclass(eq=False)
class Sequence(Row):
    """A row the loop decodes: its place among the prompts (results come back in that order), drafter, output."""
    index: int = 0
    drafter: StepDrafter | None = None
    out: Output | None = None
    accept_lengths: list = field(default_factory=list)
    finished_at: float = 0.0                            # seconds from the start until it stopped


def sequences(drafters: list, sampling: SamplingConfig, max_new_tokens: int, stops: set[int], device,
              seeds: list[int] | None = None, on_tokens=None) -> list[Sequence]:
    """One Sequence per drafter, each with its own generator: seeds[b], else sampling.seed + b (a lone sequence:
    sampling.seed), else a fresh seed, so a sequence's draws do not depend on its neighbours."""
    seqs = []
    for b, drafter in enumerate(drafters):
        g = torch.Generator(device=device)
        seed = seeds[b] if seeds is not None else (None if sampling.seed is None else sampling.seed + b)
        g.manual_seed(seed) if seed is not None else g.seed()
        seqs.append(Sequence(0, 0, g, index=b, drafter=drafter, out=Output(max_new_tokens, stops, on_tokens)))
    return seqs


def drop_rows(cache, rows: list[Sequence], staying: list[Sequence]) -> None:
    """Keep the cache rows of `staying` (rows: the sequences the cache's rows hold now, in order): freed, not
    masked, since a masked row would still cost a row of every verify forward. None staying: nothing to keep."""
    if not staying or len(staying) == len(rows) or cache.get_seq_length() == 0:
        return
    keep = [i for i, s in enumerate(rows) if any(s is t for t in staying)]
    cache.batch_select_indices(torch.tensor(keep, device=cache.layers[0].keys.device))
    longest = max(s.past for s in staying)          # a dropped row may have been the longest: no column past it
    for layer in cache.layers:                      # (here, not in kv_cache.py, which the train stages depend on)
        if isinstance(layer, GrowingLayer) and layer.get_seq_length() > longest:
            layer.keep_rows_of_each([], longest)


def leave(cache, live: list[Sequence], done: list[Sequence], t0: float) -> list[Sequence]:
    """The sequences still decoding; the others join `done` with their finishing time, their rows dropped."""
    staying = [s for s in live if not s.out.done]
    if len(staying) < len(live):
        now = time.perf_counter() - t0
        for s in live:
            if s.out.done:
                s.finished_at = now
                done.append(s)
        drop_rows(cache, live, staying)
    return staying


def decode_rows(state: DecodeState, seqs: list[Sequence], max_pos: int, t0: float) -> list[Sequence]:
    """Steps of every live row until each has stopped (its stop token, its token limit, the context), each drafting
    no deeper than its context and token limit allow -> the sequences in the order they stopped."""
    done, live = [], list(seqs)
    while live:
        for s in live:
            if s.past >= max_pos and not s.out.done:                        # no position left for its root
                s.out.stop_reason = "context_limit"
        live = state.rows = leave(state.cache, live, done, t0)
        if not live:
            break
        depths = [min(max_pos - 1 - s.past, s.out.max_new - len(s.out.tokens) - 1) for s in live]
        for s, (tokens, drafted) in zip(live, step(state, live, [s.drafter for s in live], depths)):
            s.accept_lengths.append(s.out.emit(tokens, [True] * drafted + [False]))
    return done


def decode(model, tokenizer, prompts: list[torch.Tensor], seqs: list[Sequence], sampling: SamplingConfig,
           static: bool = False, static_drafts: bool | None = None,
           device_clock: DeviceClock | None = None) -> list[GenerationResult]:
    """generate's and generate_batch's one core: every prompt (ids [T_b], one per sequence) prefilled at once, then
    steps until each sequence stops -> one GenerationResult per prompt, in order. static: the static step, a lone
    sequence's (attach_static); static_drafts: None follows static."""
    if static and len(seqs) > 1:
        raise ValueError(f"the static step decodes one sequence; this batch has {len(seqs)} (decode it eagerly)")
    if seqs[0].out.max_new == 0:
        return [GenerationResult([], "", [], 0, 0.0, [], stop_reason="max_new_tokens") for _ in seqs]
    base_logits(model)                                    # its one-time check outside the clock
    t0 = time.perf_counter()
    static_drafts = static if static_drafts is None else static_drafts
    state = prefill_rows(model, prompts, sampling, seqs, [s.drafter for s in seqs], static_drafts)
    if static:
        attach_static(state, seqs[0].drafter, seqs[0].out.max_new)   # None where it does not apply: stays eager
    prefill_time = time.perf_counter() - t0
    state.device_clock = device_clock
    for s in seqs:                                        # the prefill's token: the root of the first draft
        s.out.emit([s.root], [False])
    done = decode_rows(state, seqs, max_position(model), t0)
    sync = functools.partial(torch.cuda.synchronize, state.device) if state.device.type == "cuda" else None
    device_timings = device_clock.seconds(sync) if device_clock is not None else {}
    results = [None] * len(seqs)
    for s in done:
        text = tokenizer.decode(s.out.tokens, skip_special_tokens=True) if tokenizer is not None else ""
        results[s.index] = GenerationResult(s.out.tokens, text, s.accept_lengths, len(s.accept_lengths),
                                            s.finished_at, s.out.from_draft, prefill_time=prefill_time,
                                            timings=dict(state.timings), stop_reason=s.out.stop_reason,
                                            device_timings=dict(device_timings))
    return results


@torch.inference_mode()
def generate(model, tokenizer, input_ids, drafter: StepDrafter | None = None, sampling: SamplingConfig | None = None,
             max_new_tokens: int = 128, stop_token_ids=None, on_tokens=None, static: bool = False,
             static_drafts: bool | None = None, device_clock: DeviceClock | None = None) -> GenerationResult:
    """Decode one answer with `drafter` (models/engine/drafters: make_drafter), or without one: the
    autoregressive baseline. on_tokens(tokens: list[int], from_draft: list[bool]) is called as tokens are
    emitted (streaming). static: the static step (models/engine/static_step.py: fixed shapes, CUDA graphs on
    CUDA); a stage passes its host setting (pipelines/host.py static_step: off unless chosen). static_drafts:
    drafts replayed as CUDA graphs where the drafter can (models/engine/drafters/graphed.py); None: with the static
    step (False keeps them eager under it, to compare). device_clock: each step's parts also timed by its events
    (step.py DeviceClock), read once at the end into device_timings."""
    max_new_tokens = checked_max_new_tokens(max_new_tokens)
    sampling = sampling or SamplingConfig()
    device = next(model.parameters()).device
    seqs = sequences([drafter], sampling, max_new_tokens, resolve_stop_ids(model, tokenizer, stop_token_ids), device,
                     on_tokens=on_tokens)
    max_pos = max_position(model)
    ids = _as_ids(input_ids, device)
    if len(ids) > max_pos:
        raise ValueError(f"prompt has {len(ids)} tokens but the model's context is {max_pos} "
                         "(max_position_embeddings); shorten the prompt")
    return decode(model, tokenizer, [ids], seqs, sampling, static, static_drafts, device_clock)[0]
