"""pytest tests/test_trees.py: tree specs (validation, kinds) and the buffers built from them."""
import json

import pytest
import torch
import yaml

from models.engine.trees import TREE_KEYS, TreeBuffers, TreeSpec, chain_tree, dense_tree, tree_from_config
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
    spec = tree_from_config({"kind": "file", "file": str(f), "topk": 10})
    assert spec.name == "optimal" and spec.paths == ((0,), (1,), (0, 0))
    with pytest.raises(FileNotFoundError, match="pipelines.calibrate"):
        tree_from_config({"kind": "file", "file": str(tmp_path / "missing.json")})
    with pytest.raises(ValueError, match="kind 'bush'"):
        tree_from_config({"kind": "bush"})


def test_buffers_mask_depth_retrieve():
    spec = TreeSpec("t", [[1], [0], [0, 0], [0, 1], [1, 0], [0, 1, 0]], topk=4)
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


@pytest.mark.parametrize("paths, topk, message", [
    ([[0], [0, 1], [2, 0]], 10, r"node \[2, 0\] has no parent \[2\]"),
    ([[0], [1], [0]], 10, r"node \[0\] is listed twice"),
    ([[0], [0, 4]], 4, r"node \[0, 4\] has rank 4"),
    ([[0], []], 4, r"empty node path"),
])
def test_invalid_trees_name_the_node(paths, topk, message):
    with pytest.raises(ValueError, match=message):
        TreeSpec("bad", paths, topk)


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
