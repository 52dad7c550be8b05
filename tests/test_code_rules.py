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


THIRD_PARTY_NAMES = {"_attn_implementation", "_linear_pointwise"}   # transformers' config, torch.ops.mkldnn's


def sources(packages=PACKAGES):
    for pkg in packages:
        yield from sorted((REPO_ROOT / pkg).rglob("*.py"))


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def reaches_in(tree: ast.AST, rel: str, library_only: bool = False):
    """Every way `tree` reaches another module's underscored name: x._name (not self's or cls's), from x import
    _name, a private module in an import's path (a._b, from ._b), getattr/hasattr/setattr(obj, "_name").
    library_only: only what it reaches of our own packages (a test's imports of pytest or torch are theirs)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) \
                    and ast.unparse(node) not in THIRD_PARTY and not library_only:
                yield f"{rel}:{node.lineno}: {ast.unparse(node)}"
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if library_only and node.level == 0 and not module.startswith(PACKAGES):
                continue
            if any(map(private, module.split("."))):
                yield f"{rel}:{node.lineno}: from {'.' * node.level}{module}"
            yield from (f"{rel}:{node.lineno}: from {module} import {a.name}" for a in node.names if private(a.name))
        elif isinstance(node, ast.Import):
            yield from (f"{rel}:{node.lineno}: import {a.name}" for a in node.names
                        if any(map(private, a.name.split("."))) and not a.name.startswith("torch."))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and private(node.args[1].value) and node.args[1].value not in THIRD_PARTY_NAMES
              and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))):
            yield f"{rel}:{node.lineno}: {ast.unparse(node)}"


def test_no_module_touches_another_modules_underscored_names():
    """The library's modules and the tests alike (a test reaches the library through its public names only)."""
    found = []
    for path in sources():
        found += reaches_in(ast.parse(path.read_text()), str(path.relative_to(REPO_ROOT)))
    for path in sources(("tests",)):
        found += reaches_in(ast.parse(path.read_text()), str(path.relative_to(REPO_ROOT)), library_only=True)
    assert found == []


def test_the_private_name_rule_sees_every_way_in():
    snippet = """
import models._hidden
from models.engine._kernels import run
from ._sibling import helper
from models.engine.decoding import _as_ids
x = state._rows
y = getattr(state, "_rows")
hasattr(obj, "_cache")
ok = self._own, getattr(self, "_own"), getattr(config, "_attn_implementation")
"""
    found = sorted(reaches_in(ast.parse(snippet), "s.py"), key=lambda f: int(f.split(":")[1]))
    assert [f.split(": ", 1)[1] for f in found] == [
        "import models._hidden", "from models.engine._kernels", "from ._sibling",
        "from models.engine.decoding import _as_ids", "state._rows", "getattr(state, '_rows')",
        "hasattr(obj, '_cache')"]


def test_only_the_decode_step_verifies_and_prunes():
    """One step for every batch size: keep_accepted and the step's verify are called in models/engine/step.py's
    step, verify_rows and verify_tree (the verify by hand: tests, benches, the batched latency profile) only in
    decoding.py on top of it (verify_rows also in models/measure/latency.py, which times it), and nothing
    else in the library verifies a tree or prunes the cache: decoding's loop (decode_rows, which generate and
    generate_batch both enter) and decode_step (the step by hand) are its only callers."""
    calls = []
    for path in sources():
        tree = ast.parse(path.read_text())
        own = path.name == "step.py" or any(isinstance(n, ast.ImportFrom) and n.module == "models.engine.step"
                                            for n in ast.walk(tree))     # step and verify: the step module's
        names = {"verify_tree", "verify_rows", "keep_accepted", "step_verify"} | ({"verify", "step"} if own else set())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func).split(".")[-1]
                if name in names and (name not in ("verify", "step") or isinstance(node.func, ast.Name)):
                    calls.append((str(path.relative_to(REPO_ROOT)), name))
    assert sorted(calls) == [("models/engine/decoding.py", "step"), ("models/engine/decoding.py", "step"),
                             ("models/engine/decoding.py", "step_verify"), ("models/engine/decoding.py", "verify_rows"),
                             ("models/engine/step.py", "keep_accepted"), ("models/engine/step.py", "verify"),
                             ("models/measure/latency.py", "verify_rows")]
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
