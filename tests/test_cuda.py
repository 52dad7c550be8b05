"""The GPU code paths, on CUDA (skipped on a machine without one; CI has none): every drafter family decodes
losslessly with the base and heads on the GPU, sampling and typical acceptance run there, per-step timing
synchronises the device, each training recipe fits on the GPU under Lightning (bf16-mixed, as trainer=gpu),
the train stage runs with trainer=gpu, and the evaluate and calibrate stages run on the GPU under the host
settings (conf host.*), which their metrics record. The distill stage's tests pick the GPU by themselves (device
auto) when one is present."""
from __future__ import annotations

import json

import pytest
import pytorch_lightning as pl
import torch

from models.base import build_tiny_model
from models.engine.acceptance import SamplingConfig
from models.engine.decoding import generate, prefill, time_step
from models.engine.drafting import PromptLookupDrafter, heads_drafter, make_drafter
from models.shared import HeadsConfig
from models.methods import build_heads, load_heads
from models.shared.fitting import fit_resumable
from tests.test_calibration import _tiny_stage_config, _write_tiny_distilled
from tests.test_decoding import TREES, cyclic_prompt, prompt_ids
from tests.test_evaluate import stage_cfg  # noqa: F401  (a fixture)
from tests.test_training import loaders, make_module, save_distilled

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")
FAMILIES = ("medusa", "hydra", "hydra_pp", "eagle", "eagle3", "draft_model", "dflash")


def cuda_model(dtype=torch.float32, seed=0):
    model, tok = build_tiny_model(seed=seed)
    return model.to(CUDA, dtype), tok


def cuda_heads(model, family, seed=0):
    """Random heads of `family` on the model's device, every weight perturbed so each code path matters."""
    torch.manual_seed(seed)
    config = HeadsConfig.for_base(model, family, num_heads=4, num_layers=1, share_lm_head=family != "hydra")
    heads = build_heads(config, model).to(next(model.parameters()).device).eval()
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return heads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_decodes_losslessly_on_the_gpu(family, dtype):
    model, tok = cuda_model(dtype)
    heads = cuda_heads(model, family)
    ids = prompt_ids(tok)
    base = generate(model, tok, ids, max_new_tokens=32, stop_token_ids=[])
    assert len(base.new_tokens) == 32
    for name in ("chain4", "sparse64"):
        res = generate(model, tok, ids, heads_drafter(heads, TREES[name]), max_new_tokens=32, stop_token_ids=[])
        assert res.new_tokens == base.new_tokens, (family, name)
        assert len(res.new_tokens) == 1 + sum(res.accept_lengths)


def test_prompt_lookup_and_a_merged_tree_decode_losslessly_on_the_gpu():
    model, tok = cuda_model()
    ids = cyclic_prompt(model, tok)
    base = generate(model, tok, ids, max_new_tokens=40, stop_token_ids=[])
    pld = generate(model, tok, ids, make_drafter({"kind": "prompt_lookup"}), max_new_tokens=40, stop_token_ids=[])
    assert pld.new_tokens == base.new_tokens
    heads = cuda_heads(model, "hydra")
    merged = generate(model, tok, ids, heads_drafter(heads, TREES["chain4"], lookup=PromptLookupDrafter()),
                      max_new_tokens=40, stop_token_ids=[])
    assert merged.new_tokens == base.new_tokens


@pytest.mark.parametrize("family", ["medusa", "eagle", "eagle3", "draft_model"])
@pytest.mark.parametrize("acceptance", ["sampling", "typical"])
def test_sampling_and_typical_acceptance_run_on_the_gpu_and_repeat_with_a_seed(acceptance, family):
    model, tok = cuda_model()
    heads = cuda_heads(model, family)
    ids = prompt_ids(tok)
    sampling = SamplingConfig(temperature=0.8, top_p=0.95, seed=3, acceptance=acceptance)
    runs = [generate(model, tok, ids, heads_drafter(heads, TREES["sparse64"], want_probs=acceptance == "sampling"),
                     sampling=sampling, max_new_tokens=24, stop_token_ids=[]) for _ in range(2)]
    assert runs[0].new_tokens == runs[1].new_tokens                 # the generator lives on the GPU, seeded
    assert len(runs[0].new_tokens) == 24 and all(0 <= t < model.config.vocab_size for t in runs[0].new_tokens)


