"""Draft-head speculative decoding library: base models, trees, heads, decoder, acceptance.

Plain Python and PyTorch: no Hydra, DVC or MLflow here, so it works from a notebook.
"""
