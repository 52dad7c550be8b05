"""Hydra and Hydra++ (docs/reference.md#heads): sequentially dependent heads, head k reading the embeddings of the path
above its node; Hydra++ reads the base's hidden states through its own prefix decoder layer.

- family.py: the families (HydraInputBlock);
- prefix.py: HydraPPHeads, the heads module that owns Hydra++'s prefix layer and final norm (read_hidden);
- training.py: recipe kinds "hydra" and "hydra_pp";
- formats.py: the authors' Hydra files (arch mlp or prefix-mlp; models/shared/formats.py registry);
- drafting.py: their proposer registration (imported by models/methods/drafting.py).
"""
from models.methods.hydra import family, formats, prefix, training  # noqa: F401  (registrations)
