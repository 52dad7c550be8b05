"""What every stage shares: Hydra entry point, MLflow run, loading the configured model."""
from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = str(REPO_ROOT / "conf")
log = logging.getLogger("pipelines")


STAGE_START: dict = {}      # when the running stage's command started and its profile.name (set by @stage)


def run_record() -> dict:
    """What a stage's metrics say about the run that made them: the commit, the machine, the date, the profile (so
    that a metrics file another profile's run left can be told apart) and the stage's wall time since its command
    started (profile and wall time None when called outside a stage command)."""
    from models.hardware import cpu_flags, cpu_model

    started = STAGE_START.get("t")
    return {"commit": git_commit(), "cpu": cpu_model(), "cpu_flags": cpu_flags(), "cpu_count": os.cpu_count(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "profile": STAGE_START.get("profile"),
            "wall_time_s": None if started is None else round(time.time() - started, 1)}


def stage(fn):
    """Hydra entry point for a stage: composes conf/config.yaml with the command-line overrides.

    `+select.<group>=<option>` swaps in conf/<group>/<option>.yaml after composition. DVC stages need
    it: they run on the fully composed params.yaml, where a plain `heads=hydra` group override no
    longer exists (e.g. `python -m pipelines.train --config-dir . --config-name params +select.heads=hydra`).
    """
    @functools.wraps(fn)
    def main(cfg: DictConfig):
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        STAGE_START["t"] = time.time()
        cfg = apply_selection(cfg)
        STAGE_START["profile"] = OmegaConf.select(cfg, "profile.name")       # for run_record
        return fn(cfg)
    return hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")(main)


def conf_option(group: str, option: str) -> DictConfig:
    """conf/<group>/<option> as Hydra composes it (the root config with `group=option`), unresolved: its
    interpolations read the config it goes into. The one place a stage reads an option it was not composed with;
    an unknown one names the group's options. Inside a running Hydra app, its global state is put back after."""
    return OmegaConf.create(_composed_option(group, option))      # a fresh copy every time


@functools.lru_cache(maxsize=None)
def _composed_option(group: str, option: str) -> dict:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import MissingConfigException

    gh = GlobalHydra.instance()
    running = gh.hydra if gh.is_initialized() else None
    gh.clear()
    try:
        with initialize_config_dir(str(CONF_DIR), version_base=None):
            node = compose(config_name="config", overrides=[f"{group}={option}"])[group]
    except MissingConfigException:
        raise ValueError(f"{group}={option!r} is not an option; available options in {group!r}: "
                         f"{conf_options(group)}") from None
    finally:
        gh.clear()
        if running is not None:
            gh.initialize(running)
    return OmegaConf.to_container(node, resolve=False)


def conf_options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))


def apply_selection(cfg: DictConfig) -> DictConfig:
    """Replace each group named in cfg.select with its option (conf_option), resolved against cfg."""
    selection = cfg.get("select") or {}
    if not selection:
        return cfg
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        for group, option in selection.items():
            try:
                cfg[group] = conf_option(str(group), str(option))
            except ValueError as err:
                raise ValueError(f"select.{group}={option!r}: {err}") from None
        del cfg["select"]
    OmegaConf.resolve(cfg)
    return cfg


def git_commit() -> str:
    """$SOURCE_COMMIT where set (a copy of the tree run elsewhere, whose git metadata may be another commit's), else
    HEAD's hash, else "unknown"."""
    if os.environ.get("SOURCE_COMMIT"):
        return os.environ["SOURCE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        head = out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        head = ""
    return head or "unknown"


def _flat_params(cfg: DictConfig) -> dict[str, str]:
    """Resolved config flattened to `a.b.c: value` (long lists shortened: MLflow caps param size)."""
    out: dict[str, str] = {}

    def walk(prefix, node):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            text = json.dumps(node) if isinstance(node, list) else str(node)
            out[prefix] = text if len(text) <= 500 else text[:497] + "..."
    walk("", OmegaConf.to_container(cfg, resolve=True))
    return out


@contextlib.contextmanager
def mlflow_run(cfg: DictConfig, stage_name: str, run_name: str | None = None):
    """One MLflow run per stage invocation: resolved config, params and tags logged on entry."""
    import mlflow

    # The env var wins at run time too: params.yaml holds the URI resolved when it was composed.
    mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI") or cfg.mlflow.tracking_uri)
    mlflow.set_experiment(cfg.mlflow.experiment)
    tags = {"stage": stage_name, "git_commit": git_commit(), "model": cfg.model.name,
            "profile": cfg.profile.name}
    if os.environ.get("DVC_EXP_NAME"):
        tags["dvc_experiment"] = os.environ["DVC_EXP_NAME"]
    with mlflow.start_run(run_name=run_name or stage_name, tags=tags) as run:
        mlflow.log_params(_flat_params(cfg))
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "config.yaml"
            path.write_text(OmegaConf.to_yaml(cfg, resolve=True))
            mlflow.log_artifact(str(path))
        yield run


def stop_token_ids(model, tokenizer) -> list[int]:
    """The tokens that end an answer: the tokenizer's EOS and the model's generation config's."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    return sorted(i for i in ids if i is not None)


def flat_metrics(stats: dict, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of nested metrics as `a.b.c` keys, what MLflow's log_metrics takes (records such as `run` or
    `host` hold strings and dicts; their numbers come along, the rest stays in the metrics file)."""
    out = {}
    for k, v in stats.items():
        if isinstance(v, dict):
            out.update(flat_metrics(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = float(v)
    return out


def file_sha256(path: str | Path, h=None):
    """`h` (a new sha256 when None) updated with the file's bytes, read in 1 MiB blocks (model files are large)."""
    h = hashlib.sha256() if h is None else h
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h


@contextlib.contextmanager
def atomic_file(path: str | Path, fsync: bool = False):
    """Open `<path>.tmp` for writing and rename it onto path on a clean exit: path is whole or absent.
    Readers never read *.tmp; a kill leaves the .tmp behind for the next run to overwrite. fsync=True: on disk
    before the rename (resumable results that must survive a crash)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        yield f
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: str | Path, obj) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as f:  # a killed stage never leaves half a metrics file
        f.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    return path


def load_model(cfg: DictConfig, device: str = "cpu"):
    """(model, tokenizer) for cfg.model: converted folder, hub id or tiny random."""
    from models.base import load_base_model

    tiny = OmegaConf.to_container(cfg.model.tiny) if cfg.model.tiny else None
    return load_base_model(cfg.model.source, dtype=cfg.model.dtype, device=device,
                           chat_template=cfg.model.chat_template, tiny=tiny)


@functools.lru_cache(maxsize=None)
def heads_options() -> list[str]:
    """The head configs in conf/heads/ that have heads (every one but `none`)."""
    return [name for name in conf_options("heads") if conf_option("heads", name).get("family") != "none"]
