"""Scale-out and resume of head training: the samplers share every batch out to disjoint ranks, a run killed
mid-epoch resumes at the next unseen batch (each epoch covers every example once, the weights equal an
uninterrupted run's), and the train stage runs under DDP on 2 CPU processes (gloo) to heads that load and
decode losslessly. Tiny random model, synthetic conversations."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import pytorch_lightning as pl
import torch

from models.engine.drafting import heads_drafter
from models.base import build_tiny_model
from models.shared import HeadsConfig
from models.methods import build_heads, load_heads
from models.shared.head_data import (HeadsDataset, LengthBatches, PositionWindows, WindowBatches, conversation_loader,
                                    window_loader)
from models.shared.hidden_cache import HiddenCache
from models.shared.fitting import fit_resumable
from models.methods import new_recipe, recipe_kind
from tests.test_training import Interrupt, conversations, examples, save_distilled   # answers that repeat a short pattern

pytestmark = pytest.mark.usefixtures("one_thread")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- the samplers -------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
def test_samplers_share_every_batch_out_to_disjoint_ranks(world):
    """Per epoch: the ranks' shares are disjoint, cover every example once and hold as many batches each;
    the order is fixed by (seed, epoch) and changes with the epoch."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(10, 200, (41,), generator=g).tolist()
    samplers = {"windows": (WindowBatches(103, batch_positions=10, seed=3), 103),
                "conversations": (LengthBatches(lengths, [n // 2 for n in lengths], 150, shuffle=True, seed=3), 41)}
    for name, (sampler, n) in samplers.items():
        orders = []
        for epoch in (0, 1):
            shares = [sampler.rank_batches(epoch, rank, world) for rank in range(world)]
            assert len({len(s) for s in shares}) == 1, name                    # no rank waits for another
            assert all(b for s in shares for b in s), name                      # and none gets an empty batch
            seen = [i for s in shares for b in s for i in b]
            assert sorted(seen) == list(range(n)), name                         # disjoint, every example once
            assert shares == [sampler.rank_batches(epoch, rank, world) for rank in range(world)]
            orders.append(shares[0])
        assert orders[0] != orders[1], name
        assert [i for b in sampler.rank_batches(0, 0, 1) for i in b] == [i for b in sampler for i in b]


@pytest.mark.parametrize("world", [1, 2])
def test_a_restored_sampler_goes_on_where_each_rank_stopped(world, monkeypatch):
    """state_dict after k batches, loaded into a fresh sampler: each rank gets the rest of its own share."""
    from models.shared import head_data

    for rank in range(world):
        monkeypatch.setattr(head_data, "replica", lambda: (rank, world))
        first = WindowBatches(103, batch_positions=10, seed=3)
        first.set_epoch(2)
        done = [b for _, b in zip(range(4), first)]
        second = WindowBatches(103, batch_positions=10, seed=3)
        second.load_state_dict(first.state_dict())
        assert first.state_dict() == {"seed": 3, "epoch": 2, "offset": 4}
        assert done + list(second) == first.rank_batches(2, rank, world)
        assert list(second) == first.rank_batches(2, rank, world)         # the offset serves one pass only
        with pytest.raises(ValueError, match="seed 3"):
            WindowBatches(103, batch_positions=10, seed=4).load_state_dict(first.state_dict())


# -- resume mid-epoch ---------------------------------------------------------------------------


class Record(pl.Callback):
    """(global step after the batch, epoch, the examples of the batch) of every training batch."""

    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.rows.append((trainer.global_step, trainer.current_epoch, batch["index"].tolist()))

    def on_train_end(self, trainer, module):
        self.last = {k: v.detach().clone() for k, v in module.heads.state_dict().items()}    # before the best epoch


def seeded_module(model):
    torch.manual_seed(0)                                  # the same initial heads in every run
    heads = build_heads(HeadsConfig.for_base(model, "hydra", num_heads=3, dropout=0.0), model)
    heads.requires_grad_(True)
    model.requires_grad_(False)
    return recipe_kind("hydra").module(heads, model, new_recipe(kind="hydra", lr=1e-2, warmup_ratio=0.0))


@pytest.mark.parametrize("batches", ["conversations", "windows"])
def test_resume_mid_epoch_covers_each_example_once_and_matches_an_uninterrupted_run(batches, tmp_path):
    model, tok = build_tiny_model(seed=0)
    tr, va = examples(tok, 12, 0), examples(tok, 4, 1)
    pad = tok.pad_token_id
    cache = HiddenCache.build(model, tr[0], tmp_path / "cache", batch_tokens=400) if batches == "windows" else None

    def loader():                                         # a fresh one for every run, as in a new process
        if batches == "windows":
            return window_loader(HeadsDataset(*tr, cache), 3, batch_positions=50, pad_id=pad, seed=5)
        return conversation_loader(HeadsDataset(*tr), 50, pad, shuffle=True, seed=5)

    val = conversation_loader(HeadsDataset(*va), 100, pad, shuffle=False)
    n, per_epoch, epochs = len(loader().dataset), len(loader()), 3    # 12 conversations in 6 batches, 336 windows in 7
    kwargs = {"accelerator": "cpu", "devices": 1, "enable_progress_bar": False}

    def fit(ckpt, *callbacks, every=None):
        return fit_resumable(seeded_module(model), loader(), val, tmp_path / ckpt, "fp", epochs, kwargs,
                             callbacks=list(callbacks), every_n_train_steps=every)

    reference = Record()
    fit("reference", reference)
    before, after = Record(), Record()
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit("ckpt", before, Interrupt(per_epoch + 3), every=2)               # killed in epoch 1 after its 3rd batch
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert saved["epoch"] == 1 and saved["global_step"] == per_epoch + 2 - per_epoch % 2
    trainer, _ = fit("ckpt", after, every=2)
    assert trainer.global_step == epochs * per_epoch
    # what the checkpoint had trained on, then the resumed run
    rows = [r for r in before.rows if r[0] <= saved["global_step"]] + after.rows
    assert [r[0] for r in rows] == list(range(1, epochs * per_epoch + 1))            # every step once
    orders = [[i for _, e, ids in reference.rows if e == epoch for i in ids] for epoch in range(epochs)]
    assert orders[0] != orders[1] != orders[2]                                        # reshuffled every epoch
    for epoch in range(epochs):
        seen = [i for _, e, ids in rows if e == epoch for i in ids]
        assert sorted(seen) == list(range(n)), f"epoch {epoch} repeats or skips examples"
        assert seen == orders[epoch]                                                  # in the same order
    assert reference.last.keys() == after.last.keys()
    for name, weight in reference.last.items():
        assert torch.allclose(after.last[name], weight, rtol=0, atol=1e-6), name


# -- the train stage under DDP ------------------------------------------------------------------


RECORDING_SCRIPT = '''
"""pipelines.train's main, its Throughput callback also writing what each rank trained on (Lightning's DDP
launcher runs this same script again for rank 1)."""
import json
import os

import torch.distributed as dist

import pipelines.train as train


class Recorded(train.Throughput):
    def __init__(self):
        super().__init__()
        self.seen = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)
        self.seen.setdefault(trainer.current_epoch, []).extend(batch["index"].tolist())

    def on_train_end(self, trainer, module):
        super().on_train_end(trainer, module)
        record = {"world_size": trainer.world_size, "backend": dist.get_backend(), "positions": self.positions,
                  "strategy": type(trainer.strategy).__name__, "epochs": self.seen}
        with open(os.path.join(os.environ["RECORD_DIR"], f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(record, f)


train.Throughput = Recorded

if __name__ == "__main__":
    train.main()
'''


def test_train_stage_under_ddp_on_two_cpu_processes(compose_cfg, tmp_path):
    """trainer=ddp with 2 CPU processes: world size 2 over gloo, each rank trains on its half of every batch
    (disjoint, every position once an epoch), and the saved heads load and decode as the base model does."""
    from models.engine.decoding import generate
    from models.engine.trees import tree_from_config

    stage = ["heads=hydra", "profile=smoke", "profile.train.batch_positions=100", "profile.train.draft_vocab_size=64",
             "profile.train.max_length=96", "profile.train.epochs=2", "profile.train.max_epochs=2",
             "profile.train.progress_bar=false", "profile.train.num_threads=1",
             "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]
    cfg = compose_cfg(*stage)                  # where the stage will read the data (compose_cfg's paths)
    overrides = ["model=tiny_random", f"paths.artifacts={REPO_ROOT}/artifacts", f"paths.data={tmp_path / 'data'}",
                 f"paths.results={tmp_path / 'results'}", f"paths.reports={tmp_path / 'reports'}",
                 "mlflow.experiment=ddp", *stage]
    save_distilled(cfg.data.distilled_dir)
    script = tmp_path / "train_recorded.py"
    script.write_text(textwrap.dedent(RECORDING_SCRIPT))
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "RECORD_DIR": str(tmp_path),
           "MLFLOW_TRACKING_URI": f"file://{tmp_path / 'mlruns'}", "MLFLOW_ALLOW_FILE_STORE": "true"}
    done = subprocess.run([sys.executable, str(script), *overrides], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]

    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["world_size"], r["backend"], r["strategy"]) for r in records] == [(2, "gloo", "DDPStrategy")] * 2
    _, tok = build_tiny_model()
    ids, labels = examples(tok, 8, 0)
    windows = len(PositionWindows(HeadsDataset(ids, labels, [None] * 8), 4, tok.pad_token_id))  # Hydra: 4 heads
    for epoch in ("0", "1"):
        share0, share1 = records[0]["epochs"][epoch], records[1]["epochs"][epoch]
        assert not set(share0) & set(share1)                                   # disjoint
        assert sorted(share0 + share1) == list(range(windows))                 # every position once
        assert abs(len(share0) - len(share1)) <= 3                             # half each (3 batches of 100)
    assert records[0]["epochs"]["0"] != records[0]["epochs"]["1"]
    metrics = json.loads((tmp_path / "reports" / "metrics" / "train_hydra.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == {"fit": 2 * 3}
    assert records[0]["positions"] == records[1]["positions"] > 0              # summed over the ranks

    model, tok = build_tiny_model()
    model, heads = load_heads(tmp_path / "results" / "heads" / "hydra", model)
    assert heads.config.family == "hydra" and heads.config.draft_vocab_size == 64
    tree = tree_from_config({"kind": "paths", "top_k": 3, "paths": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]})
    prompt = tok("<|im_start|>user\nsay abc<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    want = generate(model, tok, prompt, max_new_tokens=24, stop_token_ids=[])
    got = generate(model, tok, prompt, heads_drafter(heads, tree), max_new_tokens=24, stop_token_ids=[])
    assert got.new_tokens == want.new_tokens


def test_fsdp_on_cpu_is_refused_by_lightning(compose_cfg):
    """Why trainer=fsdp stays a GPU config: Lightning refuses FSDP without a GPU (and on CPU it would hand
    torch's FSDP device_id=None, which torch refuses too). Fails once Lightning allows it: then test it here."""
    cfg = compose_cfg("trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2")
    with pytest.raises(ValueError, match="`fsdp` requires a GPU accelerator"):
        pl.Trainer(accelerator=cfg.trainer.accelerator, devices=cfg.trainer.devices, strategy=cfg.trainer.strategy,
                   logger=False)