def test_step_timing_synchronises_the_gpu(monkeypatch):
    calls, real = [], torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(a) or real(*a))
    model, tok = cuda_model()
    heads = cuda_heads(model, "hydra")
    with torch.inference_mode():
        drafter = heads_drafter(heads, TREES["sparse64"])
        state = prefill(model, torch.tensor([prompt_ids(tok)], device=CUDA), SamplingConfig(), drafter=drafter)
        times = time_step(state, drafter, 3, repeats=3)
    assert len(times) == 3 and all(t["step"] > 0 and t["verify"] > 0 for t in times)
    assert len(calls) >= 2 * 4                      # clock reads around each part of the warm-up and 3 timed steps
    assert state.sync is None                       # set for the timing only


@pytest.mark.parametrize("tree_name", [None, "sparse64"])
def test_captured_static_steps_across_span_boundaries_decode_what_the_eager_step_decodes(tree_name, monkeypatch):
    """The static step's attention reads the filled span of its cache (spans of 16 slots here): a decode crossing
    span boundaries replays a graph per (verify size, span), more than one span captured, and gives the eager
    tokens (float32)."""
    from models.engine import static_step

    monkeypatch.setattr(static_step, "SPAN_STEP", 16)
    model, tok = cuda_model()
    ids = prompt_ids(tok)
    drafter = heads_drafter(cuda_heads(model, "draft_model"), TREES[tree_name]) if tree_name else None
    eager = generate(model, tok, ids, drafter, max_new_tokens=48, stop_token_ids=[], static=False)
    state = prefill(model, torch.tensor([ids], device=CUDA), SamplingConfig(), drafter=drafter)
    static = static_step.attach_static(state, drafter, max_new_tokens=48)
    graphs = generate(model, tok, ids, drafter, max_new_tokens=48, stop_token_ids=[], static=True, static_drafts=False)
    assert static.mode == "cuda_graphs" and static.fallback == {}
    assert graphs.new_tokens == eager.new_tokens
    spans = {span for _, span in static.graphs}
    assert len(spans) > 1 and max(spans) <= static.cache.capacity and all(s % 16 == 0 for s in spans)


@pytest.mark.parametrize("family", ["medusa", "eagle"])
def test_the_draft_profile_counts_the_gpu_kernels_of_a_draft(family):
    from models.measure.draft_profile import draft_profile

    model, tok = cuda_model(torch.bfloat16)
    prof = draft_profile(model, heads_drafter(cuda_heads(model, family), TREES["sparse64"]), prompt_ids(tok),
                         repeats=3)
    assert prof["kernels"] > 0 and prof["device_busy_ms"] > 0 and prof["wall_ms"] > 0
    assert prof["host_ops"] > 0 and prof["top_host_ops"]


@pytest.mark.parametrize("kind", ["medusa1", "hydra", "hydra_pp", "medusa2"])
def test_each_recipe_fits_on_the_gpu_in_bf16_mixed(kind, tmp_path):
    model, tok = build_tiny_model(seed=0)
    model.to(CUDA)
    train, val = loaders(tok, model, cache_dir=None if kind == "medusa2" else tmp_path / "cache")
    module, heads = make_module(kind, model)
    kwargs = {"accelerator": "gpu", "devices": 1, "precision": "bf16-mixed", "enable_progress_bar": False,
              "log_every_n_steps": 1}
    before = pl.Trainer(logger=False, **kwargs).validate(module, val, verbose=False)[0]["val/loss"]
    trainer, _ = fit_resumable(module, train, val, tmp_path / "ckpt", "fp", max_epochs=4, trainer_kwargs=kwargs)
    assert trainer.strategy.root_device.type == "cuda"
    assert trainer.callback_metrics["val/loss"] < before
    assert all(torch.isfinite(p).all() for p in heads.parameters())


@pytest.mark.parametrize("heads_name", ["hydra_pp", "medusa2", "eagle", "eagle3"])
def test_the_train_stage_runs_with_trainer_gpu(heads_name, compose_cfg, monkeypatch, tmp_path):
    from pipelines.common import apply_selection
    from pipelines.train import run_train

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    cfg = apply_selection(compose_cfg("profile=smoke", "trainer=gpu", f"+select.heads={heads_name}",
                                      "profile.train.batch_positions=100", "profile.train.draft_vocab_size=64",
                                      "profile.train.max_length=96", "profile.train.progress_bar=false"))
    save_distilled(cfg.data.distilled_dir)
    metrics = run_train(cfg)
    assert metrics["val_top1"]["head0"] >= 0.0
    model, _ = build_tiny_model()
    base, heads = load_heads(tmp_path / "results" / "heads" / heads_name, model.to(CUDA))
    assert next(heads.parameters()).device.type == "cuda"


