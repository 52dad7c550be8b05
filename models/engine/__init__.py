"""The decoding engine: one decode step (decoding.py) and what it runs: trees, drafters, acceptance rules,
the pruned KV cache and the CPU fast paths."""
