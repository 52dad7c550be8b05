"""The decode step's parts in device time (models/engine/step.py DeviceClock): an event at each part boundary of
every step, read once after the run. On the CPU the host clock stands in (HostEvent), so the device parts must
agree with the host's own timings; on a GPU the same code reads torch.cuda.Event (make bench-gpu)."""
from __future__ import annotations

import pytest

from models.base import build_tiny_model
from models.engine.decoding import generate
from models.engine.drafting import heads_drafter
from models.engine.step import DEVICE_PARTS, DeviceClock, HostEvent
from models.engine.trees import chain_tree
from models.methods import build_heads
from models.shared import HeadsConfig
from tests.test_decoding import cyclic_prompt

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("drafted", [False, True], ids=["plain", "hydra"])
def test_every_step_is_marked_at_its_five_boundaries_and_the_parts_agree_with_the_host(drafted):
    model, tok = build_tiny_model(seed=0)
    ids = cyclic_prompt(model, tok, known=12)
    drafter = None
    if drafted:
        heads = build_heads(HeadsConfig.for_base(model, "hydra", num_heads=3), model).eval()
        drafter = heads_drafter(heads, chain_tree(3))
    clock = DeviceClock(HostEvent)
    res = generate(model, tok, ids, drafter, max_new_tokens=24, stop_token_ids=[], device_clock=clock)
    assert len(clock.steps) == res.steps and all(len(marks) == 5 for marks in clock.steps)
    assert all(a.t <= b.t for marks in clock.steps for a, b in zip(marks, marks[1:]))
    dev, host = res.device_timings, res.timings
    assert list(dev) == list(DEVICE_PARTS) and all(v >= 0 for v in dev.values())
    # the same boundaries as the host's reads: the draft alike, the verify's forward and the LM head with the rule
    # together alike (the host splits the LM head out of accept into verify)
    assert dev["draft"] == pytest.approx(host["draft"], rel=0.1, abs=2e-3)
    assert dev["forward"] + dev["accept"] == pytest.approx(host["verify"] + host["accept"], rel=0.1, abs=2e-3)
    assert dev["forward"] <= host["verify"] + 2e-3
    assert sum(dev.values()) <= res.decode_time


def test_without_a_clock_there_are_no_device_timings_and_the_clock_synchronises_once():
    model, tok = build_tiny_model(seed=0)
    assert generate(model, tok, cyclic_prompt(model, tok, known=8), max_new_tokens=4).device_timings == {}
    clock, calls = DeviceClock(HostEvent), []
    generate(model, tok, cyclic_prompt(model, tok, known=8), max_new_tokens=4, device_clock=clock)
    assert set(clock.seconds(lambda: calls.append(1))) == set(DEVICE_PARTS) and calls == [1]
