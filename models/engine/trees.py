"""Draft trees: topology as top-k rank paths, validated, and the buffers the decoder needs per tree.

    spec = tree_from_config({"kind": "chain", "depth": 4})       # or kind=paths | dense | file
    buf = TreeBuffers.build(spec)                                 # cached: built once per tree
    buf.tree_mask[1, 1, n+1, n+1], buf.depth[n+1], buf.retrieve[leaves, D+1]

A node is a path of ranks, one per depth (docs/reference.md#trees-and-verification): (0, 1) is rank 1 among the
depth-2 proposals below rank 0 of the depth-1 proposals. The root (node 0 in the buffers) is the
base model's own next token; nodes 1..n are sorted by depth, then by path, so every ancestor
comes before its descendants and the nodes of one depth are contiguous.
"""
from __future__ import annotations

import functools
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class TreeSpec:
    name: str
    paths: tuple[tuple[int, ...], ...]
    topk: int = 10

    def __post_init__(self):
        paths = tuple(tuple(int(r) for r in p) for p in self.paths)
        object.__setattr__(self, "paths", paths)
        if self.topk < 1:
            raise ValueError(f"tree {self.name!r}: topk must be >= 1, got {self.topk}")
        seen: set[tuple[int, ...]] = set()
        for p in paths:
            if len(p) == 0:
                raise ValueError(f"tree {self.name!r}: empty node path []; the root is implicit, list only drafts")
            if p in seen:
                raise ValueError(f"tree {self.name!r}: node {list(p)} is listed twice")
            bad = [r for r in p if not 0 <= r < self.topk]
            if bad:
                raise ValueError(f"tree {self.name!r}: node {list(p)} has rank {bad[0]}; ranks must be in "
                                 f"[0, {self.topk}) (topk={self.topk})")
            seen.add(p)
        for p in paths:
            if len(p) > 1 and p[:-1] not in seen:
                raise ValueError(f"tree {self.name!r}: node {list(p)} has no parent {list(p[:-1])} in the tree")

    @property
    def depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    @property
    def num_nodes(self) -> int:
        """Draft nodes, without the root (the verify step feeds num_nodes + 1 tokens)."""
        return len(self.paths)

    def check_heads(self, num_heads: int) -> None:
        """A node at depth d needs draft head d-1: the tree may not be deeper than the heads."""
        for p in self.paths:
            if len(p) > num_heads:
                raise ValueError(f"tree {self.name!r}: node {list(p)} has depth {len(p)} but the heads have only "
                                 f"{num_heads} heads; use a tree of depth <= {num_heads} or more heads")

    def truncated(self, max_depth: int) -> "TreeSpec":
        """The same tree without nodes deeper than max_depth (used near the context limit)."""
        if max_depth >= self.depth:
            return self
        return TreeSpec(f"{self.name}@{max_depth}", tuple(p for p in self.paths if len(p) <= max_depth), self.topk)


def chain_tree(depth: int, topk: int = 10, name: str | None = None) -> TreeSpec:
    return TreeSpec(name or f"chain{depth}", tuple((0,) * d for d in range(1, depth + 1)), topk)


def dense_tree(k: int, depth: int, topk: int = 10, name: str | None = None) -> TreeSpec:
    if k > topk:
        raise ValueError(f"dense tree: k={k} children per node exceeds topk={topk}")
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(k), repeat=d)]
    return TreeSpec(name or f"dense{k}x{depth}", tuple(paths), topk)


