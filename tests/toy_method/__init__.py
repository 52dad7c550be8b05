"""A drafting method added as one package, the way a new method plugs in (as models/methods/<method>/ do): a family
and its heads module (what it holds), a training module (how it trains) and a proposer (how it drafts), declared in one
Method (TOY) that takes one entry in models.methods.METHODS.

The toy: a bigram table over the draft vocabulary, `heads.lookup` [V, Vd] logits. Head k predicts token t+k+2
from token t+k+1 alone, so drafting is a chain through the table: from a node's token, its children are the
table's top ranks for that token, as deep as the tree asks. Training fits the table by cross-entropy on the
data's bigrams (every depth reads the true token above it).

    with toy_method.listed():            # TOY as one more entry of models.methods.METHODS, while inside
        ...                              # a method of the project's own is one line in that tuple
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

import models.methods
from models.engine.drafters.proposer import Frontier
from models.shared.draft_heads import DraftHeads
from models.shared.families import HeadFamily
from models.shared.method import Method, RecipeKind
from models.shared.training import HeadsModule, head_positions

NAME = "toy_lookup"
CONFIG = {"name": NAME, "family": NAME, "num_heads": 4, "num_layers": 1, "dropout": 0.0, "share_lm_head": True,
          "recipe": {"kind": NAME, "lr": 0.5, "warmup_ratio": 0.0, "head_decay": 1.0, "epochs": 4}}


class ToyLookupHeads(DraftHeads):
    """The method's own module: the table, declared here and built on the first attach."""

    def __init__(self, config, base_model=None, draft_ids=None, *, method):
        super().__init__(config, draft_ids=draft_ids, method=method)
        self.lookup: nn.Embedding | None = None
        if base_model is not None:
            self.attach(base_model, init_from_base=True)

    def build_parts(self, base_model):
        if self.lookup is None:
            self.lookup = nn.Embedding(self.config.vocab_size, self.config.out_size)
            nn.init.zeros_(self.lookup.weight)


class ToyLookup(HeadFamily):
    name = NAME
    heads_class = ToyLookupHeads

    def build_blocks(self, hidden, num_heads, num_layers):
        return nn.ModuleList([nn.Sequential() for _ in range(num_heads)])


class ToyLookupModule(HeadsModule):
    """Cross-entropy of the table's row for the true token t+k+1 against token t+k+2, every depth k."""

    def compute(self, batch):
        heads, total, per_head = self.heads, None, []
        for k in range(heads.config.num_heads):
            b, t, target = head_positions(batch["labels"], k, batch.get("sources"))
            logits = heads.lookup(batch["input_ids"][b, t + k + 1])                       # [N, Vd]
            index = heads.to_draft_index(target)
            inside = index >= 0
            loss_k = F.cross_entropy(logits[inside], index[inside]) if inside.any() else logits.sum() * 0
            total = loss_k if total is None else total + self.recipe.head_weight(k) * loss_k
            per_head.append((loss_k.detach(), logits.detach(), target))
        return total, per_head, {}


class ToyLookupProposer:
    """Stateless: a frontier node's children come from its own token's row of the table."""
    taps = ()

    def __init__(self, heads):
        self.heads, self.draft_ids, self.vocab_size = heads, heads.draft_ids, heads.config.vocab_size
        self.device = heads.lookup.weight.device

    def start(self, ctx) -> None:
        pass

    def advance(self, hidden, tokens, position) -> None:
        pass

    def rewind(self, position) -> None:
        pass

    def begin(self, root: int, depth: int) -> None:
        pass

    @torch.no_grad()
    def scores(self, frontier: Frontier) -> torch.Tensor:
        return self.heads.lookup.weight[frontier.tokens[frontier.nodes]]                   # [R, Vd]

    def end(self) -> None:
        pass


TOY = Method(name=NAME, family=ToyLookup(), proposer=ToyLookupProposer, recipes=(RecipeKind(NAME, ToyLookupModule),))


@contextlib.contextmanager
def listed():
    """TOY as one more entry of models.methods.METHODS while inside (the project's own methods are listed there)."""
    with mock.patch.object(models.methods, "METHODS", (*models.methods.METHODS, TOY)):
        yield
