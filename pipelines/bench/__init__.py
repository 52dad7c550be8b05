"""Benchmarks beside the pipeline, by hand (`make bench`, `make bench-cut`, ...): none is a DVC stage, each prints
its figures and writes one JSON (and a plot) under reports/bench/. They import the library and the stages'
helpers, never the reverse.

    verify    the verify step's cost against a 1-token step, and each drafter's per-step overhead
    cut       the trained heads' MT-Bench steps replayed under other tree cuts, an oracle cut included
    tree_oracle  the tree grown per step against the oracle of its size, along evaluate's own records
    joint     what Medusa-2's joint stage does to head 0, step by step
    load      how much slower decoding gets when other processes share the cores, per OpenMP setting
    scaling   draft quality against training data: families retrained on fewer conversations
    gpu       the papers' shapes on the device at hand: plain step, verify profile, drafting, generate
"""
