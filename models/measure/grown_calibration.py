"""Calibrating the tree grown per step (EAGLE-2's dynamic tree, models/engine/drafters/grown.py): which
(depth, top_k, nodes) gives the most tokens per second on this machine.

    replay = replay_grown(model, heads, seqs, starts, top_k=4, max_depth=7, every=2)   # drafts along the data
    drafts = accepted_drafts(replay, levels=6, nodes=12)                               # [positions]
    steps = visited_steps(replay, drafts)     # 1 + drafts at each position greedy decoding visits
    rows = grown_rows(...)                                                             # a row per setting

Accepted lengths come from the drafter's own trees, drafted along held-out sequences that follow the base's
greedy path (calibration.py's sequences). At position t (the last accepted token) the root is x_{t+1}; the
drafter, advanced along the sequence, grows its candidates once with the deepest depth asked and keeps all of
them. Greedy acceptance takes the depth-d node iff its token is g_{t+d+1}, the base's greedy token there (known
while the sequence follows the greedy path). The grown tree of a smaller depth has the same candidates at the
levels it drafts (a level's frontier does not depend on the levels below it), and keeping `nodes` keeps the
first `nodes` of the score ranking restricted to its levels: so one growth per position gives the accepted
drafts of every (depth, nodes) at that top_k. Each top_k is grown separately.

Predicted tokens/s = L / (verify(nodes + 1) + overhead), verify from the latency profile, the overhead (draft, LM
head, acceptance, commit) timed with the decoder's own step on that grown tree (calibration.step_timings), as for
the fixed trees. L is the mean of 1 + accepted drafts over the positions greedy decoding visits (visited_steps: from
a sequence's first position, each step moves past what it accepted), not over every position: a position after a
long accepted run is one decoding skips, and the mean over every position overstates L (EAGLE's grown tree: 1.83
over every position, 1.58 decoded, in an earlier committed run).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from models.engine.acceptance import SamplingConfig
from models.engine.drafters.base import DraftContext
from models.engine.drafters.grown import GrownTreeDrafter, grow
from models.engine.taps import final_and_taps
from models.engine.trees import GrownTree


@dataclass
class GrownReplay:
    """Per drafted position: the level (1 = depth 1) and the score-ranking position (0 = best draft) of each node
    on the base's greedy path, as far as the candidates hold it, and the level of every candidate in ranking
    order (to restrict the ranking to fewer levels)."""
    top_k: int
    path_levels: list[list[int]]
    path_order: list[list[int]]
    ranked_levels: list[np.ndarray]
    positions: list[tuple[int, int]] = field(default_factory=list)   # (sequence, t) of each entry


@torch.no_grad()
def replay_grown(model, heads, seqs, starts, top_k: int, max_depth: int, every: int = 1) -> GrownReplay:
    """Grow the candidates (GrownTree(max_depth, top_k), every node kept) at every `every`-th position t >= start
    of each sequence, the drafter advanced along it. seqs: token lists; starts: the last prompt position of each."""
    drafter = GrownTreeDrafter(heads, GrownTree("calibration", max_depth, top_k, 1))
    levels = drafter.levels(max_depth + 1)
    out = GrownReplay(top_k, [], [], [])
    device = next(model.parameters()).device
    h = model.config.hidden_size
    for si, (seq, start) in enumerate(zip(seqs, starts)):
        ids = torch.as_tensor(list(seq), dtype=torch.long, device=device)
        T = ids.numel()
        pos = torch.arange(T, device=device)[None]
        both = final_and_taps(model.get_decoder(), ids[None], drafter.taps, position_ids=pos)[0]      # [T, h (+ taps)]
        feats = both[:, h:] if drafter.taps else both                                           # [T, w]
        greedy = model.get_output_embeddings()(both[:, :h]).argmax(-1).tolist()                  # g_{s+1} at s
        drafter.start(DraftContext(ids[:start + 1], feats[:start + 1], SamplingConfig()))
        seq, done = ids.tolist(), start + 1                                                       # positions accepted
        for t in range(start, T - 1, every):
            if t + 1 > done:                                                                      # catch up to t
                drafter.advance(feats[done:t + 1], seq[done:t + 1], done)
                done = t + 1
            if seq[t + 1] != greedy[t]:                                       # the root is not the base's token
                continue
            targets = []
            for s in range(t + 1, T):                                          # g_{t+d+1} while x follows g
                targets.append(greedy[s])
                if s + 1 >= T or seq[s + 1] != greedy[s] or len(targets) == levels:
                    break
            out.positions.append((si, t))
            # unpruned: every candidate kept, so that one growth serves every (depth, nodes)
            record(out, grow(drafter.proposer, seq[t + 1], drafter.tree, levels, SamplingConfig(), prune=False),
                   targets)
    return out


def record(out: GrownReplay, grown, targets: list[int]) -> None:
    n = grown.n
    tokens, parent = grown.tokens[:n].cpu(), grown.parent[:n].cpu()          # a growth's tensors are on its device
    level = (grown.ancestors[:n, :n].sum(-1) - 1).cpu().numpy()
    order = torch.sort(grown.score[:n].cpu(), descending=True, stable=True).indices.numpy()    # root first
    where = np.empty(n, dtype=np.int64)
    where[order] = np.arange(n)
    node, path = 0, []
    for token in targets:
        match = torch.nonzero((parent == node) & (tokens == token)).flatten()     # siblings' tokens are distinct
        if match.numel() == 0:
            break
        node = int(match[0])
        path.append(node)
    out.path_levels.append([int(level[c]) for c in path])
    out.path_order.append([int(where[c]) for c in path])
    out.ranked_levels.append(level[order])


def accepted_drafts(replay: GrownReplay, levels: int, nodes: int) -> np.ndarray:
    """[positions]: drafts greedy acceptance takes from the grown tree of `levels` levels keeping `nodes`."""
    out = np.zeros(len(replay.path_levels), dtype=np.int64)
    for i, (lv, pos, ranked) in enumerate(zip(replay.path_levels, replay.path_order, replay.ranked_levels)):
        drafted = np.cumsum((ranked >= 1) & (ranked <= levels))          # drafts of those levels up to each rank
        for d, (node_level, p) in enumerate(zip(lv, pos)):
            if node_level > levels or drafted[p] > nodes:
                break
            out[i] = d + 1
    return out


def visited_steps(replay: GrownReplay, drafts: np.ndarray) -> list[int]:
    """1 + accepted drafts at each position greedy decoding visits: from each sequence's first replayed position, the
    next is t + 1 + drafts there (where that position was not replayed, every > 1, the next one that was)."""
    entry = {pos: i for i, pos in enumerate(replay.positions)}
    by_seq: dict[int, list[int]] = {}
    for s, t in replay.positions:
        by_seq.setdefault(s, []).append(t)
    steps = []
    for s, ts in by_seq.items():
        t, last = ts[0], ts[-1]
        while t <= last:
            if (s, t) not in entry:
                t = min(u for u in ts if u > t)
                continue
            steps.append(1 + int(drafts[entry[(s, t)]]))
            t += steps[-1]
    return steps


def grown_settings(depths, top_ks, nodes, max_levels: int | None) -> list[tuple[int, int, int]]:
    """(depth, top_k, nodes) to try, depths capped where the proposer stops (draft heads: max_levels levels)."""
    cap = (lambda d: d) if max_levels is None else (lambda d: min(d, max_levels - 1))
    return sorted({(cap(int(d)), int(k), int(n)) for d in depths for k in top_ks for n in nodes})


def choose_grown(rows: list[dict]) -> dict:
    """The row with the highest predicted tokens/s (ties: fewer nodes, then shallower, then fewer children)."""
    if not rows:
        raise ValueError("no grown-tree settings to choose from (profile.calibrate.grown)")
    return max(rows, key=lambda r: (r["predicted_tokens_per_s"], -r["nodes"], -r["depth"], -r["top_k"]))
