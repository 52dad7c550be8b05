"""DFlash (z-lab's block-diffusion drafter, docs/reference.md): a few draft layers that draft a whole block in one
forward, the base's features from several of its layers injected into every layer's keys and values; and DSpark
(DeepSeek with PKU, arXiv 2607.05147; code in deepseek-ai/DeepSpec; the speculators library's `dspark`), DFlash's block
with a Markov head, which biases each position's logits by the token before it, and a confidence head, which predicts
whether each position is accepted: one method per Markov head kind (dspark: vanilla, the default; dspark_gated;
dspark_rnn), one recipe kind.

- dflash.py: the module (DFlashModule, its layers and draft cache; build_target_layer_ids, the authors' taps);
- family.py: its family and heads module (`heads.dflash`, the base's LM head shared);
- proposer.py: how it drafts (one forward a step; each position's top-k for a tree, its argmax for a chain);
- training.py: the block recipe (anchors, masked blocks, position-weighted cross-entropy);
- dflash_format.py: the authors' files (DFlashDraftModel.from_pretrained);
- speculators_format.py: the speculators library's `dflash` and `dspark` checkpoints (export.format=speculators);
- dspark_markov.py: DSpark's MarkovHead (vanilla, gated, rnn) and ConfidenceHead;
- dspark_family.py: its families and heads module (`heads.markov`, `heads.confidence` beside `heads.dflash`);
- dspark_proposer.py: DFlash's block forward, each node's children scored with its own token's bias;
- dspark_training.py: DFlash's block loss on the biased logits, plus the confidence head's term.

Either convention of the speculators library's sample_from_anchor (heads.sample_from_anchor): false, DFlash's (slot k
scores the token k after the anchor; slot 0, the anchor's, drafts nothing); true, the library's DSpark default and
conf/heads/dspark*.yaml's (slot k scores the token k + 1 after it: every slot drafts).
"""
from models.methods.dflash.dflash_format import DFLASH_FORMAT
from models.methods.dflash.dspark_family import DSpark, DSparkGated, DSparkRnn
from models.methods.dflash.dspark_proposer import DSparkProposer
from models.methods.dflash.dspark_training import DSparkFitModule
from models.methods.dflash.family import DFlash
from models.methods.dflash.proposer import DFlashProposer
from models.methods.dflash.speculators_format import SPECULATORS_DFLASH_FORMAT, SPECULATORS_DSPARK_FORMAT
from models.methods.dflash.training import DFlashFitModule
from models.shared.method import Method, RecipeKind

DFLASH = Method(name="dflash", family=DFlash(), proposer=DFlashProposer,
                recipes=(RecipeKind("dflash", DFlashFitModule),), formats=(DFLASH_FORMAT, SPECULATORS_DFLASH_FORMAT))
_DSPARK = dict(proposer=DSparkProposer, recipes=(RecipeKind("dspark", DSparkFitModule),),
               formats=(SPECULATORS_DSPARK_FORMAT,))
DSPARK = Method(name="dspark", family=DSpark(), **_DSPARK)
DSPARK_GATED = Method(name="dspark_gated", family=DSparkGated(), **_DSPARK)
DSPARK_RNN = Method(name="dspark_rnn", family=DSparkRnn(), **_DSPARK)
