"""Speculative decoding with draft heads on an unmodified transformers causal LM, and its baseline.

    from models.decoding import generate, SamplingConfig
    res = generate(model, tok, input_ids, heads=heads, tree=tree_spec, max_new_tokens=128)
    res = generate(model, tok, input_ids)                      # heads=None: the autoregressive baseline
    res.new_tokens, res.text, res.accept_lengths, res.mean_accepted_length, res.tokens_per_second

One speculative step (DESIGN.md section 3):
  1) draft:  the heads propose a tree of tokens below the root x_{t+1} (Drafter)
  2) verify: ONE forward of the base decoder over root + tree nodes with a 4-D additive mask
             (prefix visible, tree part = tree mask) and position_ids = past + depth
  3) accept: greedy / typical / lossless sampling -> accepted path + bonus token
  4) commit: keep only the accepted path's KV rows; the heads read the last accepted hidden state
The prefill token and every bonus token come from the base model, so len(new_tokens) ==
1 + sum(accept_lengths): accept_lengths[i] = tokens emitted by decoding step i (baseline: 1).
Stop rules, shared by both loops: the first stop token ends the answer (and is kept); tokens
beyond max_new_tokens are dropped; positions never exceed max_position_embeddings - 1 (the
tree is cut to the depth that still fits, then decoding stops cleanly).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from models import acceptance
from models.acceptance import NodeLogits, SamplingConfig, sample, typical_probs, warp_probs
from models.drafting import Drafter
from models.kv_cache import keep_accepted, new_cache
from models.projection import project
from models.trees import TreeBuffers, TreeSpec

__all__ = ["SamplingConfig", "GenerationResult", "generate", "verify_tree"]


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

    @property
    def mean_accepted_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 1.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.new_tokens) / self.wall_time if self.wall_time > 0 else 0.0

    def to_dict(self) -> dict:
        return {"new_tokens": self.new_tokens, "text": self.text, "accept_lengths": self.accept_lengths,
                "steps": self.steps, "wall_time": self.wall_time, "from_draft": self.from_draft,
                "prefill_time": self.prefill_time, "timings": self.timings, "stop_reason": self.stop_reason,
                "mean_accepted_length": self.mean_accepted_length, "tokens_per_second": self.tokens_per_second}


class _Output:
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


def verify_tree(decoder, tokens: torch.Tensor, buf: TreeBuffers, cache, past: int,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One base forward over the tree tokens [N] after `past` cached positions -> hidden [N, h].

    The cache grows by N rows (prune them with kv_cache.keep_accepted).
    """
    N = tokens.numel()
    mask = torch.zeros(1, 1, N, past + N, dtype=dtype, device=tokens.device)   # prefix columns: all visible
    mask[..., past:] = buf.additive_mask(dtype, tokens.device)                 # tree part: ancestors + self
    position_ids = (buf.depth.to(tokens.device) + past).unsqueeze(0)           # [1, N]
    out = decoder(input_ids=tokens.unsqueeze(0), attention_mask=mask, position_ids=position_ids,
                  past_key_values=cache, use_cache=True)
    return out.last_hidden_state[0]


def _first_token(logits: torch.Tensor, sampling: SamplingConfig, generator, speculative: bool = False) -> int:
    """Token from base logits [V]: argmax when greedy, else a draw from the warped distribution
    (from the typical set when speculative decoding uses typical acceptance, as Medusa does)."""
    if sampling.greedy:
        return int(logits.argmax())
    if speculative and sampling.acceptance == "typical":
        return sample(typical_probs(logits, sampling), generator)
    return sample(warp_probs(logits, sampling), generator)


def _as_ids(input_ids, device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"generate decodes one sequence (batch size 1), got input_ids of shape {tuple(ids.shape)}")
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty list or [T] / [1, T] tensor, got shape {tuple(ids.shape)}")
    return ids.unsqueeze(0)                                                      # [1, T]


