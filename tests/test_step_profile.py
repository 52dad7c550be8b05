"""models/measure/step_profile.py: a decode step's wall time, and on CUDA its kernels, from decodes of 1 and n
tokens. Timings are recorded, never asserted against a target."""
from __future__ import annotations

import pytest
import torch

from models.base import build_tiny_model
from models.engine.decoding import generate
from models.measure.step_profile import step_profile


def _decoder(device: str):
    model, _ = build_tiny_model()
    model = model.to(device).eval()
    calls = []

    def decode(k: int):
        calls.append(k)
        return generate(model, None, list(range(3, 27)), max_new_tokens=k, stop_token_ids=[])
    return decode, calls


def test_a_cpu_step_is_timed_from_decodes_of_one_and_n_tokens():
    decode, calls = _decoder("cpu")
    prof = step_profile(decode, "cpu", n=5, repeats=2)
    assert prof["tokens"] == 5 and prof["wall_ms"] is not None
    assert prof["device_busy_ms"] is None and prof["kernels"] is None and prof["top_kernels"] is None
    assert calls == [1, 5, 5, 1, 5, 1]                   # warm-ups, then each timing a pair


def test_fewer_than_two_tokens_are_refused_naming_the_value():
    with pytest.raises(ValueError, match="n=1"):
        step_profile(lambda k: None, "cpu", n=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_step_counts_its_kernels_and_launches():
    decode, _ = _decoder("cuda")
    prof = step_profile(decode, "cuda", n=6, repeats=1)
    assert prof["device_busy_ms"] > 0 and prof["kernels"] > 0 and prof["launches"] > 0
    assert prof["top_kernels"] and all(ms >= 0 for ms, _ in prof["top_kernels"].values())
