"""What EAGLE-1, EAGLE-3 and a small draft model share: one draft module run depth after depth over its own outputs.

    draft.py         AutoregressiveDraft: decoder layers of the base's class over (feature, next token) pairs
    heads.py         AutoregressiveFamily and AutoregressiveHeads: the module container holding one draft module
    training.py      AutoregressiveRecipe and AutoregressiveFitModule: training unrolled over its own predictions
    proposer.py      AutoregressiveProposer: drafting a tree (fixed or grown) with its own KV cache
    static_cache.py  StaticDraftCache: the draft cache of fixed capacity a replayed CUDA graph reads
"""
