"""Rules the code keeps: one decode step, and no module reaching into another's underscored names."""
from __future__ import annotations

import ast
import re

from pipelines.common import REPO_ROOT

PACKAGES = ("models", "pipelines", "analysis")
# Third-party internals used on purpose (models/engine/fast_inference.py, projection.py: oneDNN prepacking, and
# a tensor's in-place version counter to notice changed weights); nothing of ours.
THIRD_PARTY = {"torch._C", "torch._C._nn", "torch.ops.mkldnn._linear_pointwise",
               "torch.ops.mkldnn._reorder_linear_weight", "w._version"}


def sources():
    for pkg in PACKAGES:
        yield from sorted((REPO_ROOT / pkg).rglob("*.py"))


def test_no_module_touches_another_modules_underscored_names():
    found = []
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                if ast.unparse(node) not in THIRD_PARTY:
                    found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.ImportFrom):          # `from x import _name` reaches in as well as x._name does
                found += [f"{path.relative_to(REPO_ROOT)}:{node.lineno}: from {node.module} import {a.name}"
                          for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == []


def test_only_the_decode_step_verifies_and_prunes():
    """One step for every batch size: keep_accepted and the step's verify are called in models/engine/step.py's
    step, verify_tree (the verify by hand, for tests and benches) only in decoding.py on top of it, and nothing
    else in the library verifies a tree or prunes the cache: generate and generate_batch are two doors to step."""
    calls = []
    for path in sources():
        tree = ast.parse(path.read_text())
        own = path.name == "step.py" or any(isinstance(n, ast.ImportFrom) and n.module == "models.engine.step"
                                            for n in ast.walk(tree))     # step and verify: the step module's
        names = {"verify_tree", "keep_accepted", "step_verify"} | ({"verify", "step"} if own else set())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func).split(".")[-1]
                if name in names and (name not in ("verify", "step") or isinstance(node.func, ast.Name)):
                    calls.append((str(path.relative_to(REPO_ROOT)), name))
    assert sorted(calls) == [("models/engine/batch.py", "step"), ("models/engine/decoding.py", "step"),
                             ("models/engine/decoding.py", "step_verify"), ("models/engine/step.py", "keep_accepted"),
                             ("models/engine/step.py", "verify")]
    text = (REPO_ROOT / "models/engine/step.py").read_text()
    body = text[text.index("def step("):]
    assert re.search(r"\bverify\(", body) and re.search(r"\bkeep_accepted\(", body)


MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60


def test_files_and_functions_stay_small():
    """No file of models/, pipelines/ or analysis/ over 400 lines, no function (or method) over 60: a longer one is
    a module or a function that does two things."""
    long_files, long_functions = [], []
    for path in sources():
        text = path.read_text()
        rel = path.relative_to(REPO_ROOT)
        if text.count("\n") > MAX_FILE_LINES:
            long_files.append(f"{rel}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{rel}:{node.lineno} {node.name}: {length} lines")
    assert long_files == [] and long_functions == []
