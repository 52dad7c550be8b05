"""Host settings for decoding on a GPU, from the config: what pipelines/omp.py is for OpenMP on a CPU.

The timed stages (evaluate, calibrate, generate, the benchmarks) call apply_host(cfg, device) once their device is
known, after their own thread count, and write models.hardware.host_record(device) into their metrics; they pass
static_step(cfg, device) to the decoder themselves (generate, verify_latency_profile: the engine reads no setting). The settings and the
measurements behind them are in models/hardware.py; conf/config.yaml's `host` block overrides them
(`host.cuda_threads=16`, `host.cudnn_attention=null` for torch's own). On a CPU nothing changes.
"""
from __future__ import annotations

from omegaconf import DictConfig

from models.hardware import apply_host_settings, choose_host_settings


def apply_host(cfg: DictConfig, device: str) -> dict:
    """The host settings for decoding on `device` from cfg.host (conf/config.yaml; `host.cuda_threads=16`,
    `host.cudnn_attention=null` to leave torch's own, `host.static_step=true` for CUDA graphs), applied after the stage's own thread count: on CUDA they
    win, on a CPU nothing changes. -> the record every timed stage writes into its metrics (models.hardware)."""
    host = cfg.get("host") or {}
    return apply_host_settings(device, threads=host.get("cuda_threads", "default"),
                               cudnn_attention=host.get("cudnn_attention", "default"),
                               static_step=host.get("static_step", "default"))


def static_step(cfg: DictConfig, device) -> bool:
    """Whether the stage decodes with the static step on `device` (host.static_step: CUDA graphs; off unless
    chosen, never on a CPU), the value it passes as generate(..., static=...)."""
    host = cfg.get("host") or {}
    return bool(choose_host_settings(device, static_step=host.get("static_step", "default")).get("static_step", False))
