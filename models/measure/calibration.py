"""Tree calibration: rank accuracies of draft heads, greedy trees, predicted speed on this machine.

    python -m pipelines.calibrate heads=hydra          (the stage; this module is the library)

    seqs = greedy_continuations(model, prompts, max_new_tokens=96, eos_token_id=2)
    ranks = [sequence_ranks(model, heads, ids, start) for ids, start in seqs]   # [N, D] each
    acc = accuracy_table(ranks, top_k=10)                                        # [D, K]
    paths = greedy_tree(acc, budget=64)
    predicted_accept_length(acc, paths)      # 1 + sum over nodes of prod acc along the path

What is measured. Decoding stands at position t (the last accepted token); the root of the tree is
the base model's next token x_{t+1}; the depth-d nodes are candidates for token t+d+1, and greedy
acceptance keeps a depth-d node iff its parent was kept and its token equals the base argmax given
the accepted path. Write g_{s+1} = argmax of the base logits at position s (one forward per
sequence). On a sequence x that follows the base greedy path from t on (x_{t+1..t+d} ==
g_{t+1..t+d}), the token greedy acceptance wants at depth d is exactly g_{t+d+1}. So:

- sequences are the prompts of held-out data continued greedily by the base model itself (the data's
  own answers were sampled, not greedy); `data` mode uses the data's tokens instead and keeps a
  (position, depth) only where the data follows the greedy path (the same check guards the rare
  float ties between batched generation and the full forward).
- heads score their draft vocabulary only (DraftHeads.draft_ids), as when they draft: a base token
  outside it is never in a head's top-k (rank K).
- R[t, d] = rank of g_{t+d+1} in head d-1's top-k at position t, K when absent, -1 when unknown
  (past the end, or the data left the greedy path). Head d-1 reads the hidden state at t (Hydra++:
  after the prefix layer over the base hidden states) and, for Hydra families, the path tokens
  x_{t+1..t+d}: the true path, which is what the tree feeds it whenever its parent is accepted.
- acc[d][r] = P(R[t, d] = r | R[t, j] < K for all j < d): the chance that depth d's rank-r proposal
  is the base's token given that the path above it can be accepted by some tree (its true token is
  within the top-k at every depth above). For Medusa the proposals do not depend on the path, but
  the conditioning still captures that heads are right on the same easy positions.

Predicted accepted length of a tree (tokens per step, the bonus token included):
    L = 1 + sum over nodes (r_1..r_d) of prod_j acc[j][r_j]
exact under two assumptions: (1) the top-k tokens of a head are distinct, so at most one sibling
matches and the accepted nodes form one chain (true by construction); (2) the rank at depth j
depends on the ranks above only through "the path above is acceptable" (an approximation: it
ignores that, e.g., a rank-3 parent predicts a harder position than a rank-0 parent).
`empirical_accept_length` drops assumption (2) by replaying the measured rank vectors through the
tree; `replay_accept_length` also samples positions as decoding does (jumping by the accepted
length), which is what the evaluation measures.

Greedy tree (docs/reference.md#trees-and-verification): start from (0,), repeatedly add the frontier node (next sibling
of a node in the tree, or first child of a node in the tree, within D depths and K ranks) with the
highest product of accuracies along its path. When every acc[d] is non-increasing in r, each
frontier node scores at most its parent and its previous sibling, so nodes enter in non-increasing
score order and the tree maximises L among trees of that size whose nodes' parents and previous
siblings are in the tree. Trees for growing budgets are nested.

Cost: predicted tokens/s = L / (verify(n + 1 tokens) + overhead(tree)); verify from the latency
profile of the decoder's verify forward (models/measure/latency.py: median over repeats, interpolated in n);
overhead = draft + LM head (on the nodes with children) + acceptance + commit of one step with that
tree, timed with the decoder's own functions (models/engine/drafters/, acceptance.py, kv_cache.py). The
autoregressive baseline's step is the profile's 1-token forward + LM head.
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

import numpy as np
import torch

from models.engine.taps import final_and_taps

Path = tuple[int, ...]


# -- 1) measuring ranks ------------------------------------------------------------------------

def model_fingerprint(model) -> str:
    """A cheap checksum of the weights (the first values of every tensor): tells a LoRA-merged model apart."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().flatten()[:64].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def greedy_continuations(model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                         stop_token_ids: Sequence[int] = (), static: bool = False) -> list[list[int]]:
    """Each prompt followed by the base model's greedy answer (up to and including a stop token),
    decoded by the evaluation's own autoregressive baseline (models.engine.decoding.generate, heads=None; static:
    with the static step, as the stage's host setting says)."""
    from models.engine.decoding import generate

    return [list(p) + generate(model, None, list(p), max_new_tokens=max_new_tokens,
                               stop_token_ids=list(stop_token_ids), static=static).new_tokens for p in prompts]


