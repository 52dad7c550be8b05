"""Draft-head speculative decoding library.

    models/base.py      loading a base model (a folder, a hub id, or a tiny random one for tests)
    models/engine/      the decoding engine: decode_step (decoding.py), trees, drafters, acceptance rules,
                        the pruned KV cache, the CPU fast paths
    models/heads/       draft heads: the family registry (families.py), the modules, draft vocabulary,
                        training (Lightning modules), their data and the hidden-state cache
    models/data/        ShareGPT, chat-templated conversations, self-distillation and relabelling
    models/measure/     tree calibration, the verify-step latency profile, MT-Bench speed summaries

Plain Python and PyTorch: no Hydra, DVC or MLflow here, so it works from a notebook.
"""
