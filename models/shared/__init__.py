"""The drafting methods: Medusa-1/2 (heads independent per depth), Hydra and Hydra++ (sequentially dependent
heads), EAGLE, EAGLE-3 and a small draft model (one module run autoregressively, models/shared/autoregressive/draft.py);
their families (families.py), typed recipes (recipes.py) and training (training.py, eagle_training.py), their
proposers for the engine (proposers.py, autoregressive_proposer.py, registered by drafting.py) and formats.

Indexing (docs/reference.md#heads): the base LM head at position t predicts token t+1;
draft head k (k = 0..K-1) at position t predicts token t+k+2.

    heads = build_heads(HeadsConfig.for_base(model, family="hydra", num_heads=4, draft_vocab_size=4096), model,
                        draft_ids=most_frequent(counts, 4096))          # models/shared/draft_vocab.py
    logits = heads.draft_logits(k, h_t, path_tokens)  # [..., Vd]; path_tokens = x_{t+1} .. x_{t+k+1}
    token_ids = heads.to_token_ids(logits.topk(10).indices)
    heads.head_logits(k, h_t, path_tokens)            # [..., V]: the same, -inf outside the draft vocabulary
    heads.save("results/heads/hydra");  model, heads = load_heads("results/heads/hydra", model)
    heads.read_hidden(hidden, position_ids)           # what the heads read of the base's states (Hydra++: its prefix layer)

Draft vocabulary (draft_vocab_size, None = the full vocabulary): the heads' LM heads output logits over
`draft_ids` only. With share_lm_head they are the frozen base LM head's rows for those ids (buffers rebuilt
on attach, never saved); own LM heads are Linear(h, Vd) initialised from the same rows. `draft_ids` is saved
with the weights and checked against the base model on load.
"""
from models.shared.draft_heads import (ADAPTER_DIR, CONFIG_FILE, WEIGHTS_FILE, DraftHeads, HeadsConfig,  # noqa: F401
                                      build_heads, check_compatible, load_heads)
from models.shared.families import FAMILIES, ResBlock, get_family  # noqa: F401
