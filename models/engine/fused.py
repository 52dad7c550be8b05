"""The decoder's element-wise work fused by torch.compile inside the static step (models/engine/static_step.py).

    fused = FusedParts(decoder, backend="inductor")    # compiled now, on a sample; fused.error: why not, or None
    with fused.applied():                              # the static step's own forwards (the ones captured)
        out = decoder(...)

A 7B step's element-wise kernels took 1.84 ms unfused against 0.44 ms in transformers' compiled static generate
(H200, docs/engine.md): an RMSNorm is about seven kernels a call, the MLP's SiLU-and-multiply two. Here each layer's
two norms and its MLP, and the final norm, are compiled with dynamic shapes (one compilation serves every verify
size, and the repeated layers share it) and swapped in only around the static step's forwards, which CUDA graphs
capture. The model, its state dict and every other forward stay as they were. Where compiling fails, the parts stay
unfused and `error` says why. The fused step equals the eager one within the dtype rule (tests/test_fused.py).
"""
from __future__ import annotations

import contextlib

import torch

PARTS = ("input_layernorm", "post_attention_layernorm", "mlp")     # per decoder layer; and the decoder's final norm


class FusedParts:
    """Compiled copies of the decoder's element-wise parts (module docstring), compiled on a sample at construction."""

    def __init__(self, decoder, backend: str = "inductor"):
        self.backend, self.error, self.swaps = backend, None, []
        owners = [(layer, name) for layer in decoder.layers for name in PARTS]
        parts = [(owner, name, getattr(owner, name, None)) for owner, name in [*owners, (decoder, "norm")]]
        try:
            self.swaps = [(owner, name, part, torch.compile(part, backend=backend, dynamic=True))
                          for owner, name, part in parts if isinstance(part, torch.nn.Module)]
            self._warm(decoder)
        except Exception as e:  # noqa: BLE001  (fusion is an optimisation; the unfused parts are the reference)
            self.error = f"{type(e).__name__}: {str(e)[:200]}"

    def _warm(self, decoder) -> None:
        """Every compiled part once on a [1, 2, h] sample: compilation, and any failure, happen here."""
        param = next(decoder.parameters())
        x = torch.randn(1, 2, decoder.config.hidden_size, device=param.device, dtype=param.dtype)
        with torch.inference_mode():
            for _, _, part, compiled in self.swaps:
                torch.testing.assert_close(compiled(x), part(x), rtol=5e-2, atol=5e-2)

    @property
    def parts(self) -> list[str]:
        return sorted({name for _, name, _, _ in self.swaps}) if self.error is None else []

    @contextlib.contextmanager
    def applied(self):
        """The compiled parts in the model's place for the forwards run inside (none where compiling failed)."""
        swaps = [] if self.error is not None else self.swaps
        for owner, name, _, compiled in swaps:
            setattr(owner, name, compiled)
        try:
            yield
        finally:
            for owner, name, part, _ in swaps:
                setattr(owner, name, part)

    def summary(self) -> dict:
        return {"backend": self.backend, "parts": self.parts, "error": self.error}
