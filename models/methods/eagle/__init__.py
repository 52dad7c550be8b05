"""EAGLE-1 and EAGLE-3: one draft layer run over its own predicted features (docs/reference.md#autoregressive-drafters),
on the machinery the autoregressive methods share (models/shared/autoregressive/: its heads module, proposer and
training).

- eagle.py, eagle3.py: the layer modules (EagleModule, Eagle3Module and its Llama layer; eagle3_taps, the base states
  EAGLE-3 reads);
- family.py: their families (the attribute each layer is held under, how it is built, EAGLE-3's taps);
- drafter.py: EagleDrafter, a bare EagleModule on a tree over the full vocabulary (conformance with the authors' code);
- eagle_format.py, eagle3_format.py, speculators_format.py (formats.py): the authors', vLLM's/SGLang's and the
  speculators library's files.
"""
from models.methods.eagle.family import Eagle, Eagle3
from models.methods.eagle.formats import EAGLE3_FORMAT, EAGLE_FORMAT, SPECULATORS_FORMAT
from models.shared.autoregressive.proposer import AutoregressiveProposer
from models.shared.autoregressive.training import AutoregressiveFitModule
from models.shared.method import Method, RecipeKind

EAGLE = Method(name="eagle", family=Eagle(), proposer=AutoregressiveProposer,
               recipes=(RecipeKind("eagle", AutoregressiveFitModule),), formats=(EAGLE_FORMAT,))
EAGLE3 = Method(name="eagle3", family=Eagle3(), proposer=AutoregressiveProposer,
                recipes=(RecipeKind("eagle3", AutoregressiveFitModule),), formats=(EAGLE3_FORMAT, SPECULATORS_FORMAT))
