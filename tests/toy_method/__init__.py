"""A drafting method added as one package, the way a new method plugs in (as models/methods/<method>/ do): a family
and its heads module (what it holds), a recipe (how it trains) and a proposer (how it drafts), each registered where
the project looks them up.

The toy: a bigram table over the draft vocabulary, `heads.lookup` [V, Vd] logits. Head k predicts token t+k+2
from token t+k+1 alone, so drafting is a chain through the table: from a node's token, its children are the
table's top ranks for that token, as deep as the tree asks. Training fits the table by cross-entropy on the
data's bigrams (every depth reads the true token above it).

    with toy_method.registered():        # family "toy_lookup", recipe "toy_lookup" and its proposer, while inside
        ...                              # a method's own package would register them when imported
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from models.engine.drafters.proposer import PROPOSERS, Frontier, register_proposer
from models.shared.draft_heads import DraftHeads
from models.shared.families import FAMILIES, HeadFamily, family_of, register_family
from models.shared.recipes import RECIPE_TYPES
from models.shared.training import RECIPES, HeadsModule, head_positions, register_recipe

NAME = "toy_lookup"
CONFIG = {"name": NAME, "family": NAME, "num_heads": 4, "num_layers": 1, "dropout": 0.0, "share_lm_head": True,
          "recipe": {"kind": NAME, "lr": 0.5, "warmup_ratio": 0.0, "head_decay": 1.0, "epochs": 4}}


class ToyLookupHeads(DraftHeads):
    """The method's own module: the table, declared here and built on the first attach."""

    def __init__(self, config, base_model=None, draft_ids=None):
        super().__init__(config, draft_ids=draft_ids)
        self.lookup: nn.Embedding | None = None
        if base_model is not None:
            self.attach(base_model, init_from_base=True)

    def build_parts(self, base_model):
        if self.lookup is None:
            self.lookup = nn.Embedding(self.config.vocab_size, self.config.out_size)
            nn.init.zeros_(self.lookup.weight)


class ToyLookup(HeadFamily):
    name = NAME
    recipes = (NAME,)
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


def toy_proposer(heads):
    return ToyLookupProposer(heads) if isinstance(family_of(heads), ToyLookup) else None


@contextlib.contextmanager
def registered():
    """The toy's family, recipe and proposer registered where the project looks them up, removed on exit."""
    register_family(ToyLookup)
    register_recipe(NAME)(ToyLookupModule)
    register_proposer(toy_proposer)
    try:
        yield
    finally:
        FAMILIES.pop(NAME, None), RECIPES.pop(NAME, None), RECIPE_TYPES.pop(NAME, None)
        PROPOSERS.remove(toy_proposer)
