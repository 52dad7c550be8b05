"""One hidden cache for every train stage: built once with the union of the pipeline's taps, each stage loading
[final | its own taps] bit for bit as a cache of its own taps alone would hold them (tiny 8-layer random base, whose
EAGLE-3 taps are 2, 4, 5 and DFlash's and DSpark's 2, 6)."""
from __future__ import annotations

import pytest
import torch
from omegaconf import open_dict

import models.shared.hidden_cache as hc
from models.base import build_tiny_model
from models.shared.hidden_cache import HiddenCache, cache_key, column_runs
from tests.test_training import examples, one_thread, save_distilled  # noqa: F401  (one_thread: autouse)

UNION = (2, 4, 5, 6)          # eagle3 (2, 4, 5) | dflash, dspark (2, 6) on 8 layers


@pytest.fixture
def forwards(monkeypatch):
    """The number of batches the cache builder has run through the base so far."""
    calls = []
    real = hc.final_hidden
    monkeypatch.setattr(hc, "final_hidden", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def stamps(folder):
    return {p.name: p.stat().st_mtime_ns for p in folder.rglob("*.safetensors")}


def test_column_runs_pick_final_then_each_tap_in_the_order_asked():
    assert column_runs(UNION, ()) == [(0, 1)]
    assert column_runs(UNION, (2, 4, 5)) == [(0, 4)]                 # consecutive blocks: one slice
    assert column_runs(UNION, (6, 2)) == [(0, 1), (4, 5), (1, 2)]
    assert column_runs(UNION, (5, 5)) == [(0, 1), (3, 4), (3, 4)]
    with pytest.raises(ValueError, match=r"taps \[3\] are not in this cache"):
        column_runs(UNION, (2, 3))


def test_a_view_of_the_union_cache_equals_a_cache_of_its_own_taps(tmp_path, forwards):
    model, tok = build_tiny_model(num_layers=8)
    ids = [x[:n] for x, n in zip(examples(tok, 7)[0], (52, 9, 30, 31, 17, 44, 60))]
    h = model.config.hidden_size

    def build(folder, **kw):
        return HiddenCache.build(model, ids, tmp_path / folder, batch_tokens=100, shard_size=3, **kw)

    union = build("union", taps=UNION)
    assert union.flat.shape == (sum(map(len, ids)), 5 * h) and len(forwards) > 0
    built, written = len(forwards), stamps(tmp_path / "union")
    for own in ((), (2, 4, 5), (6, 2), (5, 5)):
        view = build("union", taps=UNION, load_taps=own)
        assert len(forwards) == built and stamps(tmp_path / "union") == written      # read back, nothing computed
        alone = build(f"alone{own}", taps=own)
        built = len(forwards)
        assert view.flat.shape == (sum(map(len, ids)), (1 + len(own)) * h) and view.offsets == alone.offsets
        assert torch.equal(view.flat, alone.flat), own
        assert not torch.equal(view.flat[:, :h], view.flat[:, -h:]) or not own       # real, distinct blocks
    with torch.no_grad():   # and they are the base's states, final then taps 6, 2 (batched: to float rounding)
        out = model.get_decoder()(input_ids=torch.tensor([ids[3]]), output_hidden_states=True)
    view = build("union", taps=UNION, load_taps=(6, 2))
    torch.testing.assert_close(view[3], torch.cat([out.last_hidden_state, out.hidden_states[6], out.hidden_states[2]],
                                                  -1)[0], rtol=1e-3, atol=1e-4)


def test_an_interrupted_union_build_resumes_at_its_missing_shard(tmp_path, forwards):
    model, tok = build_tiny_model(num_layers=8)
    ids = examples(tok, 7)[0]
    whole = HiddenCache.build(model, ids, tmp_path / "c", batch_tokens=10_000, shard_size=3, taps=UNION)
    assert len(forwards) == 3                               # 3 shards of one batch each
    (tmp_path / "c" / "shard-00001.safetensors").unlink()
    again = HiddenCache.build(model, ids, tmp_path / "c", batch_tokens=10_000, shard_size=3, taps=UNION,
                              load_taps=(4,))
    assert len(forwards) == 4                               # that shard alone
    h = model.config.hidden_size
    assert torch.equal(again.flat, torch.cat([whole.flat[:, :h], whole.flat[:, 2 * h:3 * h]], -1))
    assert cache_key(model, ids, taps=UNION) != cache_key(model, ids, taps=UNION[:-1])   # another union, another key


@pytest.fixture
def stage_of(compose_cfg):
    """stage_of(heads, *overrides) -> the train stage's config of that heads config on the 8-layer base."""
    from pipelines.common import apply_selection

    def make(heads, *overrides):
        cfg = apply_selection(compose_cfg("profile=smoke", f"+select.heads={heads}", "model.tiny.num_layers=8",
                                          "profile.train.max_length=96", *overrides))
        save_distilled(cfg.data.distilled_dir)
        return cfg
    return make


def own_cache(cfg, model, ids, root):
    """What the stage built before the union: a cache of its own taps alone, under its own key."""
    from models.methods import method

    taps = method(cfg.heads.family).family.taps(model.config, int(cfg.heads.num_layers))
    return HiddenCache.build(model, ids, root / cache_key(model, ids, taps=taps), taps=taps,
                             batch_tokens=int(cfg.profile.train.cache_batch_tokens))


def test_the_first_train_stage_builds_the_cache_every_other_stage_reads(stage_of, tmp_path, forwards):
    from pipelines.common import load_model
    from pipelines.train_inputs import hidden_caches, load_examples, pipeline_taps

    cfg = stage_of("eagle3")
    model, _ = load_model(cfg)
    data = load_examples(cfg)
    assert pipeline_taps(cfg, model.config) == UNION
    root = tmp_path / "results" / "cache" / "hidden"
    hidden, _ = hidden_caches(cfg, model, data)
    built, written = len(forwards), stamps(root)
    assert built > 0 and {p.parent.name for p in root.rglob("*.safetensors")} == {
        cache_key(model, ids, taps=UNION) for ids, _ in data.values()}
    h, alone = model.config.hidden_size, tmp_path / "alone"
    views = {"eagle3": hidden}
    for heads in ("dflash", "dspark", "medusa1"):
        views[heads], _ = hidden_caches(stage_of(heads), model, data)
        assert len(forwards) == built and stamps(root) == written, heads          # nothing rebuilt
    for heads, width in (("eagle3", 4), ("dflash", 3), ("dspark", 3), ("medusa1", 1)):
        for split, (ids, _) in data.items():
            ref = own_cache(stage_of(heads), model, ids, alone)
            assert views[heads][split].flat.shape[-1] == width * h
            assert torch.equal(views[heads][split].flat, ref.flat), (heads, split)


def test_a_stage_with_taps_outside_the_pipeline_still_gets_its_columns(stage_of, tmp_path, forwards):
    from pipelines.common import load_model
    from pipelines.train_inputs import hidden_caches, load_examples, pipeline_taps

    cfg = stage_of("dflash")
    with open_dict(cfg):
        cfg.heads.num_layers = 4                            # taps 2, 3, 5, 6: 3 is no pipeline family's
    model, _ = load_model(cfg)
    data = load_examples(cfg)
    assert pipeline_taps(cfg, model.config) == (2, 3, 4, 5, 6)
    hidden, _ = hidden_caches(cfg, model, data)
    for split, (ids, _) in data.items():
        assert torch.equal(hidden[split].flat, own_cache(cfg, model, ids, tmp_path / "alone").flat), split
    # a profile's override of a pipeline family's layers enters the union as its stage would run it
    wider = stage_of("medusa1", "+profile.train.heads_overrides.dflash.num_layers=4")
    assert pipeline_taps(wider, model.config) == (2, 3, 4, 5, 6)
    narrow = stage_of("eagle3", "pipeline_heads=[medusa1,hydra]")
    assert pipeline_taps(narrow, model.config) == (2, 4, 5)
