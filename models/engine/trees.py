"""Draft trees: topology as top-k rank paths, validated, and the buffers the decoder needs per tree.

    option = tree_option(cfg.tree, "sparse64")                   # a conf/tree option, every key parsed
    option.tree, option.step_cost, option.lookup                  # its tree, per-step cut and lookup branch
    spec = tree_from_config({"kind": "chain", "depth": 4})       # the tree alone; or kind=paths | dense | file | grown
    buf = TreeBuffers.build(spec)                                 # cached: built once per tree
    buf.tree_mask[1, 1, n+1, n+1], buf.depth[n+1], buf.retrieve[leaves, D+1]

A node is a path of ranks, one per depth (docs/reference.md#trees-and-verification): (0, 1) is rank 1 among the
depth-2 proposals below rank 0 of the depth-1 proposals. The root (node 0 in the buffers) is the
base model's own next token; nodes 1..n are sorted by depth, then by path, so every ancestor
comes before its descendants and the nodes of one depth are contiguous.
"""
from __future__ import annotations

import dataclasses
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
    top_k: int = 10

    def __post_init__(self):
        paths = tuple(tuple(int(r) for r in p) for p in self.paths)
        object.__setattr__(self, "paths", paths)
        if self.top_k < 1:
            raise ValueError(f"tree {self.name!r}: top_k must be >= 1, got {self.top_k}")
        seen: set[tuple[int, ...]] = set()
        for p in paths:
            if len(p) == 0:
                raise ValueError(f"tree {self.name!r}: empty node path []; the root is implicit, list only drafts")
            if p in seen:
                raise ValueError(f"tree {self.name!r}: node {list(p)} is listed twice")
            bad = [r for r in p if not 0 <= r < self.top_k]
            if bad:
                raise ValueError(f"tree {self.name!r}: node {list(p)} has rank {bad[0]}; ranks must be in "
                                 f"[0, {self.top_k}) (top_k={self.top_k})")
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
        return TreeSpec(f"{self.name}@{max_depth}", tuple(p for p in self.paths if len(p) <= max_depth), self.top_k)


def chain_tree(depth: int, top_k: int = 10, name: str | None = None) -> TreeSpec:
    return TreeSpec(name or f"chain{depth}", tuple((0,) * d for d in range(1, depth + 1)), top_k)


def dense_tree(k: int, depth: int, top_k: int = 10, name: str | None = None) -> TreeSpec:
    if k > top_k:
        raise ValueError(f"dense tree: k={k} children per node exceeds top_k={top_k}")
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(k), repeat=d)]
    return TreeSpec(name or f"dense{k}x{depth}", tuple(paths), top_k)


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


# The old spelling of a key -> its name now (the rank count is top_k in every tree, option and calibrated file).
RENAMED_KEYS = {"topk": "top_k"}


def check_spelling(mapping, where: str) -> None:
    """Refuses a key spelt the old way, naming its new spelling (a file written before the rename says so, rather
    than being read with the default)."""
    old = [k for k in RENAMED_KEYS if k in mapping]
    if old:
        raise ValueError(f"{where}: key {old[0]!r} is now spelt {RENAMED_KEYS[old[0]]!r}; rename it (a calibrated "
                         "file written before the rename: rerun `dvc repro calibrate`)")


# The keys of each kind, and those every option may have beside its tree: the per-step cut (cut_by_cost), prompt
# lookup's merge (lookup) and the load bench's stand-in for a calibrated file not written yet (stand_in).
KIND_KEYS = {"paths": {"paths"}, "chain": {"depth"}, "dense": {"k", "depth"}, "file": {"file"},
             "grown": {"depth", "nodes"}, "renamed": {"renamed_to"}}
COMMON_KEYS = {"name", "kind", "top_k", "cut_by_cost", "lookup", "stand_in"}
TREE_KEYS = COMMON_KEYS.union(*KIND_KEYS.values())


