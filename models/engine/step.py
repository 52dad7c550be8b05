"""The decode step, for one sequence or B at once: draft -> verify -> accept -> commit.

    outs = step(state, rows, drafters, max_depths)      # per row: (tokens emitted, how many of them were drafts)

`state` (DecodeState) holds what the rows share: the decoder, base_logits, the cache, sampling, dtype, device, the
timings and clock(), and its rows; generate decodes a state of one row, generate_batch one of B. A Row has `past`
(its committed positions), `root` (its last emitted token, not yet in the cache) and `generator`.

  1) draft:  each row's drafter proposes a tree below its root, at most max_depths[b] deep; B > 1 drafts fixed trees
             of one kind together (drafters/tree.py draft_many), B = 1 asks its drafter alone (which may hand back a
             DeviceTree: a grown or replayed draft that never left the device);
  2) verify: ONE forward over every row's tree (a row without one: its root alone), padded to the largest, written
             at the cache's columns L.. (L = its length: the longest row; B = 1: the row's own past). Row b's queries
             sit at positions past_b + depth and see its committed columns, its tree's ancestors and themselves
             (row_masks); a padding query sees itself only. A lone 1-token step on a cache of its own columns
             only (a batch's neighbours dropped, its cache cut to it) runs with no mask at all;
  3) accept: each row's rule on its own rows of the LM head (B > 1: the rows of every small tree in one product, as
             a CPU reads the LM head's weights once for them all), with its own generator;
  4) commit: row b's accepted columns move down to past_b.. (kv_cache.keep_accepted), its drafter advances over
             them, its root becomes the bonus token.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from models.engine import acceptance
from models.engine.acceptance import NodeLogits, SamplingConfig, accept_on_device, sample, typical_probs, warp_probs
from models.engine.drafters.base import DeviceTree
from models.engine.drafters.tree import draft_many
from models.engine.kv_cache import cache_kwargs, keep_accepted
from models.engine.projection import BaseLogits
from models.engine.taps import step_taps

TIMED_PARTS = ("draft", "verify", "lm_head", "accept", "commit")
DEVICE_PARTS = ("draft", "forward", "accept", "commit")     # on the device: the verify's forward, then the LM head
                                                            # with the rule (one span: no event inside the rule)


def zero_timings() -> dict:
    return dict.fromkeys(TIMED_PARTS, 0.0)


class HostEvent:
    """An event of the host's clock with torch.cuda.Event's two methods: DeviceClock's stand-in where there is no
    device clock (the CPU, where the host's time is the device's)."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: "HostEvent") -> float:
        return 1e3 * (end.t - self.t)                                                      # ms, as CUDA's


class DeviceClock:
    """Events at each step's part boundaries, recorded without a synchronisation (replayed graphs keep running
    ahead of the host, so host clocks read enqueue time) and read once after the run: each part's device time.

        clock = DeviceClock()                          # torch.cuda.Event; DeviceClock(HostEvent) on the CPU
        generate(..., device_clock=clock).device_timings       # seconds summed over steps, DEVICE_PARTS"""

    def __init__(self, event: Callable[[], object] | None = None):
        self.event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self.steps: list[list] = []

    def mark(self, marks: list | None) -> None:
        if marks is not None:
            e = self.event()
            e.record()
            marks.append(e)

    def seconds(self, synchronize: Callable[[], None] | None = None) -> dict:
        if synchronize is not None:
            synchronize()
        total = dict.fromkeys(DEVICE_PARTS, 0.0)
        for marks in self.steps:
            for k, start, end in zip(DEVICE_PARTS, marks, marks[1:]):
                total[k] += start.elapsed_time(end) / 1e3
        return total


@dataclass(eq=False)
class Row:
    """One sequence as the step sees it: `past` committed positions in the cache, then `root`, its last emitted
    token (not yet in the cache), and its own generator (None: greedy needs none). Compared by identity."""
    past: int
    root: int
    generator: torch.Generator | None = None


