"""Acceptance rules for one verified tree: greedy, typical (Medusa), lossless speculative sampling.

    path, bonus = ACCEPTANCE[sampling.acceptance](tokens, buffers, node_logits, sampling, generator, draft_q)

`path` is the list of accepted node indices (root first, so len(path) = accepted drafts + 1);
`bonus` is the extra token drawn from the base model at the last accepted node. The rules
(docs/reference.md#acceptance):
- greedy: a draft is accepted while it equals the argmax of the base logits at its parent;
  the longest accepted path wins. Output = the autoregressive greedy output, token for token.
- typical: accept x if p(x) > min(epsilon, delta * exp(-H(p))), p = softmax(logits / T);
  longest path, ties by summed log-probability. Not lossless by design.
- sampling: multi-draft speculative sampling, lossless. At a node, children are tried in
  rank order: accept child x with min(1, p(x) / q(x)); on rejection p <- norm(max(0, p - q))
  and q <- q without x, renormalised (the children were drawn from q without replacement);
  when all children are rejected, or at a leaf, the bonus is drawn from what is left of p.
  With `draft_q = None` the children are deterministic top-k proposals, i.e. q is a point
  mass at each child (the residual then drops x from p). draft_q(node) may also return (q, drawn):
  only the first `drawn` children were drawn from q, the later ones are deterministic (a prompt-lookup
  branch below sampled heads' children). They are tried last, each as a point mass: such a test
  leaves any residual exactly as it was, so it may follow the sampled children.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

ACCEPTANCE_RULES = ("greedy", "typical", "sampling")


@dataclass
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0                 # 0 = no top-k filter
    acceptance: str = "greedy"     # greedy | typical | sampling; "greedy" or temperature 0 decode greedily
    epsilon: float = 0.09          # typical acceptance: hard threshold
    delta: float = 0.3             # typical acceptance: entropy-scaled threshold
    seed: int | None = None
    draft: str = "sample"          # sampling acceptance: "sample" the tree's children from the heads'
                                   # distributions (without replacement) or take their "topk" ranks

    def __post_init__(self):
        if self.acceptance not in ACCEPTANCE_RULES:
            raise ValueError(f"acceptance {self.acceptance!r} is not known; use one of {list(ACCEPTANCE_RULES)}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got {self.temperature}, "
                             f"{self.top_p}, {self.top_k}")
        if self.draft not in ("sample", "topk"):
            raise ValueError(f"draft {self.draft!r} is not known; use 'sample' or 'topk'")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.acceptance == "greedy"

    @property
    def samples_drafts(self) -> bool:
        """True when the tree's children are drawn from the heads' (warped) distributions."""
        return not self.greedy and self.acceptance == "sampling" and self.draft == "sample"


def warp_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] (float32) after temperature, top-k and top-p.

    The same function warps the target (base) and the draft (heads) distributions.
    """
    x = logits.float() / max(sampling.temperature, 1e-5)
    V = x.shape[-1]
    if 0 < sampling.top_k < V:
        kth = torch.topk(x, sampling.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if sampling.top_p < 1.0:
        x = _top_p_filter(x, sampling.top_p)
    return x.softmax(-1)


def _top_p_filter(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the tokens whose higher-ranked tokens hold less than top_p of the mass (the first always).

    Exact, without sorting the vocabulary: the top k by value (k = 64, 256, ...) until the nucleus
    ends inside them, which for a language model's distribution is almost always the first try.
    """
    V = x.shape[-1]
    log_z = torch.logsumexp(x, dim=-1, keepdim=True)
    k = min(64, V)
    while True:
        vals, idx = torch.topk(x, k, dim=-1)                            # descending
        p_top = torch.exp(vals - log_z)
        before = p_top.cumsum(-1) - p_top                               # mass of the tokens ranked above
        if k == V or bool((before[..., -1] >= top_p).all()):
            break
        k = min(4 * k, V)
    kept = torch.full_like(x, float("-inf"))
    return kept.scatter(-1, idx, vals.masked_fill(before >= top_p, float("-inf")))


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def _uniform(generator: torch.Generator | None) -> float:
    device = generator.device if generator is not None else "cpu"
    return float(torch.rand((), generator=generator, dtype=torch.float64, device=device))


class NodeLogits:
    """Base logits of tree nodes, computed on demand from the verify step's hidden states by base_logits
    (hidden [R, h] -> logits [R, V]: projection.base_logits(model), the LM head and the model's transform).

    Only the rows an acceptance rule asks for go through the LM head (a [rows, h] x [h, V]
    product): the nodes with children in one call, then the last accepted node if it is a leaf.
    A tree of at most EAGER_ROWS tokens gets every row in the first call instead: on a CPU the
    product is bound by reading the weights, so a few more rows cost little, while a second call
    for an accepted leaf (every fully accepted chain) reads all the weights again.
    """

    EAGER_ROWS = 16

    def __init__(self, hidden: torch.Tensor, base_logits):   # hidden: [N, h]
        self.hidden, self.base_logits = hidden, base_logits
        self.cache: dict[int, torch.Tensor] = {}
        self.seconds = 0.0                                 # time spent in the LM head (part of verification)

    def rows(self, nodes: list[int]) -> torch.Tensor:     # -> [len(nodes), V]
        if not nodes:
            return self.base_logits(self.hidden[:0])
        missing = [n for n in nodes if n not in self.cache]
        if missing and not self.cache and len(self.hidden) <= self.EAGER_ROWS:
            missing = list(range(len(self.hidden)))
        if missing:
            start = time.perf_counter()
            out = self.base_logits(self.hidden[missing])
            for n, row in zip(missing, out):
                self.cache[n] = row
            self.seconds += time.perf_counter() - start
        return torch.stack([self.cache[n] for n in nodes])


def accept_greedy(tokens, buf, logits: NodeLogits, sampling=None, generator=None, draft_q=None):
    parents = buf.parent_list
    pred = torch.full((buf.num_tokens,), -1, dtype=torch.long, device=tokens.device)
    pred[parents] = logits.rows(parents).argmax(-1)                   # base argmax at every node with children
    ri = buf.on("retrieve", tokens.device)                             # [L, D+1]
    ok = (tokens[ri[:, 1:].clamp(min=0)] == pred[ri[:, :-1].clamp(min=0)]) & (ri[:, 1:] >= 0)
    accepted = ok.long().cumprod(1).sum(1)                             # [L] accepted drafts per path
    best = int(accepted.argmax())
    path = ri[best, : int(accepted[best]) + 1].tolist()
    last = path[-1]
    bonus = int(pred[last]) if pred[last] >= 0 else int(logits.rows([last])[0].argmax())
    return path, bonus


def accept_on_device(tree, logits: torch.Tensor) -> tuple[list[int], list[int], int]:
    """accept_greedy for a tree that never left the device (a DeviceTree: tokens, ancestors, depth, parent [K]),
    over all K nodes' base logits [K, V], which its buffers-free walk cannot build: a node is accepted when its token
    is the base's argmax at its parent and all its ancestors are accepted; the deepest accepted node ends the path
    (siblings hold distinct tokens, so at most one node of a depth is: the host rule's path), its argmax the bonus.
    The path, its tokens and the bonus are gathered there and read in one transfer, the step's only wait for the
    device -> (the path's node indices, root first and rising; its drafted tokens; the bonus token)."""
    K = tree.tokens.numel()
    pred = logits.argmax(-1)                                                       # [K] the base's next token
    ok = tree.tokens == pred[tree.parent]
    ok[0] = True
    accepted = (ok[None, :] | ~tree.ancestors).all(1)                             # every ancestor and itself ok
    best = torch.where(accepted, tree.depth, -1).argmax()                          # the deepest (first on ties)
    index = torch.arange(K, device=tree.tokens.device)
    path = torch.sort(torch.where(tree.ancestors[best], index, K)).values          # its nodes first, rising
    m = tree.depth[best] + 1
    read = torch.cat([m[None], path, tree.tokens[path.clamp(max=K - 1)], pred[best][None]]).tolist()
    count = read[0]
    return read[1:1 + count], read[2 + K:1 + K + count], read[-1]


def typical_threshold(probs: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """min(epsilon, delta * exp(-H(p))) per row of probs [..., V] -> [...]."""
    entropy = -(probs * torch.log(probs + 1e-5)).sum(-1)
    return torch.clamp(sampling.delta * torch.exp(-entropy), max=sampling.epsilon)


def typical_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Medusa's typical sampling of a base token: softmax(logits / T) without the tokens below the threshold."""
    probs = (logits.float() / sampling.temperature).softmax(-1)
    kept = probs.masked_fill(probs < typical_threshold(probs, sampling).unsqueeze(-1), 0.0)
    return kept / kept.sum(-1, keepdim=True)


def accept_typical(tokens, buf, logits: NodeLogits, sampling: SamplingConfig, generator=None, draft_q=None):
    """Typical acceptance; the bonus token is a typical sample too (as the root tokens in Medusa)."""
    parents = buf.parent_list
    probs = (logits.rows(parents).float() / sampling.temperature).softmax(-1)         # [P, V]
    threshold = typical_threshold(probs, sampling)                                      # [P]
    slot = buf.on("parent_row", tokens.device)[buf.on("parent", tokens.device)[1:]]   # [N-1] row of each node's parent
    p_node = probs[slot, tokens[1:]]                                   # [N-1] p(token | parent)
    ok = torch.cat([torch.ones(1, dtype=torch.bool, device=probs.device), p_node > threshold[slot]])
    logp = torch.cat([torch.zeros(1, device=probs.device), torch.log(p_node)])
    ri = buf.on("retrieve", tokens.device)
    valid = ri[:, 1:] >= 0
    ok_path = (ok[ri[:, 1:].clamp(min=0)] & valid).long().cumprod(1)   # [L, D]
    accepted = ok_path.sum(1)
    score = (logp[ri[:, 1:].clamp(min=0)] * ok_path).sum(1)            # summed log-prob of the accepted part
    longest = accepted == accepted.max()
    best = int(torch.where(longest, score, torch.full_like(score, float("-inf"))).argmax())
    path = ri[best, : int(accepted[best]) + 1].tolist()
    bonus = sample(typical_probs(logits.rows([path[-1]])[0], sampling), generator)
    return path, bonus


def accept_sampling(tokens, buf, logits: NodeLogits, sampling: SamplingConfig, generator=None, draft_q=None):
    """Lossless multi-draft speculative sampling; draft_q(node) -> q [V] of the node's children, or None."""
    logits.rows(buf.parent_list)                                       # one LM-head product for every parent
    node, path = 0, [0]
    while True:
        if not buf.children[node]:                                     # leaf: the bonus comes from the full p
            return path, sample(warp_probs(logits.rows([node])[0], sampling), generator)
        p = warp_probs(logits.rows([node])[0], sampling).double()      # [V], warped only where the walk goes
        q, drawn = _children_q(draft_q, node, len(buf.children[node]))
        nxt = None
        for i, child in enumerate(buf.children[node]):
            x = int(tokens[child])
            point = q is None or i >= drawn
            if point:
                accept_prob = float(p[x])                              # q = point mass at x
            elif q[x] <= 0:                                            # q's support is used up: no more draws
                continue
            else:
                accept_prob = min(1.0, float(p[x] / q[x]))
            if _uniform(generator) < accept_prob:
                nxt = child
                break
            if point:
                p[x] = 0.0
            else:
                p = torch.clamp_(p - q, min=0.0)
                q[x] = 0.0
                q /= q.sum().clamp(min=1e-30)
            p /= p.sum().clamp(min=1e-30)
        if nxt is None:
            return path, sample(p.float(), generator)
        path.append(nxt)
        node = nxt


def _children_q(draft_q, node: int, num_children: int) -> tuple[torch.Tensor | None, int]:
    """(q of the node's drawn children as a float64 copy, or None; how many of its first children q drew)."""
    got = None if draft_q is None else draft_q(node)
    q, drawn = got if isinstance(got, tuple) else (got, num_children)
    return (None, 0) if q is None else (q.double().clone(), drawn)


ACCEPTANCE = {"greedy": accept_greedy, "typical": accept_typical, "sampling": accept_sampling}


def rule_for(sampling: SamplingConfig):
    """The acceptance rule a step runs: greedy at temperature 0, else the configured one (looked up per call, so a
    test may swap an entry of ACCEPTANCE)."""
    return ACCEPTANCE["greedy" if sampling.greedy else sampling.acceptance]