@dataclass(frozen=True)
class TreeOption:
    """A tree option (conf/tree/*.yaml) with every key parsed, the one form it has from the config to the drafter:
    the tree (`tree`, built on first use: a file kind reads its calibrated file then), the latency profile it is cut
    per step with (cut_by_cost) and the relative step costs read from it (step_cost, set by the stage that reads
    it: with_step_cost), whether prompt lookup's chain joins it (lookup) and the bench's stand-in (stand_in)."""
    name: str | None
    kind: str
    top_k: int | None = None
    paths: tuple[tuple[int, ...], ...] | None = None
    depth: int | None = None
    k: int | None = None
    nodes: int | None = None
    file: str | None = None
    cut_by_cost: str | None = None
    lookup: bool = False
    stand_in: str | None = None
    step_cost: tuple[float, ...] | None = None

    @functools.cached_property
    def tree(self) -> TreeSpec | GrownTree:
        tree = self._build()
        # a tree cut per step or joined by a lookup branch is the option's, not its calibrated file's
        return dataclasses.replace(tree, name=self.label) if self.cut_by_cost or self.lookup else tree

    @property
    def label(self) -> str:
        return self.name or self.kind

    def with_step_cost(self, step_cost) -> "TreeOption":
        return dataclasses.replace(self, step_cost=None if step_cost is None else tuple(float(c) for c in step_cost))

    def _build(self) -> TreeSpec | GrownTree:
        top_k = 10 if self.top_k is None else self.top_k
        if self.kind == "grown":
            return GrownTree.from_config({"depth": self.depth, "top_k": self.top_k, "nodes": self.nodes}.get,
                                         self.label)
        if self.kind == "paths":
            return TreeSpec(self.label, self.paths, top_k)
        if self.kind == "chain":
            return chain_tree(self.depth, top_k, self.label)
        if self.kind == "dense":
            return dense_tree(self.k, self.depth, top_k, self.label)
        path = Path(self.file)
        if not path.is_file():
            raise FileNotFoundError(f"tree file {path} does not exist; it is written by `python -m pipelines.calibrate "
                                    "heads=<name>` (or pick tree=sparse64 | chain4 | dense)")
        data = json.loads(path.read_text())
        check_spelling(data, f"tree file {path}")
        if data.get("kind") == "grown":
            return GrownTree.from_config(data.get, str(self.name or data.get("name", self.label)))
        if "paths" not in data:
            raise ValueError(f"tree file {path} has no 'paths' list (keys: {sorted(data)})")
        return TreeSpec(data.get("name", self.label), tuple(tuple(p) for p in data["paths"]),
                        whole(data.get("top_k", top_k), f"tree file {path}: top_k"))


def tree_option(cfg, name: str | None = None) -> TreeOption:
    """A tree option (a mapping: conf/tree/<name>.yaml resolved, or a dict) parsed: an unknown key, one of another
    kind, a key spelt the old way or a missing one is refused, naming it and what is accepted; name: the option's
    name where the mapping has none."""
    keys = list(cfg.keys()) if hasattr(cfg, "keys") else []
    get = cfg.get if hasattr(cfg, "get") else lambda k, d=None: getattr(cfg, k, d)
    kind, name = get("kind"), get("name") or name
    where = f"tree {str(name or kind)!r}"
    check_spelling(keys, where)
    unknown = sorted(set(keys) - TREE_KEYS)
    if unknown:                                      # a misspelt key would otherwise be ignored silently
        raise ValueError(f"{where}: unknown keys {unknown}; a tree option takes {sorted(TREE_KEYS)}")
    if kind not in KIND_KEYS:
        raise ValueError(f"tree kind {kind!r} is not known; use paths | chain | dense | file | grown")
    foreign = sorted(set(keys) - COMMON_KEYS - KIND_KEYS[kind])
    if foreign:
        raise ValueError(f"{where}: kind {kind} does not take {foreign}; it takes {sorted(KIND_KEYS[kind])} and "
                         f"{sorted(COMMON_KEYS)}")
    if kind == "renamed":           # an old option name kept as a pointer (conf/tree/dynamic.yaml)
        raise ValueError(f"tree={name} was renamed tree={get('renamed_to')} (a fixed tree cut per step by cost; "
                         "'dynamic' names only trees grown per step: dynamic_optimal, eagle2)")
    missing = sorted(k for k in KIND_KEYS[kind] if get(k) is None)
    if missing and kind != "grown":                  # a grown tree's: GrownTree.from_config names them
        raise ValueError(f"{where}: kind {kind} needs {missing}")
    # a grown tree's numbers go to GrownTree as written, whose error names the value as given
    number = {k: get(k) if kind == "grown" or get(k) is None else whole(get(k), f"{where}: {k}")
              for k in ("top_k", "depth", "k", "nodes")}
    lookup = get("lookup", False)
    if not isinstance(lookup, bool):
        raise ValueError(f"{where}: lookup={lookup!r}; it must be true or false")
    text = {k: None if get(k) in (None, "") else str(get(k)) for k in ("file", "cut_by_cost", "stand_in")}
    paths = get("paths")
    return TreeOption(None if name is None else str(name), kind, paths=None if paths is None else
                      tuple(tuple(int(r) for r in p) for p in paths), lookup=lookup, **number, **text)


def tree_from_config(cfg) -> TreeSpec | GrownTree:
    """The tree of a tree option (tree_option(cfg).tree): kind = paths | chain | dense | file (see conf/tree/*.yaml)
    a TreeSpec; kind = grown, or a file with "kind": "grown" (calibrated), a GrownTree."""
    return tree_option(cfg).tree


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
                TreeSpec(f"{self.spec.name}[{len(keep) - 1}]", tuple(nodes[i - 1] for i in keep[1:]), self.spec.top_k))
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