@torch.no_grad()
def sequence_ranks(model, heads, input_ids: Sequence[int], start: int, top_k: int = 10,
                   chunk: int = 256) -> torch.Tensor:
    """R[i, d-1] for positions t = start + i (t = start .. T-2): rank of the base's greedy token at depth d.

    K (= top_k) when the token is not in the head's top-k, -1 when it cannot be known.
    """
    device = next(model.parameters()).device
    ids = torch.as_tensor(list(input_ids), dtype=torch.long, device=device)   # [T]
    T, D = ids.numel(), heads.config.num_heads
    if not 0 <= start <= T - 2:
        raise ValueError(f"start={start} must leave at least one target in a sequence of {T} tokens")
    pos = torch.arange(T, device=device)[None]
    module = heads.draft_module
    taps = module.taps if module is not None else ()
    both = final_and_taps(model.get_decoder(), ids[None], taps, position_ids=pos)             # [1, T, h (+ taps)]
    h = model.config.hidden_size
    hidden, features = both[..., :h], both[..., h:] if taps else both[..., :h]
    greedy = torch.full((T,), -1, dtype=torch.long, device=device)                            # [T]: g_{s+1}, s >= start
    greedy[start:] = model.get_output_embeddings()(hidden[0, start:]).argmax(-1)
    # EAGLE: depth d at t is the draft d steps along the true path ([1, T-1, h] per depth)
    whole = heads.reads_whole_path                       # DSpark's rnn: every slot from the root's (slot 0) on
    drafts = None if module is None else \
        module.unroll(features, ids[None], D, with_anchor=True) if whole else module.unroll(features, ids[None], D)
    hidden = heads.read_hidden(hidden, pos)[0]                                             # [T, h]
    follows = ids[1:] == greedy[:-1]                                                          # [T-1]: x_{s+1} == g_{s+1}
    t = torch.arange(start, T - 1, device=device)                                             # [N]
    ranks = torch.full((t.numel(), D), -1, dtype=torch.long)
    for d in range(1, D + 1):
        sel = torch.nonzero(t + d <= T - 1).flatten()               # target g_{t+d+1} = greedy[t+d] exists
        steps = torch.arange(d, device=device)
        sel = sel[follows[t[sel, None] + steps].all(-1)]            # x_{t+1..t+d} on the greedy path
        for c in range(0, sel.numel(), chunk):
            rows = sel[c:c + chunk]
            tt = t[rows]                                            # [n]
            path = ids[tt[:, None] + 1 + steps]                     # [n, d]: x_{t+1..t+d}
            if drafts is None:
                logits = heads.draft_logits(d - 1, hidden[tt], path)              # [n, Vd]: the draft vocabulary only
            elif whole:                   # slots 0 to the one drafting depth d, the token before each's target:
                f = module.first_slot     # (the root for slot 0 when it drafts nothing), then x_{t+1..t+d}
                outs = torch.stack([module.readout(drafts[j][0, tt]) for j in range(d + f)], 1)
                logits = heads.block_logits(outs, torch.cat([path[:, :1]] * f + [path], 1))[:, -1]
            else:                         # the slot drafting depth d, x_{t+d} before it
                outs = module.readout(drafts[d - 1][0, tt])[:, None]
                logits = heads.block_logits(outs, path[:, -1:])[:, -1]
            top = heads.to_token_ids(logits.topk(min(top_k, logits.shape[-1]), dim=-1).indices)   # [n, K] token ids
            hit = top == greedy[tt + d][:, None]                    # [n, K]
            rank = torch.where(hit.any(-1), hit.int().argmax(-1), torch.full_like(tt, top_k))
            ranks[rows.cpu(), d - 1] = rank.cpu()
    return ranks


