"""Speculative decoding library: one engine, one package per drafting method.

    models/base.py      loading a base model (a folder, a hub id, or a tiny random one for tests)
    models/engine/      the decoding engine: one step for every batch size (step.py), trees, drafters, acceptance rules,
                        the pruned KV cache, the CPU fast paths
    models/methods/     one package per drafting method: medusa/ (Medusa-1/2), hydra/ (Hydra, Hydra++),
                        eagle/ (EAGLE-1/3), draft_model/, dflash/: module, family, proposer, training, formats;
                        listed in models/methods/__init__.py (METHODS), where every caller looks them up
    models/shared/      what the methods share: the module container (DraftHeads), the Method contract, the
                        family, recipe and format bases, proposer and training bases, draft vocabulary, data,
                        hidden cache; autoregressive/: what EAGLE-1, EAGLE-3 and the draft model share
    models/data/        ShareGPT, chat-templated conversations, self-distillation and relabelling
    models/measure/     tree calibration, the verify-step latency profile, MT-Bench speed summaries

Plain Python and PyTorch: no Hydra, DVC or MLflow here, so it works from a notebook.
"""