@torch.inference_mode()
def generate(model, tokenizer, input_ids, heads=None, tree: TreeSpec | TreeBuffers | None = None,
             sampling: SamplingConfig | None = None, max_new_tokens: int = 128, stop_token_ids=None,
             on_tokens=None) -> GenerationResult:
    """Decode one answer. heads=None: autoregressive baseline; otherwise speculative with `tree`.

    on_tokens(tokens: list[int], from_draft: list[bool]) is called as tokens are emitted (streaming).
    """
    sampling = sampling or SamplingConfig()
    device, dtype = next(model.parameters()).device, model.dtype
    generator = torch.Generator(device=device)
    if sampling.seed is not None:
        generator.manual_seed(sampling.seed)
    else:
        generator.seed()
    stops = resolve_stop_ids(model, tokenizer, stop_token_ids)
    out = _Output(max_new_tokens, stops, on_tokens)
    decoder, lm_head = model.get_decoder(), model.get_output_embeddings()
    max_pos = int(getattr(model.config, "max_position_embeddings", 1 << 30))
    ids = _as_ids(input_ids, device)
    if ids.shape[1] > max_pos:
        raise ValueError(f"prompt has {ids.shape[1]} tokens but the model's context is {max_pos} "
                         "(max_position_embeddings); shorten the prompt")
    buf_full = None
    if heads is not None:
        if tree is None:
            raise ValueError("speculative decoding needs a tree (TreeSpec or TreeBuffers); pass heads=None for the baseline")
        spec = tree.spec if isinstance(tree, TreeBuffers) else tree
        spec.check_heads(heads.config.num_heads)
        buf_full = TreeBuffers.build(spec)
    t0 = time.perf_counter()
    timings = {"draft": 0.0, "verify": 0.0, "accept": 0.0, "commit": 0.0}
    accept_lengths: list[int] = []
    if max_new_tokens <= 0:
        return GenerationResult([], "", [], 0, 0.0, [], stop_reason="max_new_tokens")

    # 1) prefill: the prompt through the base model -> first token (the root of the first tree)
    cache = new_cache()
    hidden = decoder(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state[0]   # [T, h]
    root = _first_token(project(lm_head, hidden[-1:])[0], sampling, generator, speculative=heads is not None)
    drafter = None
    if heads is not None:
        drafter = Drafter(heads, sampling, generator)
        drafter.start(hidden)
    prefill_time = time.perf_counter() - t0
    out.emit([root], [False])
    past = ids.shape[1]                                   # cached positions; the root sits at position `past`

    # 2) decoding steps
    while not out.done:
        if past >= max_pos:                               # the root itself has no position left
            out.stop_reason = "context_limit"
            break
        t1 = time.perf_counter()
        if heads is None:                                 # baseline: one token per step
            h = decoder(input_ids=torch.tensor([[root]], device=device), position_ids=torch.tensor([[past]], device=device),
                        past_key_values=cache, use_cache=True).last_hidden_state[0, -1]
            logits = project(lm_head, h[None])[0]                                        # [V]
            t2 = time.perf_counter()
            root = _first_token(logits, sampling, generator)
            t3 = time.perf_counter()
            timings["verify"] += t2 - t1
            timings["accept"] += t3 - t2
            past += 1
            accept_lengths.append(out.emit([root], [False]))
            continue
        # a) draft (with a tree cut to what fits before the context limit and the token limit)
        depth = min(buf_full.spec.depth, max_pos - 1 - past, max_new_tokens - len(out.tokens) - 1)
        buf = buf_full if depth >= buf_full.spec.depth else TreeBuffers.build(buf_full.spec.truncated(depth))
        tokens, draft_q = drafter.draft(root, buf)
        t2 = time.perf_counter()
        # b) verify
        hidden = verify_tree(decoder, tokens, buf, cache, past, dtype)                        # [N, h]
        t3 = time.perf_counter()
        # c) accept (the LM head runs on the nodes with children, then on a leaf if the path ends there)
        node_logits = NodeLogits(hidden, lm_head)
        path, bonus = acceptance.ACCEPTANCE["greedy" if sampling.greedy else sampling.acceptance](
            tokens, buf, node_logits, sampling, generator, draft_q)
        t4 = time.perf_counter()
        # d) commit: only the accepted path stays in the base cache and enters the drafter's state
        keep_accepted(cache, past, path, buf.num_tokens)
        drafter.advance(hidden[path], past)
        past += len(path)
        drafted = tokens[path[1:]].tolist()
        t5 = time.perf_counter()
        timings["draft"] += t2 - t1
        timings["verify"] += t3 - t2 + node_logits.seconds          # forward + LM head
        timings["accept"] += t4 - t3 - node_logits.seconds
        timings["commit"] += t5 - t4
        accept_lengths.append(out.emit(drafted + [bonus], [True] * len(drafted) + [False]))
        root = bonus

    wall = time.perf_counter() - t0
    text = tokenizer.decode(out.tokens, skip_special_tokens=True) if tokenizer is not None else ""
    return GenerationResult(out.tokens, text, accept_lengths, len(accept_lengths), wall, out.from_draft,
                            prefill_time=prefill_time, timings=timings, stop_reason=out.stop_reason)