@dataclass
class DecodeState:
    """What B rows decoding together share, and the rows: the decoder, base_logits (hidden -> the model's own
    logits, projection.base_logits), the cache, sampling, dtype, device. timings: seconds summed over steps: draft,
    verify (forward + LM head), lm_head (its LM-head share, the model's logit transform included), accept (the rule
    alone), commit (KV pruning + drafter state). sync: called before each clock read when timings must be exact on
    an asynchronous device (time_step). device_clock: each part's device time too (DeviceClock).
    A state of one row also reads and sets that row's past, root and generator as its own (the loop by hand)."""
    decoder: torch.nn.Module
    base_logits: BaseLogits
    cache: object
    sampling: SamplingConfig
    dtype: torch.dtype
    device: torch.device
    rows: list = field(default_factory=list)
    timings: dict = field(default_factory=zero_timings)
    sync: Callable[[], None] | None = None
    device_clock: DeviceClock | None = None

    def clock(self) -> float:
        if self.sync is not None:
            self.sync()
        return time.perf_counter()

    def only_row(self) -> Row:
        if len(self.rows) != 1:
            raise ValueError(f"state.past, .root and .generator are a lone row's; this state has {len(self.rows)} "
                             "rows (read state.rows[b])")
        return self.rows[0]

    past = property(lambda self: self.only_row().past, lambda self, v: setattr(self.only_row(), "past", v))
    root = property(lambda self: self.only_row().root, lambda self, v: setattr(self.only_row(), "root", v))
    generator = property(lambda self: self.only_row().generator,
                         lambda self, v: setattr(self.only_row(), "generator", v))

    def rewind(self, past: int, root: int) -> None:
        """A state of one row back to `past` cached positions with `root` next (the cache's columns from `past` on
        dropped); the drafter is rewound with drafter.rewind(past)."""
        if not 0 < past <= self.past:
            raise ValueError(f"can only rewind to 0 < past <= {self.past} cached positions, got {past}")
        self.cache.crop(past - self.cache.get_seq_length())   # a negative crop: the columns to drop
        self.past, self.root = past, int(root)


def first_token(logits: torch.Tensor, sampling: SamplingConfig, generator, speculative: bool = False) -> int:
    """Token from base logits [V]: argmax when greedy, else a draw from the warped distribution
    (from the typical set when speculative decoding uses typical acceptance, as Medusa does)."""
    if sampling.greedy:
        return int(logits.argmax())
    if speculative and sampling.acceptance == "typical":
        return sample(typical_probs(logits, sampling), generator)
    return sample(warp_probs(logits, sampling), generator)


def drafter_taps(drafter) -> tuple[int, ...]:
    """The base states a drafter reads in place of the final hidden states (EAGLE-3), or none."""
    return tuple(getattr(drafter, "taps", ()) or ()) if drafter is not None else ()


def tree_of(draft):
    """A draft's tree (its TreeBuffers, or the DeviceTree itself); None for no draft or a draft of the root alone."""
    tree = draft if draft is None or isinstance(draft, DeviceTree) else draft.buf
    return None if tree is None or tree.num_tokens == 1 else tree


# -- masks ----------------------------------------------------------------------------------------
def attention_masks(config, visible: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor | None,
                    dtype: torch.dtype) -> torch.Tensor | dict:
    """visible [B, Q, K] bool -> the additive mask [B, 1, Q, K]; a model with a sliding window also hides keys a
    window or more behind their query (q_pos [B, Q], k_pos [B, K]; None without a window): one mask when every layer
    slides (Mistral),
    else {"full_attention", "sliding_attention"} per layer type (Qwen2, Gemma-2), the mapping their forward takes."""
    lowest = torch.finfo(dtype).min
    full = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, lowest)[:, None]
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window or (types is not None and "sliding_attention" not in types):
        return full
    too_far = (q_pos[:, :, None] - k_pos[:, None, :] >= window)[:, None]
    sliding = full.masked_fill(too_far, lowest)
    return sliding if types is None else {"full_attention": full, "sliding_attention": sliding}


def _block(tree) -> torch.Tensor:
    """A tree's [n, n] bool: node i sees node j (an ancestor, or itself)."""
    return tree.ancestors if isinstance(tree, DeviceTree) else tree.tree_mask.reshape(tree.num_tokens, tree.num_tokens)


