"""A fixed tree's greedy draft replayed as one CUDA graph, for proposers whose draft has fixed shapes.

    graphed = GraphedDraft(proposer, buf, capture=True)     # kept by the TreeDrafter across decodes
    tokens = graphed.draft(root)                             # [N] on the proposer's device, node 0 the root

On a GPU a draft is host time: the draft heads' walk over the 63-node tree launches about 90-150 small kernels
(Medusa-1 to Hydra++) whose kernel time is a fifth of the draft's wall time (docs/engine.md). The walk of
draft_tree over a fixed tree at greedy acceptance is the same sequence of kernels at the same shapes every step:
only the root token and the proposer's state change. A proposer that keeps that state in tensors overwritten in
place (`capturable = True`, and `static_inputs()` names those tensors) can therefore have the whole walk captured
once and replayed: the root goes into a one-element device buffer, the graph writes the tokens into a buffer of
its own, and the draft returns a copy of them. The draft heads' state is h_t (HeadsProposer); the autoregressive
drafters' (EAGLE, EAGLE-3, the draft model) is their draft cache, which grows with every accepted step, so with
DraftContext.static they keep it at a fixed capacity and read the accepted rows' count from the device
(models/shared/autoregressive/static_cache.py), filled by `prepare_static(num_nodes)` before each draft.
Off a CUDA device (or where capture fails) the same walk runs eagerly from the same buffers, and `fallback` says
why; the eager walk is the reference the graph is checked against (tests/test_cuda.py).
"""
from __future__ import annotations

import torch

from models.engine.acceptance import SamplingConfig
from models.engine.drafters.proposer import Proposer, draft_tree, proposer_device
from models.engine.trees import TreeBuffers

GREEDY = SamplingConfig()        # top-k drafts: what a graph replays (sampled drafts draw new random numbers)


def prepare_static(proposer: Proposer, num_nodes: int) -> None:
    """What a proposer with fixed-shape state does before each draft of num_nodes nodes, outside the graph."""
    prepare = getattr(proposer, "prepare_static", None)
    if prepare is not None:
        prepare(num_nodes)


def why_not_capturable(proposer: Proposer, sampling: SamplingConfig, cutting: bool, want_probs: bool) -> str | None:
    """Why a fixed tree's drafts by this proposer cannot be replayed as a graph, or None."""
    if not getattr(proposer, "capturable", False):
        return f"{type(proposer).__name__} is not capturable (its draft's shapes change between steps)"
    if sampling.samples_drafts:
        return "sampled drafts (each draw needs fresh random numbers and its q)"
    if cutting or want_probs:
        return "the draft's probabilities are read on the host (cut by cost, or asked for)"
    return None


class GraphedDraft:
    """One fixed tree's draft by one proposer, captured as a CUDA graph on its first call (module docstring).
    mode: "cuda_graph" once captured, "eager" otherwise; fallback: why it runs eagerly."""

    def __init__(self, proposer: Proposer, buf: TreeBuffers | None, capture: bool):
        self.proposer, self.buf = proposer, buf
        self.mode, self.fallback = "eager", None if capture else "capture not asked for"
        self.graph, self.tokens, self.root, self.inputs = None, None, None, ()
        self.capture = capture

    @property
    def num_nodes(self) -> int:
        """Tree rows a draft runs (what the proposer makes room for before it: prepare_static)."""
        return self.buf.num_tokens

    def _addresses(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.proposer.static_inputs())

    def _walk(self) -> torch.Tensor:
        return draft_tree(self.proposer, self.root, self.buf, GREEDY)[0]

    def _capture(self) -> None:
        device = self.root.device
        if device.type != "cuda":
            raise RuntimeError(f"CUDA graphs capture CUDA work; this proposer drafts on {device.type}")
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):                      # warm up: lazy initialisations happen outside capture
            self._walk()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            tokens = self._walk()
        self.graph, self.tokens, self.mode, self.inputs = graph, tokens, "cuda_graph", self._addresses()

    def draft(self, root: int) -> torch.Tensor:
        """The tree's tokens below `root` ([N], node 0 the root): replayed where captured, else the eager walk."""
        if self.root is None:
            self.root = torch.zeros(1, dtype=torch.long, device=proposer_device(self.proposer))
        self.root.fill_(root)
        prepare_static(self.proposer, self.num_nodes)
        if self.graph is not None and self._addresses() != self.inputs:     # the proposer's state moved: capture anew
            self.graph, self.mode = None, "eager"
        if self.graph is None and self.capture and self.fallback is None:
            try:
                self._capture()
            except Exception as e:  # noqa: BLE001  (a graph is an optimisation; the eager walk is the reference)
                self.fallback = f"{type(e).__name__}: {str(e)[:200]}"
                self.proposer.end()                          # a failed capture may have left a tree begun
        if self.graph is None:
            return self._walk()
        self.graph.replay()
        out = self.tokens                                    # the graph's output buffers: copies handed out
        return out.clone() if isinstance(out, torch.Tensor) else tuple(t.clone() for t in out)

    def summary(self) -> dict:
        return {"mode": self.mode, "tree": self.buf.spec.name, "nodes": self.buf.num_tokens - 1,
                "fallback": self.fallback}
