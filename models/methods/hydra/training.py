"""Hydra's and Hydra++'s training (docs/reference.md#training-recipes): the modules of recipe kinds "hydra" (Medusa-1's loss, head k
also reading the true tokens above its target) and "hydra_pp" (the heads read through the prefix layer; the recipe adds
the teacher loss)."""
from __future__ import annotations

from models.shared.training import HeadsModule


class HydraModule(HeadsModule):
    """Hydra: head k sees h_t and the embeddings of the true tokens x_{t+1..t+k+1} (its family reads the path)."""


class HydraPPModule(HydraModule):
    """Hydra++: the prefix decoder layer runs causally over the base hidden states; its output feeds the heads
    (the family has the layer); the recipe adds the teacher loss."""