def row_masks(config, trees: list, pasts: list[int], L: int, dtype: torch.dtype, device):
    """The verify step's inputs for rows of trees (None: the root alone) after a cache of L columns -> (mask
    [B, 1, N, L + N] or per-layer-type masks, depth [B, N]: each query's position, past_b + its depth)."""
    sizes = [1 if t is None else t.num_tokens for t in trees]
    B, N = len(trees), max(sizes)
    depth = torch.zeros(B, N, dtype=torch.long, device=device)
    visible = torch.zeros(B, N, L + N, dtype=torch.bool, device=device)
    cols = torch.arange(L, device=device)
    for b, (t, n, past) in enumerate(zip(trees, sizes, pasts)):
        visible[b, :, :L] = cols < past                                       # its committed columns
        if t is None:
            visible[b, 0, L] = True
        else:
            visible[b, :n, L:L + n] = _block(t).to(device)                   # ancestors + self
            depth[b, :n] = t.depth.to(device)
        visible[b, range(n, N), range(L + n, L + N)] = True                  # padding queries: themselves only
        depth[b] += past
    k_pos = torch.cat([cols.expand(B, -1), depth], 1) if getattr(config, "sliding_window", None) else None
    return attention_masks(config, visible, depth, k_pos, dtype), depth


def prompt_inputs(config, prompts: list[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
    """The prefill's prompts (ids [T_b]) -> (input_ids [B, T], the forward's other inputs). One prompt goes as it is,
    with no mask and no positions (the model's own causal mask); several are right-padded, each row causal over its
    own tokens and blind to its padding (attention_mask, position_ids)."""
    if len(prompts) == 1:
        return prompts[0][None], {}
    device = prompts[0].device
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    T = int(lengths.max())
    ids = torch.zeros(len(prompts), T, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    pos = torch.arange(T, device=device)
    visible = (pos[None, :, None] >= pos[None, None, :]) & (pos[None, None, :] < lengths[:, None, None])
    positions = pos.expand(len(prompts), T)
    return ids, {"attention_mask": attention_masks(config, visible, positions, positions, dtype),
                 "position_ids": positions}


# -- the four parts -------------------------------------------------------------------------------
def draft_rows(rows, drafters: list, max_depths: list[int]) -> list:
    if drafters[0] is None:
        return [None] * len(rows)
    if len(rows) == 1:
        return [drafters[0].draft(rows[0].root, max_depths[0])]
    return draft_many(drafters, [r.root for r in rows], max_depths)


def verify(state, rows, drafts: list, L: int) -> torch.Tensor:
    """One forward over every row's tree -> hidden [B, N, h]; the cache grows by N columns."""
    trees = [tree_of(d) for d in drafts]
    if len(rows) == 1 and trees[0] is None and L == rows[0].past:   # a plain 1-token step on a cache of its own
        # columns only: no mask, nothing to pad (a garbage column past the row's own would be seen unmasked)
        r = rows[0]
        return state.decoder(input_ids=torch.tensor([[r.root]], device=state.device),
                             position_ids=torch.tensor([[r.past]], device=state.device), use_cache=True,
                             **cache_kwargs(state.decoder, state.cache)).last_hidden_state
    N = max(1 if t is None else t.num_tokens for t in trees)
    ids = torch.zeros(len(rows), N, dtype=torch.long, device=state.device)
    for b, (r, d, t) in enumerate(zip(rows, drafts, trees)):
        if t is None:
            ids[b, 0] = r.root
        else:
            ids[b, :t.num_tokens] = d.tokens.to(state.device)
    mask, depth = row_masks(state.decoder.config, trees, [r.past for r in rows], L, state.dtype, state.device)
    return state.decoder(input_ids=ids, attention_mask=mask, position_ids=depth, use_cache=True,
                         **cache_kwargs(state.decoder, state.cache)).last_hidden_state


def _small_trees_logits(state, drafts: list, hidden: torch.Tensor) -> tuple[dict, float]:
    """B > 1: the LM head over every row that acceptance reads whole (a root alone, a tree of at most
    NodeLogits.EAGER_ROWS) in one product -> ({b: [n, V]}, seconds)."""
    if len(drafts) == 1:                  # B = 1: NodeLogits reads its own rows (the same product)
        return {}, 0.0
    sizes = {b: 1 if tree_of(d) is None else tree_of(d).num_tokens for b, d in enumerate(drafts)}
    eager = [b for b, n in sizes.items() if n <= NodeLogits.EAGER_ROWS and not isinstance(drafts[b], DeviceTree)]
    if not eager:
        return {}, 0.0
    start = state.clock()
    out = state.base_logits(torch.cat([hidden[b, :sizes[b]] for b in eager]))
    return dict(zip(eager, out.split([sizes[b] for b in eager]))), state.clock() - start


def accept(state, rows, drafters: list, drafts: list, hidden: torch.Tensor) -> tuple[list, list, float]:
    """Each row's acceptance -> (paths, (accepted drafts, bonus) per row, seconds of LM head in it)."""
    computed, lm_head = _small_trees_logits(state, drafts, hidden)
    paths, emitted = [], []
    for b, (r, drafter, d) in enumerate(zip(rows, drafters, drafts)):
        speculative = drafter is not None
        if isinstance(d, DeviceTree):                      # accepted on the device, every row's logits
            start = state.clock()
            logits = state.base_logits(hidden[b, :d.num_tokens])
            lm_head += state.clock() - start
            path, drafted, bonus = accept_on_device(d, logits)
        elif tree_of(d) is None:                            # a plain step: the root's row alone
            if b in computed:
                logits = computed[b][0]
            else:
                start = state.clock()
                logits = state.base_logits(hidden[b, :1])[0]
                lm_head += state.clock() - start
            path, drafted, bonus = [0], [], first_token(logits, state.sampling, r.generator, speculative)
        else:
            node_logits = NodeLogits(hidden[b, :d.buf.num_tokens], state.base_logits)
            if b in computed:
                node_logits.cache = dict(enumerate(computed[b]))
            path, bonus = acceptance.rule_for(state.sampling)(d.tokens, d.buf, node_logits, state.sampling,
                                                              r.generator, d.draft_q)
            lm_head += node_logits.seconds
            drafted = d.tokens[path[1:]].tolist()
        paths.append(path)
        emitted.append((drafted, bonus))
    return paths, emitted, lm_head


def step(state, rows, drafters: list, max_depths: list[int]) -> list[tuple[list[int], int]]:
    """One step for every row (module docstring) -> per row (its accepted drafts then its bonus token, how many
    drafts); each row's past and root move on."""
    device = state.device_clock                       # events beside the host's clock reads (DeviceClock)
    marks = None if device is None else []
    mark = (lambda: None) if device is None else (lambda: device.mark(marks))
    t1 = state.clock()
    mark()
    drafts = draft_rows(rows, drafters, max_depths)
    tapped = step_taps(state.decoder, drafter_taps(drafters[0]))   # hooks, or the static step's buffer
    t2 = state.clock()
    mark()
    L = state.cache.get_seq_length()
    with tapped:
        hidden = verify(state, rows, drafts, L)                                              # [B, N, h]
    t3 = state.clock()
    mark()
    paths, emitted, lm_head = accept(state, rows, drafters, drafts, hidden)
    t4 = state.clock()
    mark()
    keep_accepted(state.cache, L, [r.past for r in rows], paths)   # only the accepted paths stay in the cache
    features = hidden if not tapped.taps else tapped.features()                              # [B, N, w]
    for b, (r, drafter, path, (drafted, bonus)) in enumerate(zip(rows, drafters, paths, emitted)):
        if drafter is not None:                                    # its state follows its accepted path
            drafter.advance(features[b][path], [r.root, *drafted], r.past)
        r.past, r.root = r.past + len(path), bonus
    timings = state.timings
    for k, v in (("draft", t2 - t1), ("verify", t3 - t2 + lm_head), ("lm_head", lm_head),
                 ("accept", t4 - t3 - lm_head), ("commit", state.clock() - t4)):
        timings[k] += v
    if device is not None:
        mark()
        device.steps.append(marks)
    return [(drafted + [bonus], len(drafted)) for drafted, bonus in emitted]
