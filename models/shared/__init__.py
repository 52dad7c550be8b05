"""What every drafting method shares (the methods themselves: models/methods/, one package each):

    draft_heads.py     DraftHeads and HeadsConfig: the draft-module container, built for a Method, saved and loaded
    method.py          Method and RecipeKind: the frozen contract each method declares (models/methods/__init__.py
                       lists them)
    families.py        HeadFamily: what a method's module is (its blocks, heads class, taps, capabilities); ResBlock
    heads_proposer.py  what the per-depth heads' proposers share (Medusa's and Hydra's, in their packages)
    autoregressive/    what EAGLE-1, EAGLE-3 and a draft model share: the draft module, its heads, training, proposer
    recipes.py, training.py, schedules.py, fitting.py    typed recipes, the Lightning base module, stages, the fit
    draft_vocab.py, hidden_cache.py, head_data.py        the draft vocabulary, the base's cached states, batches
    formats.py                                           the formats other code loads, written and read

Indexing (docs/reference.md#heads): the base LM head at position t predicts token t+1;
draft head k (k = 0..K-1) at position t predicts token t+k+2.

    heads = models.methods.build_heads(HeadsConfig.for_base(model, family="hydra", num_heads=4, draft_vocab_size=4096),
                                       model, draft_ids=most_frequent(counts, 4096))   # models/shared/draft_vocab.py
    logits = heads.draft_logits(k, h_t, path_tokens)  # [..., Vd]; path_tokens = x_{t+1} .. x_{t+k+1}
    token_ids = heads.to_token_ids(logits.topk(10).indices)
    heads.head_logits(k, h_t, path_tokens)            # [..., V]: the same, -inf outside the draft vocabulary
    heads.save("results/heads/hydra");  model, heads = models.methods.load_heads("results/heads/hydra", model)
    heads.read_hidden(hidden, position_ids)           # what the heads read of the base's states (Hydra++: its prefix layer)

Draft vocabulary (draft_vocab_size, None = the full vocabulary): the heads' LM heads output logits over
`draft_ids` only. With share_lm_head they are the frozen base LM head's rows for those ids (buffers rebuilt
on attach, never saved); own LM heads are Linear(h, Vd) initialised from the same rows. `draft_ids` is saved
with the weights and checked against the base model on load.
"""
from models.shared.draft_heads import (ADAPTER_DIR, CONFIG_FILE, WEIGHTS_FILE, DraftHeads, HeadsConfig,
                                       check_compatible)

__all__ = ["ADAPTER_DIR", "CONFIG_FILE", "WEIGHTS_FILE", "DraftHeads", "HeadsConfig", "check_compatible"]
