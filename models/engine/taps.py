"""Hidden states from inside the base model, taken during a forward the decoder runs anyway (EAGLE-3's features).

    taps = heads.family.taps(model.config)                       # EAGLE-3: (2, L // 2, L - 3), hidden_states indices
    with LayerTaps(model.get_decoder(), taps) as tapped:
        out = model.get_decoder()(input_ids=ids, ...)             # any forward: prefill, verify, a training batch
    features = tapped.features()                                  # [B, T, len(taps) * h], taps in the order given

Tap i is the output of decoder layer i - 1, i.e. the input of layer i: transformers' `hidden_states[i]`
(output_hidden_states=True) for i < L. Tap L is the last layer's output before the final norm (transformers'
hidden_states[L] is after it); only a clamped tap of a 1- or 2-layer test model is L. A forward hook on layer
i - 1 records it, so the forward is not run a second time and the other layers' states are never kept. With no
taps the context does nothing.

The decode step takes its recorder from step_taps(decoder, taps): LayerTaps, or, for a decoder that writes its taps
itself inside its forward (the static step's StaticDecoder, whose captured CUDA graphs replay no Python hook:
models/engine/static_step.py), that decoder's `taps_for(taps)`, a WrittenTaps with the same interface.
"""
from __future__ import annotations

import torch


class LayerTaps:
    """Records transformers' hidden_states[i] for each i in `taps` during the forwards run inside the context."""

    def __init__(self, decoder, taps: tuple[int, ...] | list[int]):
        self.decoder, self.taps = decoder, tuple(int(i) for i in taps)
        n = len(decoder.layers)
        bad = [i for i in self.taps if not 1 <= i <= n]
        if bad:
            raise ValueError(f"taps {bad} are not layer outputs of a {n}-layer decoder (1 to {n})")
        self.outputs: dict[int, torch.Tensor] = {}
        self.handles = []

    def __enter__(self) -> "LayerTaps":
        for i in self.taps:
            self.handles.append(self.decoder.layers[i - 1].register_forward_hook(self._keep(i)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _keep(self, i: int):
        def hook(module, args, output):
            self.outputs[i] = output[0] if isinstance(output, tuple) else output      # [B, T, h]
        return hook

    def features(self) -> torch.Tensor | None:
        """The last forward's taps side by side: [B, T, len(taps) * h] (None without taps)."""
        if not self.taps:
            return None
        missing = [i for i in self.taps if i not in self.outputs]
        if missing:
            raise RuntimeError(f"no forward ran through the layers of taps {missing} inside the context")
        return torch.cat([self.outputs[i] for i in self.taps], dim=-1)


class WrittenTaps:
    """LayerTaps' interface (a context, `.taps`, features()) over taps a decoder writes itself during its forward:
    features() is read(taps), the last forward's [B, T, len(taps) * h] as a tensor of its own (None without taps)."""

    def __init__(self, taps: tuple[int, ...] | list[int], read):
        self.taps, self.read = tuple(int(i) for i in taps), read

    def __enter__(self) -> "WrittenTaps":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def features(self) -> torch.Tensor | None:
        return self.read(self.taps) if self.taps else None


def step_taps(decoder, taps: tuple[int, ...] | list[int]) -> "LayerTaps | WrittenTaps":
    """The taps recorder of one step's forward through `decoder`: its own (`decoder.taps_for(taps)`) where it writes
    its taps itself, else LayerTaps' hooks."""
    own = getattr(decoder, "taps_for", None)
    return own(taps) if own is not None else LayerTaps(decoder, taps)


@torch.no_grad()
def final_and_taps(decoder, input_ids: torch.Tensor, taps: tuple[int, ...] = (), **kwargs) -> torch.Tensor:
    """One forward of `decoder` over input_ids [B, T] -> [B, T, h * (1 + len(taps))]: the final hidden state (after the
    final norm) followed by the taps (right padding: ignore the pads' rows)."""
    with LayerTaps(decoder, taps) as tapped:
        final = decoder(input_ids=input_ids, **kwargs).last_hidden_state
    return final if not taps else torch.cat([final, tapped.features().to(final.dtype)], dim=-1)
