"""pytest tests/test_trees.py: tree specs (validation, kinds) and the buffers built from them."""
import json

import pytest
import torch
import yaml

from models.engine.trees import (TREE_KEYS, TreeBuffers, TreeSpec, chain_tree, dense_tree, tree_from_config,
                                 tree_option)
from pipelines.common import REPO_ROOT


def conf_tree(name):
    return tree_from_config(yaml.safe_load((REPO_ROOT / "conf" / "tree" / f"{name}.yaml").read_text()))


def test_sparse64_shape():
    spec = conf_tree("sparse64")
    buf = TreeBuffers.build(spec)
    assert spec.num_nodes == 63 and buf.num_tokens == 64 and spec.depth == 4
    assert [lvl.nodes.numel() for lvl in buf.levels] == [10, 28, 23, 2]
    assert buf.retrieve.shape == (42, 5)                    # 42 root-to-leaf paths
    assert TreeBuffers.build(spec) is buf                   # built once per tree


def test_chain_and_dense_kinds():
    chain = conf_tree("chain4")
    assert chain.paths == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))
    dense = conf_tree("dense")                              # k=2, depth=3
    assert dense.num_nodes == 2 + 4 + 8 and dense.depth == 3
    assert set(dense.paths) == set(dense_tree(2, 3).paths)


def test_file_kind(tmp_path):
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"name": "optimal", "paths": [[0], [1], [0, 0]]}))
    spec = tree_from_config({"kind": "file", "file": str(f), "top_k": 10})
    assert spec.name == "optimal" and spec.paths == ((0,), (1,), (0, 0))
    with pytest.raises(FileNotFoundError, match="pipelines.calibrate"):
        tree_from_config({"kind": "file", "file": str(tmp_path / "missing.json")})
    with pytest.raises(ValueError, match="kind 'bush'"):
        tree_from_config({"kind": "bush"})


def test_buffers_mask_depth_retrieve():
    spec = TreeSpec("t", [[1], [0], [0, 0], [0, 1], [1, 0], [0, 1, 0]], top_k=4)
    buf = TreeBuffers.build(spec)
    nodes = [()] + sorted(spec.paths, key=lambda p: (len(p), p))
    mask = buf.tree_mask[0, 0]
    for i, p in enumerate(nodes):
        visible = {nodes[j] for j in range(len(nodes)) if mask[i, j]}
        assert visible == {p[:d] for d in range(len(p) + 1)}    # itself and its ancestors, root included
        assert buf.depth[i] == len(p)
        assert buf.parent[i] == (nodes.index(p[:-1]) if p else -1)
    paths = {tuple(nodes[j] for j in row if j >= 0) for row in buf.retrieve.tolist()}
    leaves = [p for p in nodes if not any(q[:-1] == p for q in nodes[1:])]
    assert paths == {tuple(leaf[:d] for d in range(len(leaf) + 1)) for leaf in leaves}
    assert [nodes[c][-1] for c in buf.children[0]] == [0, 1]     # children in rank order
    lvl2 = buf.levels[1]
    assert nodes[lvl2.parents.tolist()[0]] == (0,) and lvl2.parent_paths.shape == (2, 2)
    add = buf.additive_mask(torch.float32)
    assert (add == 0).equal(buf.tree_mask) and add.min() == torch.finfo(torch.float32).min


@pytest.mark.parametrize("paths, top_k, message", [
    ([[0], [0, 1], [2, 0]], 10, r"node \[2, 0\] has no parent \[2\]"),
    ([[0], [1], [0]], 10, r"node \[0\] is listed twice"),
    ([[0], [0, 4]], 4, r"node \[0, 4\] has rank 4"),
    ([[0], []], 4, r"empty node path"),
])
def test_invalid_trees_name_the_node(paths, top_k, message):
    with pytest.raises(ValueError, match=message):
        TreeSpec("bad", paths, top_k)


def test_tree_deeper_than_heads_names_the_node():
    with pytest.raises(ValueError, match=r"node \[0, 0, 0\] has depth 3 but the heads have only 2"):
        chain_tree(3).check_heads(2)
    conf_tree("sparse64").check_heads(4)


def test_truncated_tree():
    spec = conf_tree("sparse64").truncated(2)
    assert spec.depth == 2 and spec.num_nodes == 38
    assert chain_tree(4).truncated(0).num_nodes == 0


@pytest.mark.parametrize("old, new", [("dynamic", "cut"), ("dynamic_pld", "cut_pld")])
def test_the_old_names_of_the_cut_trees_say_their_new_names(old, new):
    """tree=dynamic and dynamic_pld were fixed trees cut per step: renamed, so that "dynamic" means grown per step
    only; the old names stop with the new one, from the conf file and from an evaluation's tree list alike."""
    from omegaconf import OmegaConf

    from pipelines.methods import resolve_tree, tree_config

    with pytest.raises(ValueError, match=rf"tree={old} was renamed tree={new} \(a fixed tree cut per step"):
        conf_tree(old)
    cfg = OmegaConf.create({"paths": {"results": "results"}, "heads": {"name": "hydra"}})
    with pytest.raises(ValueError, match=rf"tree={old} was renamed tree={new}"):
        resolve_tree(cfg, tree_config(cfg, old, "hydra"), old)
    assert yaml.safe_load((REPO_ROOT / "conf" / "tree" / f"{new}.yaml").read_text())["name"] == new


