"""Prompt lookup decoding in our own decoder: drafts copied from the context, verified by the same step as the heads.

    drafter = make_drafter({"kind": "prompt_lookup", "num_tokens": 8, "max_ngram": 3, "min_ngram": 2,
                            "tokens_per_ngram": 3})                              # the cpu profile's
    res = generate(model, tok, input_ids, drafter=drafter)

Drafting (prompt lookup decoding, the idea behind transformers' `prompt_lookup_num_tokens`): the
last n tokens of the context (prompt + everything generated so far, the root included) are looked
up earlier in the context, longest n first (max_ngram down to min_ngram), the most recent occurrence
winning; the tokens that followed it are proposed as a chain of drafts below the root, at most
num_tokens of them, and with tokens_per_ngram at most tokens_per_ngram * n. A short match is weak
evidence (in SmolLM2's greedy MT-Bench answers the token after a 1-gram match is right 22% of the
time, after a 3-gram match 81%) while on a CPU every drafted token makes the verify step dearer,
so there a short match proposes a short chain, or none (min_ngram = 2). Without a match the step
is a plain 1-token step (a chain of 0 drafts).
The drafts are deterministic (q = a point mass at each drafted token), which every acceptance rule
handles as is: greedy and typical never read q, and lossless sampling with draft_q = None treats
each child as a point mass (models/engine/acceptance.py), so the output distribution is the base model's.

NgramIndex keeps, for every n-gram seen, where the token after its most recent occurrence sits, and
is updated in O(max_ngram) per appended token: a lookup never scans the context.
"""
from __future__ import annotations

import torch

from models.engine.drafters.base import Draft, DraftContext
from models.engine.trees import TreeBuffers, chain_tree


class NgramIndex:
    """The context's tokens and, per n-gram, the position right after its most recent earlier occurrence.

        index = NgramIndex(max_ngram=3); index.extend([5, 6, 7, 5, 6])
        index.longest_match()                           # -> (2, 2): "5 6" seen before, followed at position 2
        index.continuation(num_tokens=4)                # -> [7, 5, 6, 7]: the tokens from there on (7 5 6 7 ...)
    """

    def __init__(self, max_ngram: int):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self._after: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]   # [n][ngram] -> position

    def extend(self, tokens) -> None:
        for tok in tokens:
            end = len(self.tokens)                 # the n-grams ending just before `tok` are now followed by it
            for n in range(1, min(self.max_ngram, end) + 1):
                self._after[n][tuple(self.tokens[end - n:end])] = end
            self.tokens.append(int(tok))

    def longest_match(self, min_ngram: int = 1) -> tuple[int, int]:
        """(n, start): the longest suffix n-gram (max_ngram down to min_ngram) that occurred earlier, and the
        position of the token after its most recent earlier occurrence; (0, -1) when none did."""
        L = len(self.tokens)
        for n in range(min(self.max_ngram, L - 1), min_ngram - 1, -1):
            start = self._after[n].get(tuple(self.tokens[L - n:]))
            if start is not None:                  # start < L: the suffix itself has no follower yet
                return n, start
        return 0, -1

    def copy_from(self, start: int, num_tokens: int) -> list[int]:
        """num_tokens tokens from position start on. A copy that runs into the end of the context goes on
        with what it copied (an overlapping copy, as in LZ77): after "... 7 7 7" the 3-gram "7 7 7" last
        occurred one token back, and the copy is "7 7 7 7", not the single 7 the context holds there."""
        out = self.tokens[start:start + num_tokens]
        period = len(self.tokens) - start
        while len(out) < num_tokens:
            out.append(out[len(out) - period])
        return out

    def continuation(self, num_tokens: int, min_ngram: int = 1) -> list[int]:
        """num_tokens tokens after the longest match (see longest_match); [] when nothing matches."""
        n, start = self.longest_match(min_ngram)
        return self.copy_from(start, num_tokens) if n else []


class PromptLookupDrafter:
    """A chain of context tokens per step (no model involved); each Draft's extras["ngram"] is the length of
    the n-gram it matched (0: none).

    num_tokens: longest chain; tokens_per_ngram: a match of n tokens proposes at most tokens_per_ngram * n
    (None: always up to num_tokens); n-grams from max_ngram down to min_ngram are looked up."""

    def __init__(self, num_tokens: int = 8, max_ngram: int = 3, min_ngram: int = 1,
                 tokens_per_ngram: int | None = None):
        if num_tokens < 1 or not 1 <= min_ngram <= max_ngram or (tokens_per_ngram is not None and tokens_per_ngram < 1):
            raise ValueError(f"prompt lookup needs num_tokens >= 1, 1 <= min_ngram <= max_ngram and tokens_per_ngram "
                             f">= 1 or None; got num_tokens={num_tokens}, min_ngram={min_ngram}, "
                             f"max_ngram={max_ngram}, tokens_per_ngram={tokens_per_ngram}")
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram
        self.tokens_per_ngram = tokens_per_ngram
        self.index = NgramIndex(max_ngram)
        self.device = torch.device("cpu")
        self._chains: dict[int, TreeBuffers] = {}

    def chain(self, m: int) -> TreeBuffers:
        """Buffers of a chain of m drafts below the root (m = 0: the root alone)."""
        if m not in self._chains:
            self._chains[m] = TreeBuffers.build(chain_tree(m, name=f"lookup{m}"))
        return self._chains[m]

    def start(self, ctx: DraftContext) -> None:
        """The prompt's tokens (its hidden states are unused: the drafts come from the tokens alone)."""
        self.index = NgramIndex(self.max_ngram)
        self.index.extend(ctx.input_ids.tolist())
        self.device = ctx.input_ids.device

    def draft(self, root: int, max_depth: int) -> Draft:
        """A chain of m drafts below the root; no draft_q: the drafts are deterministic."""
        self.index.extend([root])                  # the root is part of the context it drafts from
        n, start = self.index.longest_match(self.min_ngram)
        m = min(self.num_tokens, max_depth, n * (self.tokens_per_ngram or self.num_tokens))
        drafts = self.index.copy_from(start, m) if n and m > 0 else []
        tokens = torch.tensor([root, *drafts], dtype=torch.long, device=self.device)
        return Draft(self.chain(len(drafts)), tokens, extras={"ngram": n})

    def advance(self, hidden: torch.Tensor, tokens: list[int], position: int) -> None:
        """tokens: the accepted path (root first; the root is already in the context)."""
        self.index.extend(tokens[1:])

    def rewind(self, position: int) -> None:
        """Forget the context from `position` on (the index is rebuilt: O(position), for timing and tests)."""
        kept = self.index.tokens[:position]
        self.index = NgramIndex(self.max_ngram)
        self.index.extend(kept)


def build(spec: dict, **_) -> PromptLookupDrafter:
    """spec: num_tokens, max_ngram, min_ngram, tokens_per_ngram (PromptLookupDrafter's defaults for those left out)."""
    return PromptLookupDrafter(**{k: spec[k] for k in ("num_tokens", "max_ngram", "min_ngram", "tokens_per_ngram")
                                  if k in spec})