def assert_gpu_host_record(host: dict) -> None:
    """A timed stage's metrics on CUDA: the GPU named and conf host.*'s settings applied (1 thread, no cuDNN)."""
    assert host["device"] == "cuda" and host["gpu"] == torch.cuda.get_device_name(0)
    assert host["host_settings"]["threads"] == host["torch_threads"] == 1
    assert host["host_settings"]["cudnn_attention"] is False and host["sdp_backends"]["cudnn"] is False


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static_step"])
def test_the_evaluate_stage_runs_on_the_gpu_under_the_host_settings(stage_cfg, tmp_path, static):  # noqa: F811
    """Eager, and with host.static_step (the base step and the drafts replayed as CUDA graphs): the stage's own
    check finds every method's greedy answer equal to the baseline's."""
    from omegaconf import open_dict

    from pipelines.evaluate import run_evaluation

    with open_dict(stage_cfg):
        stage_cfg.eval.device = "cuda"
        stage_cfg.host.static_step = static
    summary = run_evaluation(stage_cfg)                    # raises LosslessnessError on any lost token
    assert "medusa1-chain4" in summary["methods"] and "hydra-sparse64" in summary["methods"]
    metrics = [json.loads(p.read_text()) for p in (tmp_path / "reports" / "metrics").glob("*.json")]
    assert len(metrics) == 1
    assert_gpu_host_record(metrics[0]["host"])
    assert metrics[0]["host"]["host_settings"]["static_step"] is static


def test_the_calibrate_stage_runs_on_the_gpu_under_the_host_settings(tmp_path):
    from pipelines.calibrate import calibrate

    cfg = _tiny_stage_config(tmp_path, "hydra")
    cfg.profile.calibrate.device = "cuda"
    model, tok = build_tiny_model(seed=0)
    _write_tiny_distilled(tmp_path / "distilled", tok)
    build_heads(HeadsConfig.for_base(model, family="hydra", num_heads=cfg.heads.num_heads,
                                     num_layers=cfg.heads.num_layers, share_lm_head=True),
                model).save(tmp_path / "results" / "heads" / "hydra")
    calibrate(cfg)
    latency = json.loads((tmp_path / "results" / "calibrate" / "latency.json").read_text())
    assert "cuda" in json.dumps(latency["machine"]).lower()
    metrics = [json.loads(p.read_text()) for p in (tmp_path / "reports" / "metrics").glob("*.json")]
    assert metrics and all(m["host"]["device"] == "cuda" for m in metrics)
    assert_gpu_host_record(metrics[0]["host"])


def test_eagle3_under_the_static_step_decodes_the_eager_steps_tokens_from_captured_graphs():
    """EAGLE-3 (taps (2, 1, 1): tap 2 is the last layer's output before the final norm) with the base step captured
    as CUDA graphs, its taps copied into the StaticDecoder's buffer by kernels of each graph: the eager step's
    greedy tokens; and a replayed step's taps (a second step at a captured size, so no hook ran for it) are
    LayerTaps' features of the same step run eagerly."""
    from types import SimpleNamespace

    from models.engine.static_step import attach_static
    from models.engine.taps import LayerTaps, step_taps
    from tests.test_static_taps import eagle3_lookup, forward, tree_step

    model, tok = cuda_model()
    heads = cuda_heads(model, "eagle3")
    ids = cyclic_prompt(model, tok)
    base = generate(model, tok, ids, max_new_tokens=32, stop_token_ids=[], static=False)
    drafter = eagle3_lookup(heads)
    with torch.inference_mode():
        state = prefill(model, torch.tensor([ids], device=CUDA), SamplingConfig(), drafter=drafter)
        static = attach_static(state, drafter, max_new_tokens=32)
    assert static.mode == "cuda_graphs" and static.static_taps == drafter.taps == (2, 1, 1)
    res = generate(model, tok, ids, drafter, max_new_tokens=32, stop_token_ids=[], static=True)
    assert res.new_tokens == base.new_tokens and max(res.accept_lengths) > 2
    assert static.graphs and static.fallback == {}
    prompt = torch.tensor([ids[:17]], device=CUDA)
    with torch.inference_mode():
        eager, state = prefill(model, prompt, SamplingConfig()), prefill(model, prompt, SamplingConfig())
        static = attach_static(state, SimpleNamespace(taps=drafter.taps), max_new_tokens=16)
        for first in (3, 40):                                       # one verify size and span: captured, then replayed
            tokens, buf = tree_step(first)
            with LayerTaps(eager.decoder, drafter.taps) as plain:
                forward(eager.decoder, eager.cache, eager.past, (tokens.to(CUDA), buf))
            with step_taps(state.decoder, drafter.taps) as written:
                forward(state.decoder, state.cache, state.past, (tokens.to(CUDA), buf))
            torch.testing.assert_close(written.features(), plain.features(), rtol=1e-3, atol=1e-3)
            eager.past = state.past = state.cache.get_seq_length()
    assert static.graphs and static.fallback == {}
