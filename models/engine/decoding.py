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

One step (decode_step: models/engine/step.py at B = 1, the one step generate_batch runs too; docs/design.md#the-decode-step):
  1) draft:  the drafter proposes a tree of tokens below the root x_{t+1} and names its buffers (a Draft:
             the heads' tree, a chain of context tokens, ...); m = 0 drafts (or no drafter) is a plain
             1-token step
  2) verify: ONE forward of the base decoder over root + tree nodes with a 4-D additive mask
             (prefix visible, tree part = tree mask) and position_ids = past + depth
  3) accept: greedy / typical / lossless sampling -> accepted path + bonus token
  4) commit: keep only the accepted path's KV rows; the drafter advances over the accepted path
The prefill token and every bonus token come from the base model, so len(new_tokens) ==
1 + sum(accept_lengths): accept_lengths[i] = tokens emitted by decoding step i (baseline: 1).
Stop rules (generate's loop): the first stop token ends the answer (and is kept); tokens beyond
max_new_tokens are dropped; positions never exceed max_position_embeddings - 1 (the draft is cut
to the depth that still fits, then decoding stops cleanly).
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch

from models.engine.acceptance import SamplingConfig
from models.engine.drafters.base import DeviceTree, DraftContext, StepDrafter
from models.engine.kv_cache import cache_kwargs, new_cache
from models.engine.projection import BaseLogits, base_logits
from models.engine.static_step import attach_static
from models.engine.step import TIMED_PARTS, DeviceClock, drafter_taps, first_token, row_masks, step, zero_timings
from models.engine.step import verify as step_verify
from models.engine.taps import LayerTaps
from models.engine.trees import TreeBuffers

__all__ = ["SamplingConfig", "GenerationResult", "DecodeState", "prefill", "decode_step", "time_step", "generate"]


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


def verify_tree(decoder, tokens: torch.Tensor, buf: TreeBuffers | DeviceTree, cache, past: int,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One base forward over the tree tokens [N] after `past` cached positions -> hidden [N, h] (the decode step's
    verify at B = 1, by hand). The cache grows by N rows (prune them with kv_cache.keep_accepted)."""
    state = SimpleNamespace(decoder=decoder, cache=cache, dtype=dtype, device=tokens.device)
    row = SimpleNamespace(past=past, root=int(tokens[0]))
    return step_verify(state, [row], [SimpleNamespace(buf=buf, tokens=tokens)], past)[0]


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


def _as_ids(input_ids, device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"generate decodes one sequence (batch size 1), got input_ids of shape {tuple(ids.shape)}")
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty list or [T] / [1, T] tensor, got shape {tuple(ids.shape)}")
    return ids.unsqueeze(0)                                                      # [1, T]


# -- the decode step ---------------------------------------------------------------------------------
@dataclass
class DecodeState:
    """One sequence being decoded: `past` positions in the base cache, then `root`, the last emitted
    token (not yet in the cache); base_logits: hidden -> the model's own logits (projection.base_logits).
    timings: seconds summed over steps: draft, verify (forward + LM head), lm_head (its LM-head share, the
    model's logit transform included), accept (the rule alone), commit (KV pruning + drafter state).
    sync: called before each clock read when timings must be exact on an asynchronous device (time_step)."""
    decoder: torch.nn.Module
    base_logits: BaseLogits
    cache: object
    past: int
    root: int
    sampling: SamplingConfig
    generator: torch.Generator | None
    dtype: torch.dtype
    device: torch.device
    timings: dict = field(default_factory=zero_timings)
    sync: Callable[[], None] | None = None
    device_clock: DeviceClock | None = None             # each part's device time too (step.py DeviceClock)

    def rewind(self, past: int, root: int) -> None:
        """Back to `past` cached positions with `root` next (drop the cache rows from `past` on); the
        drafter is rewound with drafter.rewind(past)."""
        if not 0 < past <= self.past:
            raise ValueError(f"can only rewind to 0 < past <= {self.past} cached positions, got {past}")
        self.cache.crop(past - self.cache.get_seq_length())   # a negative crop: the rows to drop
        self.past, self.root = past, int(root)

    def clock(self) -> float:
        if self.sync is not None:
            self.sync()
        return time.perf_counter()


def prefill(model, ids: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None = None,
            drafter: StepDrafter | None = None, static_drafts: bool = False) -> DecodeState:
    """The prompt ids [1, T] through the base model -> the state with the first new token as root. static_drafts:
    the drafter may replay its drafts as CUDA graphs (DraftContext.static)."""
    decoder, logits = model.get_decoder(), base_logits(model)        # checked against the model once per model
    cache = new_cache()
    with LayerTaps(decoder, drafter_taps(drafter)) as tapped:
        hidden = decoder(input_ids=ids, use_cache=True, **cache_kwargs(decoder, cache)).last_hidden_state[0]  # [T, h]
    root = first_token(logits(hidden[-1:])[0], sampling, generator, speculative=drafter is not None)
    if drafter is not None:
        features = hidden if not tapped.taps else tapped.features()[0]                               # [T, w]
        drafter.start(DraftContext(ids[0], features, sampling, generator, static=static_drafts))
    return DecodeState(decoder, logits, cache, ids.shape[1], root, sampling, generator, model.dtype, ids.device)


def decode_step(state: DecodeState, drafter: StepDrafter | None = None, max_depth: int = 0) -> tuple[list[int], int]:
    """One step from state.root (models/engine/step.py, at B = 1: the state is its own row): draft (at most
    max_depth deep) -> verify -> accept -> commit.

    Returns (tokens, drafted): the accepted drafts followed by the bonus token (the new state.root);
    the first `drafted` tokens are drafts. No drafter, or a draft of the root alone: a plain 1-token step.
    """
    return step(state, [state], [drafter], [max_depth])[0]


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
    generator = torch.Generator(device=device)
    if sampling.seed is not None:
        generator.manual_seed(sampling.seed)
    else:
        generator.seed()
    stops = resolve_stop_ids(model, tokenizer, stop_token_ids)
    out = Output(max_new_tokens, stops, on_tokens)
    max_pos = int(getattr(model.config, "max_position_embeddings", 1 << 30))
    ids = _as_ids(input_ids, device)
    if ids.shape[1] > max_pos:
        raise ValueError(f"prompt has {ids.shape[1]} tokens but the model's context is {max_pos} "
                         "(max_position_embeddings); shorten the prompt")
    accept_lengths: list[int] = []
    if max_new_tokens <= 0:
        return GenerationResult([], "", [], 0, 0.0, [], stop_reason="max_new_tokens")

    # 1) prefill: the prompt through the base model -> first token (the root of the first draft)
    base_logits(model)                                    # its one-time check outside the clock
    t0 = time.perf_counter()
    static_drafts = static if static_drafts is None else static_drafts
    state = prefill(model, ids, sampling, generator, drafter, static_drafts)
    if static:
        attach_static(state, drafter, max_new_tokens)      # None where it does not apply: the step stays eager
    prefill_time = time.perf_counter() - t0
    state.device_clock = device_clock
    out.emit([state.root], [False])

    # 2) decoding steps, each drafting no deeper than the context and the token limit allow
    while not out.done:
        if state.past >= max_pos:                         # the root itself has no position left
            out.stop_reason = "context_limit"
            break
        max_depth = min(max_pos - 1 - state.past, max_new_tokens - len(out.tokens) - 1)
        tokens, drafted = decode_step(state, drafter, max_depth)
        accept_lengths.append(out.emit(tokens, [True] * drafted + [False]))

    wall = time.perf_counter() - t0
    text = tokenizer.decode(out.tokens, skip_special_tokens=True) if tokenizer is not None else ""
    sync = functools.partial(torch.cuda.synchronize, device) if device.type == "cuda" else None
    return GenerationResult(out.tokens, text, accept_lengths, len(accept_lengths), wall, out.from_draft,
                            prefill_time=prefill_time, timings=state.timings, stop_reason=out.stop_reason,
                            device_timings=device_clock.seconds(sync) if device_clock is not None else {})
