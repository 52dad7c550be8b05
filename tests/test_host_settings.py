"""Host settings for decoding on a GPU (models/hardware.py, conf host.*): chosen per device, applied by the timed
stages once their device is known, recorded in their metrics. The CUDA check is stubbed, so this runs on a CPU."""
from __future__ import annotations

import json

import pytest
import torch

from models import hardware
from pipelines.host import apply_host, static_step


def test_cuda_gets_one_thread_and_no_cudnn_attention_a_cpu_gets_nothing():
    assert hardware.choose_host_settings("cuda") == {"threads": 1, "cudnn_attention": False, "static_step": False}
    assert hardware.choose_host_settings("cuda:1", threads=16, cudnn_attention=True, static_step=True) == {
        "threads": 16, "cudnn_attention": True, "static_step": True}
    assert hardware.choose_host_settings("cuda", None, None, None) == {}        # torch's own stays, no static step
    assert hardware.choose_host_settings("cpu") == {}
    assert hardware.choose_host_settings(torch.device("cpu"), threads=4) == {}


@pytest.mark.parametrize("key,value", [("threads", 0), ("threads", "many"), ("threads", True),
                                       ("cudnn_attention", "off"), ("static_step", 1)])
def test_bad_host_settings_name_the_value(key, value):
    with pytest.raises(ValueError, match=repr(value)):
        hardware.choose_host_settings("cuda", **{key: value})


def test_on_a_cpu_nothing_is_set_and_the_record_says_so(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(("threads", n)))
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", lambda on: calls.append(("cudnn", on)))
    record = hardware.apply_host_settings("cpu")
    assert calls == []
    assert record["host_settings"] == {} and record["device"] == "cpu" and record["gpu"] is None
    assert record["torch"] == torch.__version__ and "cuda" in record and "cudnn" in record["sdp_backends"]


@pytest.fixture
def fake_cuda(monkeypatch):
    """The device check answers "CUDA" for any device; the two switches record their calls instead of acting."""
    calls = {"threads": [], "cudnn": []}
    monkeypatch.setattr(hardware, "is_cuda", lambda device: True)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls["threads"].append(n))
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", lambda on: calls["cudnn"].append(on))
    monkeypatch.setattr(hardware, "HOST_SETTINGS", {})
    return calls


def test_config_overrides_reach_the_switches(fake_cuda, compose_cfg):
    record = apply_host(compose_cfg("host.cuda_threads=3", "host.cudnn_attention=null"), "cuda")
    assert fake_cuda == {"threads": [3], "cudnn": []}
    assert record["host_settings"] == {"threads": 3, "static_step": False}


def test_evaluate_on_cuda_takes_the_host_settings_and_records_them(fake_cuda, compose_cfg, tmp_path):
    """The evaluate stage on the tiny model, baseline only, with the device check stubbed to CUDA: its own thread
    count first, then the host settings' (conf host.cuda_threads), cuDNN attention switched off, and the metrics
    file records the settings."""
    from pipelines.evaluate import run_evaluation

    qfile = tmp_path / "questions.jsonl"
    qfile.write_text(json.dumps({"question_id": 1, "category": "math", "turns": ["What is 2 + 2?"]}) + "\n")
    cfg = compose_cfg("profile=smoke", "heads=none", f"data.questions_file={qfile}", "profile.eval.num_questions=1",
                      "profile.eval.turns=1", "profile.eval.max_new_tokens=4", "profile.eval.repeats=1",
                      "profile.eval.warmup=0", "eval.prompt_lookup.enabled=false", "eval.sps_hf.enabled=false",
                      "eval.num_threads=2", "host.cuda_threads=5", "eval.device=cpu")
    run_evaluation(cfg)
    assert fake_cuda["threads"] == [2, 5] and fake_cuda["cudnn"] == [False]
    (metrics_file,) = (tmp_path / "reports" / "metrics").glob("evaluate_*.json")
    host = json.loads(metrics_file.read_text())["host"]
    assert host["host_settings"] == {"threads": 5, "cudnn_attention": False, "static_step": False}
    assert host["device"] == "cpu" and host["torch"] == torch.__version__ and "cuda" in host


def test_the_static_step_is_the_configs_on_cuda_only_and_off_unless_chosen(compose_cfg, monkeypatch):
    """static_step(cfg, device): what the stages pass to generate(static=...); host.static_step on CUDA (the check
    stubbed), False by default and on a CPU whatever the config says; a value not true/false/null is refused."""
    on, default = compose_cfg("host.static_step=true"), compose_cfg()
    assert static_step(on, "cpu") is False and static_step(default, "cpu") is False
    monkeypatch.setattr(hardware, "is_cuda", lambda device: True)
    assert static_step(on, "cuda") is True and static_step(default, "cuda") is False
    assert static_step(compose_cfg("host.static_step=null"), "cuda") is False
    with pytest.raises(ValueError, match="host static_step='yes': use true, false, or null"):
        static_step(compose_cfg("host.static_step=yes"), "cuda")


@pytest.mark.parametrize("chosen", [True, False])
def test_the_evaluation_passes_the_static_step_to_the_decoder(compose_cfg, monkeypatch, chosen):
    """A turn of the evaluation decodes with static=host.static_step (CUDA stubbed; the decoder stubbed to record)."""
    import pipelines.evaluate as evaluate
    from pipelines.methods import Contender, Kind

    monkeypatch.setattr(hardware, "is_cuda", lambda device: True)
    calls = []
    monkeypatch.setattr(evaluate, "generate", lambda *a, **k: calls.append(k["static"]))
    cfg = compose_cfg("profile=smoke", f"host.static_step={str(chosen).lower()}")
    baseline = Contender("baseline", Kind.BASELINE, torch.nn.Linear(2, 2))
    evaluate.generate_turn(baseline, None, [1, 2], cfg, 0.0, 0, [])
    assert calls == [chosen]