# -- 2) accuracy table and accepted-length estimates ------------------------------------------

def accuracy_table(ranks: Sequence[torch.Tensor] | torch.Tensor, top_k: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """(acc [D, K], counts [D]): acc[d][r] = P(R[:, d] = r | R[:, j] < K for j < d, R[:, d] known)."""
    R = torch.cat(list(ranks)) if not isinstance(ranks, torch.Tensor) else ranks     # [N, D]
    R = R.numpy()
    N, D = R.shape
    acc, counts = np.zeros((D, top_k)), np.zeros(D, dtype=np.int64)
    above_ok = np.ones(N, dtype=bool)
    for d in range(D):
        rows = above_ok & (R[:, d] >= 0)
        counts[d] = rows.sum()
        if counts[d]:
            acc[d] = np.bincount(R[rows, d], minlength=top_k + 1)[:top_k] / counts[d]
        above_ok &= (R[:, d] >= 0) & (R[:, d] < top_k)
    return acc, counts


def top1_unconditional(ranks: Sequence[torch.Tensor] | torch.Tensor) -> list[float]:
    """Per head: share of known positions where rank 0 is right, whatever happened above (the papers' head top-1)."""
    R = (torch.cat(list(ranks)) if not isinstance(ranks, torch.Tensor) else ranks).numpy()
    known = R >= 0
    return [float((R[known[:, d], d] == 0).mean()) if known[:, d].any() else 0.0 for d in range(R.shape[1])]


def check_paths(paths: Sequence[Sequence[int]], depth: int, top_k: int) -> list[Path]:
    paths = [tuple(int(r) for r in p) for p in paths]
    present = set(paths)
    for p in paths:
        if not p or len(p) > depth or min(p) < 0 or max(p) >= top_k:
            raise ValueError(f"tree node {list(p)} needs depth 1..{depth} and ranks 0..{top_k - 1}")
        if len(p) > 1 and p[:-1] not in present:
            raise ValueError(f"tree node {list(p)} has no parent {list(p[:-1])} in the tree")
    if len(present) != len(paths):
        raise ValueError("tree has duplicate nodes")
    return paths


def predicted_accept_length(acc: np.ndarray, paths: Sequence[Sequence[int]]) -> float:
    """1 + sum over nodes of the product of acc along the node's path (see the module docstring)."""
    acc = np.asarray(acc)
    paths = check_paths(paths, *acc.shape)
    return 1.0 + float(sum(np.prod([acc[j, r] for j, r in enumerate(p)]) for p in paths))


def accepted_depth(rank_row: Sequence[int], tree: set[Path], top_k: int) -> int | None:
    """Depth of the deepest accepted node for one position's rank vector; None if it cannot be known."""
    depth = 0
    for d, r in enumerate(rank_row):
        if r < 0:
            return None if any(len(p) > d and p[:d] == tuple(rank_row[:d]) for p in tree) else depth
        if r >= top_k or tuple(rank_row[:d + 1]) not in tree:
            return depth
        depth = d + 1
    return depth


def empirical_accept_length(ranks: Sequence[torch.Tensor], paths: Sequence[Sequence[int]], top_k: int = 10) -> float:
    """Mean over all knowable positions of 1 + accepted depth, replaying the measured rank vectors."""
    tree = set(check_paths(paths, ranks[0].shape[1], top_k))
    depths = [accepted_depth(row, tree, top_k) for R in ranks for row in R.tolist()]
    depths = [d for d in depths if d is not None]
    return 1.0 + float(np.mean(depths)) if depths else float("nan")


def replay_steps(R: torch.Tensor, paths: Sequence[Sequence[int]], top_k: int = 10) -> list[int]:
    """Tokens emitted by each step of greedy tree decoding over one sequence's rank matrix R [N, D].

    Step at position t emits 1 + accepted depth and moves to t + that; near the end, where deeper
    ranks are unknown, only what is certain counts.
    """
    tree = set(check_paths(paths, R.shape[1], top_k))
    rows, i, steps = R.tolist(), 0, []
    while i < len(rows):
        steps.append(1 + (accepted_depth(rows[i], tree, top_k) or 0))
        i += steps[-1]
    return steps


def replay_accept_length(ranks: Sequence[torch.Tensor], paths: Sequence[Sequence[int]], top_k: int = 10) -> float:
    """Mean tokens per step when greedy tree decoding runs over each sequence (steps jump by what they emit)."""
    lengths = [n for R in ranks for n in replay_steps(R, paths, top_k)]
    return float(np.mean(lengths)) if lengths else float("nan")


def simulate_accept_length(acc: np.ndarray, paths: Sequence[Sequence[int]], num_draws: int = 100_000,
                           seed: int = 0) -> float:
    """Monte Carlo under the model's assumptions: per depth, independently, rank r is right with prob.

    acc[d][r] and none is right with prob. 1 - sum(acc[d]); a step accepts the longest tree path
    whose every rank is the right one; returns the mean of 1 + accepted depth.
    """
    acc = np.asarray(acc, dtype=float)
    D, K = acc.shape
    if (acc < 0).any() or (acc.sum(1) > 1 + 1e-9).any():
        raise ValueError(f"acc rows must be probabilities summing to at most 1, got row sums {acc.sum(1)}")
    paths = check_paths(paths, D, K)
    rng = np.random.default_rng(seed)
    probs = np.concatenate([acc, np.clip(1 - acc.sum(1, keepdims=True), 0, 1)], axis=1)   # [D, K+1]
    draws = np.stack([rng.choice(K + 1, size=num_draws, p=probs[d] / probs[d].sum()) for d in range(D)], 1)
    # a node's code: its ranks as digits in base K+1 (compared only with nodes of the same depth)
    codes = [{sum(r * (K + 1) ** j for j, r in enumerate(p)) for p in paths if len(p) == d} for d in range(1, D + 1)]
    depth = np.zeros(num_draws, dtype=np.int64)
    prefix = np.zeros(num_draws, dtype=np.int64)
    alive = np.ones(num_draws, dtype=bool)
    for d in range(D):
        prefix = prefix + draws[:, d] * (K + 1) ** d
        alive &= (draws[:, d] < K) & np.isin(prefix, list(codes[d]))
        depth[alive] = d + 1
    return 1.0 + float(depth.mean())


# -- 3) greedy tree construction ---------------------------------------------------------------

def greedy_tree(acc: np.ndarray, budget: int) -> list[Path]:
    """The first `budget` nodes the greedy construction adds (order of addition; see module docstring)."""
    acc = np.asarray(acc, dtype=float)
    D, K = acc.shape
    if budget < 1:
        raise ValueError(f"tree budget must be at least 1 node, got {budget}")
    score: dict[Path, float] = {(): 1.0}
    frontier: dict[Path, float] = {(0,): acc[0, 0]}
    tree: list[Path] = []
    while len(tree) < budget and frontier:
        # highest score; ties: shallower first, then smaller ranks
        node = max(frontier, key=lambda p: (frontier[p], -len(p), tuple(-r for r in p)))
        score[node] = frontier.pop(node)
        tree.append(node)
        d, r = len(node), node[-1]
        if r + 1 < K:
            frontier[node[:-1] + (r + 1,)] = score[node[:-1]] * acc[d - 1, r + 1]
        if d < D:
            frontier[node + (0,)] = score[node] * acc[d, 0]
    return tree


def sort_paths(paths: Sequence[Path]) -> list[list[int]]:
    """Depth-major, then rank order (the order tree files list nodes in)."""
    return [list(p) for p in sorted(paths, key=lambda p: (len(p), p))]


# -- 4) cost model -----------------------------------------------------------------------------

def predicted_tokens_per_s(accept_length: float, verify_s: float, draft_s: float) -> float:
    return accept_length / (verify_s + draft_s)


def choose_budget(rows: Sequence[dict]) -> dict:
    """The row with the highest predicted_tokens_per_s (ties: the smaller tree)."""
    if not rows:
        raise ValueError("no candidate trees to choose from")
    return max(rows, key=lambda row: (row["predicted_tokens_per_s"], -row["budget"]))


@torch.inference_mode()
def step_timings(model, heads, spec, repeats: int, prefix_len: int = 300, seed: int = 0) -> dict:
    """Median seconds of the parts of one greedy decoding step with this tree (models.engine.decoding.time_step: the
    decoder's own step, rewound after each repeat) on a random prefix_len-token prompt: draft (heads), verify
    (decoder forward alone here), lm_head (on the rows acceptance reads), accept (the rule), commit (cache
    pruning + the drafter's state)."""
    from models.engine.acceptance import SamplingConfig
    from models.engine.decoding import prefill, time_step
    from models.engine.drafting import tree_drafter

    ids = torch.randint(model.config.vocab_size, (1, prefix_len), generator=torch.Generator().manual_seed(seed))
    drafter = tree_drafter(heads, spec)                 # a fixed tree, or a GrownTree grown at every step
    state = prefill(model, ids.to(next(model.parameters()).device), SamplingConfig(), drafter=drafter)
    steps = time_step(state, drafter, getattr(spec, "levels", spec.depth), repeats)
    for s in steps:
        s["verify"] -= s["lm_head"]                     # the forward alone (the profile's "seconds")
    return {k: float(np.median([s[k] for s in steps])) for k in ("draft", "verify", "lm_head", "accept", "commit")}


@torch.inference_mode()
def batch_draft_timings(model, heads, spec, batch_sizes, repeats: int, prefix_len: int = 300, seed: int = 0) -> dict:
    """{B: median seconds of one batch's draft of this tree} for each B of batch_sizes: B drafters started from one
    random prompt's features drafting together as a batched step drafts (models/engine/drafters/tree.py
    draft_many: one forward a depth for every sequence where the proposer batches, else one drafter after another)."""
    from models.engine.acceptance import SamplingConfig
    from models.engine.drafters.base import DraftContext
    from models.engine.drafters.tree import draft_many
    from models.engine.drafting import tree_drafter

    device = next(model.parameters()).device
    ids = torch.randint(model.config.vocab_size, (1, prefix_len), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(device)
    taps = tuple(tree_drafter(heads, spec).taps)
    out = final_and_taps(model.get_decoder(), ids, taps)[0]                       # [T, h (1 + taps)]
    features = out if not taps else out[:, model.config.hidden_size:]
    depth, root = getattr(spec, "levels", spec.depth), int(ids[0, -1])
    times = {}
    for B in [int(b) for b in batch_sizes]:
        drafters = [tree_drafter(heads, spec) for _ in range(B)]
        for d in drafters:
            d.start(DraftContext(ids[0], features, SamplingConfig()))
        runs = []
        for r in range(repeats + 1):                                               # round 0 warms up
            t0 = time.perf_counter()
            draft_many(drafters, [root] * B, [depth] * B)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            runs.append(time.perf_counter() - t0)
        times[str(B)] = float(np.median(runs[1:]))
    return times
