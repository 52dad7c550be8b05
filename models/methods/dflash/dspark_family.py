"""DSpark's families and heads module: DFlash's (models/methods/dflash/family.py: the block drafter as `heads.dflash`,
scored by the base's LM head over the draft vocabulary), plus `heads.markov` (the previous token's logit bias) and
`heads.confidence` (each position's acceptance logit), built on the first attach. One family per Markov head kind,
the rank the paper's 256:

    heads = models.methods.build_heads(HeadsConfig.for_base(model, family="dspark", num_heads=7, num_layers=2,
                                       share_lm_head=True, sample_from_anchor=True), model)   # blocks of 7
    heads.block_logits(out [.., K, h], prev [.., K])       # DFlash's logits plus the Markov bias
"""
from __future__ import annotations

import torch

from models.methods.dflash.family import DFlash, DFlashHeads
from models.methods.dflash.dspark_markov import RANK, ConfidenceHead, MarkovHead


class DSparkHeads(DFlashHeads):
    """DFlashHeads with `markov` and `confidence` (None until the first attach builds them)."""

    def __init__(self, config, base_model=None, draft_ids=None, *, method):
        self.markov: MarkovHead | None = None
        self.confidence: ConfidenceHead | None = None
        super().__init__(config, base_model, draft_ids, method=method)

    def build_parts(self, base_model) -> None:
        super().build_parts(base_model)
        if self.markov is None:
            c, device = self.config, base_model.get_input_embeddings().weight.device
            self.markov = MarkovHead(c.vocab_size, c.out_size, c.hidden_size, RANK, self.family.markov_kind).to(device)
            self.confidence = ConfidenceHead(c.hidden_size, RANK).to(device)

    @property
    def reads_whole_path(self) -> bool:
        return self.family.markov_kind == "rnn"

    def block_logits(self, out: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """out [..., K, h] (block positions' outputs), prev [..., K] (the token before each) -> [..., K, Vd]."""
        return self.lm_head(0, out) + self.markov(prev, out).to(out.dtype)

    def accept_logits(self, out: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The confidence head's logits [..., K] that each position's draft is accepted."""
        return self.confidence(out, self.markov.embed(prev))


class DSpark(DFlash):
    """DFlash's block, its logits biased by a vanilla Markov head (the library's default)."""
    name = "dspark"
    heads_class = DSparkHeads
    markov_kind = "vanilla"


class DSparkGated(DSpark):
    name = "dspark_gated"
    markov_kind = "gated"


class DSparkRnn(DSpark):
    name = "dspark_rnn"
    markov_kind = "rnn"