def test_a_misspelt_tree_key_is_refused_naming_it():
    """Without the check, `dpeth: 3` would be dropped and the tree built from whatever else it was given."""
    with pytest.raises(ValueError, match=r"tree 'c': unknown keys \['dpeth'\]; a tree option takes \["):
        tree_from_config({"kind": "chain", "name": "c", "dpeth": 3, "depth": 3})
    for path in sorted((REPO_ROOT / "conf" / "tree").glob("*.yaml")):     # every shipped option passes the check
        keys = set(yaml.safe_load(path.read_text()))
        assert keys <= TREE_KEYS, path.name


# -- the tree option: every key parsed once ------------------------------------------------------------------------

def test_a_tree_key_of_another_kind_is_refused_naming_it_and_the_kinds_own():
    """`paths` on a chain would be dropped: the chain would be built from its depth alone."""
    with pytest.raises(ValueError, match=r"tree 'c': kind chain does not take \['paths'\]; it takes \['depth'\]"):
        tree_option({"kind": "chain", "name": "c", "depth": 3, "paths": [[0]]})
    with pytest.raises(ValueError, match=r"tree 'd': kind dense needs \['k'\]"):
        tree_option({"kind": "dense", "name": "d", "depth": 3})
    with pytest.raises(ValueError, match=r"tree 'c': lookup='yes'; it must be true or false"):
        tree_option({"kind": "chain", "name": "c", "depth": 3, "lookup": "yes"})
    with pytest.raises(ValueError, match=r"tree 'c': depth=2.5; it must be a whole number"):
        tree_option({"kind": "chain", "name": "c", "depth": 2.5})


def test_the_old_spelling_topk_is_refused_with_the_new_name(tmp_path):
    """The rank count is top_k in every tree: an option or a calibrated file written as `topk` says so, rather than
    being read with the default of 10."""
    with pytest.raises(ValueError, match=r"tree 'p': key 'topk' is now spelt 'top_k'"):
        tree_option({"kind": "paths", "name": "p", "topk": 3, "paths": [[0], [1]]})
    old = tmp_path / "optimal_tree.json"
    old.write_text(json.dumps({"name": "optimal", "paths": [[0], [1]], "topk": 10}))
    option = tree_option({"kind": "file", "name": "optimal", "file": str(old)})       # parsed: the file is read later
    with pytest.raises(ValueError, match=rf"tree file {old}: key 'topk' is now spelt 'top_k'.*dvc repro calibrate"):
        option.tree


def test_an_option_holds_its_tree_cut_and_lookup_and_names_a_cut_or_merged_tree_after_itself(tmp_path):
    """The calibrated file's name is kept where the tree is used as it is; a tree cut per step or joined by prompt
    lookup is the option's (its records and question limits are keyed by the option)."""
    f = tmp_path / "budget_16.json"
    f.write_text(json.dumps({"name": "hydra_budget16", "paths": [[0], [1], [0, 0]], "top_k": 4}))
    plain = tree_option({"kind": "file", "name": "optimal", "file": str(f)})
    assert plain.tree == TreeSpec("hydra_budget16", ((0,), (1,), (0, 0)), 4) and plain.step_cost is None
    cut = tree_option({"kind": "file", "name": "cut", "file": str(f), "cut_by_cost": "latency.json", "lookup": True})
    assert (cut.tree.name, cut.tree.top_k, cut.cut_by_cost, cut.lookup) == ("cut", 4, "latency.json", True)
    assert cut.with_step_cost([1, 1.5]).step_cost == (1.0, 1.5) and cut.with_step_cost(None).step_cost is None


def test_the_evaluation_entry_reads_its_tree_cut_and_lookup_from_its_option(compose_cfg, tmp_path):
    """Contender's tree, step_cost and lookup are its option's; heads_spec builds the drafter spec from it alone."""
    from pipelines.methods import Contender, Kind, heads_spec

    cfg = compose_cfg()
    option = tree_option({"kind": "chain", "name": "c", "depth": 3, "lookup": True}).with_step_cost([1.0, 1.2])
    entry = Contender("hydra-c", Kind.HEADS, None, option=option)
    assert (entry.tree, entry.step_cost, entry.lookup) == (chain_tree(3, name="c"), [1.0, 1.2], True)
    spec = heads_spec(cfg, option)
    assert (spec["kind"], spec["tree"], spec["step_cost"]) == ("heads_lookup", entry.tree, [1.0, 1.2])
    assert spec["lookup"]["num_tokens"] == int(cfg.eval.prompt_lookup.pld.num_tokens)
    plain = Contender("baseline", Kind.BASELINE, None)
    assert (plain.tree, plain.step_cost, plain.lookup) == (None, None, False)
    assert heads_spec(cfg, tree_option({"kind": "chain", "name": "c", "depth": 3}))["kind"] == "heads"
