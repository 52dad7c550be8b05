"""DSpark's two small heads on DFlash's block (arXiv 2607.05147; DeepSpec's code; the speculators library's `dspark`
model_definitions.py, read for facts): a Markov head that biases each block position's logits by the token before it,
and a confidence head that predicts whether the position will be accepted.

    markov = MarkovHead(target_vocab=V, draft_vocab=Vd, hidden=h, rank=256, kind="vanilla")
    bias = markov(prev_tokens [..., K], hidden [..., K, h])      # -> [..., K, Vd], added to the draft logits
    conf = ConfidenceHead(h, rank)(hidden, markov.embed(prev))  # -> [..., K] logits of P(accepted)

Vanilla: bias = W2(W1[prev]), W1 an embedding of rank r over the target's vocabulary, W2 r -> Vd (no bias).
Gated:   bias = W2(sigmoid(G([h; e])) * e), e = W1[prev].
Rnn:     a state s over the block's positions, z = [s, e, h] -> (g, c, o) = chunks of R(z); s = sig(g) s +
         (1 - sig(g)) tanh(c); bias = W2(tanh(o)); s starts at zero at the block's slot 0, so slot k's state has
         run over slots 0..k (either way of sample_from_anchor, as the library's).
Initialised as the library's: W1 normal with std 0.01, every linear torch's default.
"""
from __future__ import annotations

import torch
from torch import nn

KINDS = ("vanilla", "gated", "rnn")
RANK = 256                      # the library's and the paper's default markov_rank


class MarkovHead(nn.Module):
    def __init__(self, target_vocab: int, draft_vocab: int, hidden: int, rank: int = RANK, kind: str = "vanilla"):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"markov head kind {kind!r} is not known; use one of {list(KINDS)}")
        self.kind, self.rank = kind, int(rank)
        self.w1 = nn.Embedding(target_vocab, rank)
        nn.init.normal_(self.w1.weight, std=0.01)
        self.w2 = nn.Linear(rank, draft_vocab, bias=False)
        if kind == "gated":
            self.gate = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.cell = nn.Linear(2 * rank + hidden, 3 * rank)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        return self.w1(prev)

    def forward(self, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """prev [..., K] (the token before each of K block positions), hidden [..., K, h] -> bias [..., K, Vd]. For the
        rnn kind the K positions are the block's in order (the state runs along them)."""
        e = self.w1(prev).to(hidden.dtype)
        if self.kind == "vanilla":
            return self.w2(e)
        if self.kind == "gated":
            return self.w2(torch.sigmoid(self.gate(torch.cat([hidden, e], -1))) * e)
        return self.w2(torch.tanh(self.rnn_outputs(e, hidden)))

    def last(self, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The bias of the last of K positions only: prev [R, K], hidden [R, K, h] -> [R, Vd] (drafting, where each
        node's path is its block positions so far; only the rnn reads more than the last)."""
        if self.kind != "rnn":
            return self(prev[:, -1:], hidden[:, -1:])[:, 0]
        return self.w2(torch.tanh(self.rnn_outputs(self.w1(prev).to(hidden.dtype), hidden)[:, -1]))

    def rnn_outputs(self, e: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The rnn's o at every position: e, hidden [..., K, r|h] -> [..., K, r]."""
        s = e.new_zeros(*e.shape[:-2], self.rank)
        outs = []
        for k in range(e.shape[-2]):
            g, c, o = self.cell(torch.cat([s, e[..., k, :], hidden[..., k, :]], -1)).chunk(3, -1)
            s = torch.sigmoid(g) * s + (1 - torch.sigmoid(g)) * torch.tanh(c)
            outs.append(o)
        return torch.stack(outs, -2)


class ConfidenceHead(nn.Module):
    """Linear([h; e] -> 1): the logit that a block position's draft is accepted, from its hidden state and the Markov
    embedding of the token before it (the library's confidence_head_with_markov)."""

    def __init__(self, hidden: int, rank: int = RANK):
        super().__init__()
        self.proj = nn.Linear(hidden + rank, 1)

    def forward(self, hidden: torch.Tensor, prev_embedding: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([hidden, prev_embedding.to(hidden.dtype)], -1)).squeeze(-1)
