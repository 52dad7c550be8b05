"""A small draft model (Leviathan et al. 2023; docs/reference.md#autoregressive-drafters): a few decoder layers of the
base's width over the tokens alone, drafted and trained on EAGLE's code paths (the autoregressive machinery of
models/shared/).

- draft_model.py: the module (DraftModel: copies of base layers, its own KV cache) and its causal-LM twin;
- family.py: its family, its heads module (DraftModelHeads holds `draft_model`) and its recipe kind;
- drafting.py: its proposer registration (imported by models/methods/drafting.py).
"""
from models.methods.draft_model import family  # noqa: F401  (registrations)