@dataclass(frozen=True)
class GrownTree:
    """A tree grown anew at every step from the draft's own probabilities (EAGLE-2's dynamic tree;
    models/engine/drafters/grown.py): the root's top_k children, then `depth` expansions, each giving the top_k
    nodes of the deepest level (by cumulative log-probability) their top_k children; of everything drafted the
    best `nodes` are verified. Drafts depth + 1 levels at most (draft heads: no more than their number)."""
    name: str
    depth: int
    top_k: int
    nodes: int

    def __post_init__(self):
        for key, low in (("depth", 0), ("top_k", 1), ("nodes", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"grown tree {self.name!r}: {key}={value!r}; it must be a whole number >= {low}")

    @property
    def num_nodes(self) -> int:
        """Draft nodes verified at most (the root not counted)."""
        return self.nodes

    @property
    def levels(self) -> int:
        return self.depth + 1

    def check_heads(self, num_heads: int) -> None:
        """Nothing to refuse: the drafter drafts no deeper than its proposer can (draft heads: num_heads)."""

    @staticmethod
    def from_config(get, name: str) -> "GrownTree":
        missing = [k for k in ("depth", "top_k", "nodes") if get(k) is None]
        if missing:
            raise ValueError(f"grown tree {name!r} needs {missing} (depth, top_k, nodes: see conf/tree/eagle2.yaml)")
        return GrownTree(name, *(whole(get(k), f"grown tree {name!r}: {k}") for k in ("depth", "top_k", "nodes")))


def whole(value, what: str) -> int:
    """A config value as an int, refused when it is not a whole number (1.5, "3", True)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ValueError(f"{what}={value!r}; it must be a whole number")
    return int(value)


# Every key a tree option may have (conf/tree/*.yaml): its kind's own, and those the evaluation reads beside the
# tree (cut_by_cost, lookup: pipelines/methods.py; stand_in: pipelines/bench/load.py; renamed_to: an old name).
TREE_KEYS = {"name", "kind", "topk", "paths", "depth", "k", "file", "top_k", "nodes", "cut_by_cost", "lookup",
             "stand_in", "renamed_to"}


def tree_from_config(cfg) -> TreeSpec | GrownTree:
    """TreeSpec from a dict-like config: kind = paths | chain | dense | file (see conf/tree/*.yaml); kind = grown, or
    a file with "kind": "grown" (calibrated): a GrownTree."""
    get = cfg.get if hasattr(cfg, "get") else lambda k, d=None: getattr(cfg, k, d)
    kind, topk = get("kind"), int(get("topk", 10) or 10)
    name = get("name") or kind
    unknown = sorted(set(cfg.keys()) - TREE_KEYS) if hasattr(cfg, "keys") else []
    if unknown:                                      # a misspelt key would otherwise be ignored silently
        raise ValueError(f"tree {name!r}: unknown keys {unknown}; a tree option takes {sorted(TREE_KEYS)}")
    if kind == "renamed":           # an old option name kept as a pointer (conf/tree/dynamic.yaml)
        raise ValueError(f"tree={name} was renamed tree={get('renamed_to')} (a fixed tree cut per step by cost; "
                         "'dynamic' names only trees grown per step: dynamic_optimal, eagle2)")
    if kind == "grown":
        return GrownTree.from_config(get, name)
    if kind == "paths":
        return TreeSpec(name, tuple(tuple(p) for p in get("paths")), topk)
    if kind == "chain":
        return chain_tree(int(get("depth")), topk, name)
    if kind == "dense":
        return dense_tree(int(get("k")), int(get("depth")), topk, name)
    if kind == "file":
        path = Path(str(get("file")))
        if not path.is_file():
            raise FileNotFoundError(f"tree file {path} does not exist; it is written by `python -m pipelines.calibrate "
                                    "heads=<name>` (or pick tree=sparse64 | chain4 | dense)")
        data = json.loads(path.read_text())
        if data.get("kind") == "grown":
            return GrownTree.from_config(data.get, str(get("name") or data.get("name", name)))
        if "paths" not in data:
            raise ValueError(f"tree file {path} has no 'paths' list (keys: {sorted(data)})")
        return TreeSpec(data.get("name", name), tuple(tuple(p) for p in data["paths"]), int(data.get("topk", topk)))
    raise ValueError(f"tree kind {kind!r} is not known; use paths | chain | dense | file | grown")


@dataclass
class DepthLevel:
    """The nodes of one depth d >= 1, for drafting with one batched head call."""
    nodes: torch.Tensor          # [m] node indices at this depth
    ranks: torch.Tensor          # [m] rank of each node among its parent's proposals
    parents: torch.Tensor        # [P] unique parent node indices (depth d-1), sorted
    parent_slot: torch.Tensor    # [m] row of each node's parent in `parents`
    parent_paths: torch.Tensor   # [P, d] root-to-parent node indices (the path tokens Hydra head d-1 needs)
    num_ranks: int               # max rank + 1: how many proposals per parent to take


@dataclass
class TreeBuffers:
    spec: TreeSpec
    tree_mask: torch.Tensor      # [1, 1, N, N] bool, N = n+1: node i sees itself and its ancestors
    depth: torch.Tensor          # [N] long, root 0
    parent: torch.Tensor         # [N] long, root -1
    ranks: torch.Tensor          # [N] long, root 0
    retrieve: torch.Tensor       # [leaves, D+1] root-to-leaf node indices, padded with -1
    levels: list[DepthLevel]     # levels[d-1] = the nodes at depth d
    children: list[list[int]]    # children[i] = child node indices of node i, in rank order
    parent_list: list[int]       # the nodes with children (the rows acceptance needs logits for)
    parent_row: torch.Tensor     # [N] long: row of a node in parent_list, -1 for leaves
    _masks: dict = field(default_factory=dict, repr=False)
    _subtrees: dict = field(default_factory=dict, repr=False)
    _on: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.depth.numel()

    @staticmethod
    def build(spec: TreeSpec) -> "TreeBuffers":
        return _build_cached(spec)

    def to_depth(self, max_depth: int) -> "TreeBuffers":
        """These buffers without nodes deeper than max_depth (near the context or token limit)."""
        return self if max_depth >= self.spec.depth else TreeBuffers.build(self.spec.truncated(max_depth))

    def subtree(self, keep: tuple[int, ...]) -> "TreeBuffers":
        """The buffers of the tree made of nodes `keep` (root 0 first, rising, every parent kept); its nodes
        keep their relative order, so tokens[list(keep)] are its tokens. Cached per node set."""
        if keep not in self._subtrees:
            nodes = sorted(self.spec.paths, key=lambda p: (len(p), p))             # node i + 1 of these buffers
            self._subtrees[keep] = TreeBuffers.build(
                TreeSpec(f"{self.spec.name}[{len(keep) - 1}]", tuple(nodes[i - 1] for i in keep[1:]), self.spec.topk))
        return self._subtrees[keep]

    def on(self, name: str, device: torch.device | str) -> torch.Tensor:
        """Buffer `name` on `device`: the buffers are built on the CPU, and the acceptance rules combine them with
        the verify step's tensors, on the GPU there (one copy per device, kept)."""
        key = (name, str(device))
        if key not in self._on:
            self._on[key] = getattr(self, name).to(device)
        return self._on[key]

    def levels_on(self, device: torch.device | str) -> list[DepthLevel]:
        """`levels` with their index tensors on `device` (one copy per device, kept): a draft indexes its device
        tensors with them, without a host-to-device copy per depth (which a CUDA graph could not capture)."""
        key = ("levels", str(device))
        if key not in self._on:
            self._on[key] = [DepthLevel(*(getattr(lv, f).to(device) for f in ("nodes", "ranks", "parents",
                                                                               "parent_slot", "parent_paths")),
                                        num_ranks=lv.num_ranks) for lv in self.levels]
        return self._on[key]

    def additive_mask(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """[1, 1, N, N] float: 0 where visible, dtype min elsewhere (cached per dtype and device)."""
        key = (dtype, str(device))
        if key not in self._masks:
            self._masks[key] = additive(self.tree_mask, dtype).to(device)
        return self._masks[key]


def additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as an additive one: 0 where visible, dtype min elsewhere."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible,
                                                                                       torch.finfo(dtype).min)


@functools.lru_cache(maxsize=64)
def _build_cached(spec: TreeSpec) -> TreeBuffers:
    nodes = [()] + sorted(spec.paths, key=lambda p: (len(p), p))     # root first, then by depth and path
    index = {p: i for i, p in enumerate(nodes)}
    N = len(nodes)
    parent = [-1] + [index[p[:-1]] for p in nodes[1:]]
    rows = [[False] * N for _ in range(N)]                          # built in Python, one tensor: trees grown per
    for i, p in enumerate(nodes):                                   # step build these buffers at every step
        for d in range(len(p) + 1):                                 # ancestors p[:0] (root) .. p[:len(p)] (itself)
            rows[i][index[p[:d]]] = True
    mask = torch.tensor(rows, dtype=torch.bool)
    children = [[] for _ in range(N)]
    for i in sorted(range(1, N), key=lambda i: nodes[i][-1]):
        children[parent[i]].append(i)
    leaves = [i for i in range(N) if not children[i]]
    D = spec.depth
    retrieve = torch.tensor([[index[nodes[leaf][:d]] for d in range(len(nodes[leaf]) + 1)]
                             + [-1] * (D - len(nodes[leaf])) for leaf in leaves], dtype=torch.long).view(len(leaves), D + 1)
    levels = []
    for d in range(1, D + 1):
        at_d = [i for i in range(N) if len(nodes[i]) == d]
        parents = sorted({parent[i] for i in at_d})
        slot = {p: s for s, p in enumerate(parents)}
        paths = [[index[nodes[p][:j]] for j in range(d)] for p in parents]   # root .. parent: d node indices
        levels.append(DepthLevel(
            nodes=torch.tensor(at_d), ranks=torch.tensor([nodes[i][-1] for i in at_d]),
            parents=torch.tensor(parents), parent_slot=torch.tensor([slot[parent[i]] for i in at_d]),
            parent_paths=torch.tensor(paths).view(len(parents), d), num_ranks=max(nodes[i][-1] for i in at_d) + 1))
    return TreeBuffers(
        spec=spec, tree_mask=mask.view(1, 1, N, N), depth=torch.tensor([len(p) for p in nodes]),
        parent=torch.tensor(parent), ranks=torch.tensor([p[-1] if p else 0 for p in nodes]), retrieve=retrieve,
        levels=levels, children=children, parent_list=[i for i in range(N) if children[i]],
        parent_row=torch.tensor(_rows([bool(c) for c in children])))


def _rows(flags: list[bool]) -> list[int]:
    out, k = [], 0
    for f in flags:
        out.append(k if f else -1)
        k += f
    return out
