"""EAGLE-1 and EAGLE-3: one draft layer run over its own predicted features (docs/reference.md#autoregressive-drafters).

- eagle.py, eagle3.py: the layer modules (EagleModule, Eagle3Module and its Llama layer);
- family.py: their families and heads modules (EagleHeads holds `eagle`, Eagle3Heads `eagle3`);
- training.py: their recipe kinds "eagle" and "eagle3" (models/shared/autoregressive/training.py, AutoregressiveRecipe);
- drafting.py: their proposer registration (the autoregressive proposer) and the "eagle" drafter kind, a bare
  EagleModule over the full vocabulary (conformance); imported by models/methods/drafting.py;
- eagle_format.py, eagle3_format.py, speculators_format.py: the authors', vLLM's/SGLang's and the speculators
  library's files, registered with the format registry (formats.py; models/shared/formats.py).
"""
from models.methods.eagle import family, formats, training  # noqa: F401  (registrations)
