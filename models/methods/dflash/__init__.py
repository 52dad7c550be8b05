"""DFlash (z-lab's block-diffusion drafter, docs/reference.md): a few draft layers that draft a whole block in one
forward, the base's features from several of its layers injected into every layer's keys and values.

- dflash.py: the module (DFlashModule, its layers and draft cache; build_target_layer_ids, the authors' taps);
- family.py: its family and heads module (`heads.dflash`, the base's LM head shared);
- proposer.py: how it drafts (one forward a step; each position's top-k for a tree, its argmax for a chain);
- training.py: the block recipe (anchors, masked blocks, position-weighted cross-entropy);
- dflash_format.py: the authors' files (DFlashDraftModel.from_pretrained);
- speculators_format.py: the speculators library's `dflash` checkpoint (export.format=speculators).
"""
from models.methods.dflash.dflash_format import DFLASH_FORMAT
from models.methods.dflash.family import DFlash
from models.methods.dflash.proposer import DFlashProposer
from models.methods.dflash.speculators_format import SPECULATORS_DFLASH_FORMAT
from models.methods.dflash.training import DFlashFitModule
from models.shared.method import Method, RecipeKind

DFLASH = Method(name="dflash", family=DFlash(), proposer=DFlashProposer,
                recipes=(RecipeKind("dflash", DFlashFitModule),), formats=(DFLASH_FORMAT, SPECULATORS_DFLASH_FORMAT))
