"""The library's shape: models/ imports no pipeline, analysis, Hydra, DVC or MLflow code, and its modules form no import
cycle (every import counts, those inside functions too)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MODELS = REPO_ROOT / "models"


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO_ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports (from-imports resolved to the submodule when the name is one)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{alias.name}" for alias in node.names}
    return out


def library_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in MODELS.rglob("*.py")}
    return {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_library_has_no_import_cycle():
    graph = library_graph()
    assert "models.engine.drafters.tree" in graph and graph["models.engine.decoding"]
    assert find_cycle(graph) is None, f"import cycle in models/: {' -> '.join(find_cycle(graph))}"


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_library_imports_no_pipeline_or_experiment_tool():
    banned = ("pipelines", "analysis", "hydra", "omegaconf", "mlflow", "dvc")
    offenders = [f"{module_name(p)} imports {m}" for p in MODELS.rglob("*.py") for m in imports_of(p)
                 if m.split(".")[0] in banned]
    assert not offenders, offenders


def package_of(module: str) -> str:
    """models.engine.drafters.tree -> models.engine; models.base -> models.base (a module of models/ itself); a method's
    modules count as their method's package: models.methods.eagle.eagle3 -> models.methods.eagle (models.methods alone:
    the explicit list, models/methods/__init__.py, which imports every method)."""
    parts = module.split(".")
    if parts[:2] == ["models", "methods"] and len(parts) > 2 and (MODELS / "methods" / parts[2]).is_dir():
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def package_graph() -> dict[str, set[str]]:
    """The library's subpackages (models.engine, models.shared, models.measure, models.methods.<method>, ...) and which
    import which: an edge for every import of one module by another across two subpackages."""
    graph: dict[str, set[str]] = {}
    for module, imported in library_graph().items():
        graph.setdefault(package_of(module), set()).update(
            package_of(m) for m in imported if package_of(m) != package_of(module))
    return graph


def test_the_libraries_packages_form_no_cycle_and_the_engine_imports_no_method():
    """Package level, not module level: models.shared importing the engine while one engine module imports
    models.shared is a cycle between the packages even where no two modules import each other. The engine
    (models/engine) imports only itself and the library's base modules (models.base, models.hardware): a method
    (models/methods: Medusa, Hydra, EAGLE, the draft model, DFlash) reaches it through the heads it builds, which
    carry their Method, whose proposer factory the engine calls (drafters/proposer.py proposer_for)."""
    graph = package_graph()
    assert {"models.engine", "models.shared", "models.measure", "models.methods.eagle"} <= set(graph)
    assert find_cycle(graph) is None, f"import cycle between packages: {' -> '.join(find_cycle(graph))}"
    assert graph["models.engine"] <= {"models.base", "models.hardware"}, graph["models.engine"]


def test_each_method_is_a_package_that_no_shared_code_imports():
    """models/methods/<method>/ holds one method each. The engine and the shared base (models/shared) import no method
    package; a method imports the shared packages, never another method; models/methods/__init__.py, the explicit
    list, imports every method. Checked on the package graph above, every import counted."""
    graph = package_graph()
    methods = {p for p in graph if p.startswith("models.methods.")}
    assert {"models.methods.medusa", "models.methods.hydra", "models.methods.eagle", "models.methods.draft_model"} <= methods
    for shared in ("models.engine", "models.shared", "models.base", "models.hardware"):
        wrong = {p for p in graph.get(shared, set()) if p.startswith("models.methods")}
        assert not wrong, f"{shared} imports {sorted(wrong)}"
    for method in methods:
        wrong = {p for p in graph[method] if p.startswith("models.methods")}
        assert not wrong, f"{method} imports another method: {sorted(wrong)}"
    assert methods <= graph["models.methods"], methods - graph["models.methods"]


def method_names() -> set[str]:
    """Every method's name and recipe kind, read from the explicit list."""
    from models.methods import METHODS

    return {m.name for m in METHODS} | {r.kind for m in METHODS for r in m.recipes}


# Drivers of one method's outside code, which name that method by design (each says why); every other file of
# pipelines/ and models/ reaches a method through models.methods only.
METHOD_DRIVERS = {
    "pipelines/conformance.py": "drives the authors' Medusa code against ours",
    "pipelines/conformance_eagle.py": "drives the authors' EAGLE-1 code against ours",
    "pipelines/interop.py": "drives the speculators library and vLLM with our EAGLE-3 export",
    "pipelines/dflash_check.py": "drives the authors' DFlash package with our DFlash export",
    "pipelines/bench/joint.py": "measures Medusa-2's joint stage",
    "pipelines/bench/scaling.py": "its default: the heads configs whose data scaling it compares",
    "pipelines/tables.py": "the papers' tables, named after the papers (medusa, hydra, eagle)",
}


def code_files() -> list[Path]:
    """models/ and pipelines/ outside the methods' packages and their list (models/methods/)."""
    return [p for folder in (MODELS, REPO_ROOT / "pipelines") for p in folder.rglob("*.py")
            if not p.is_relative_to(MODELS / "methods")]


def named_strings(tree: ast.AST) -> set[str]:
    """Every string constant that is not a docstring."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs}


def test_no_method_is_named_outside_its_package_and_the_list():
    """No file of models/ or pipelines/ outside models/methods/ names a method (its family name or a recipe kind, as a
    string anywhere but a docstring) or imports a method's module: shared code asks the Method it is handed (or looks
    one up in models.methods) for a capability, never which method it is. The drivers of one method's outside code
    are the listed exceptions."""
    names = method_names()
    assert {"medusa", "hydra_pp", "eagle3", "draft_model", "medusa2"} <= names
    offenders = {}
    for p in code_files():
        rel = str(p.relative_to(REPO_ROOT))
        if rel in METHOD_DRIVERS:
            continue
        tree = ast.parse(p.read_text())
        named = sorted(named_strings(tree) & names)
        imported = sorted(m for m in imports_of(p) if m.startswith("models.methods.") and m.count(".") >= 2
                          and (MODELS / "methods" / m.split(".")[2]).is_dir())
        if named or imported:
            offenders[rel] = named + imported
    assert not offenders, offenders
    assert set(METHOD_DRIVERS) <= {str(p.relative_to(REPO_ROOT)) for p in code_files()}   # no stale exception


def test_the_name_check_sees_a_name_and_skips_docstrings():
    tree = ast.parse('"""hydra_pp"""\ndef f():\n    """eagle3"""\n    return {"family": "hydra", "x": 1}')
    assert named_strings(tree) & {"hydra_pp", "eagle3", "hydra"} == {"hydra"}


def registry_like(module) -> dict[str, object]:
    """A module's own containers at its top level, by name: a mutable one's (dicts, lists, sets) size, a tuple's
    identity and size (so that rebinding a frozen list, `methods.METHODS = (*METHODS, NEW)`, shows as a change)."""
    return {name: len(v) if isinstance(v, (dict, list, set)) else (id(v), len(v)) for name, v in vars(module).items()
            if isinstance(v, (dict, list, set, tuple)) and not name.startswith("__")}


def test_no_registry_is_filled_at_import_time():
    """Importing a module runs its own body only: it fills no container another module owns (a registry filled by
    import side effects, as `@register_x` decorators do) and defines no register function. Every module of models/ and
    pipelines/ is imported in dependency order, each after everything it imports, and every earlier module's
    top-level containers are compared before and after: a change is a registration."""
    import json
    import subprocess
    import sys

    registering = [f"{module_name(p)}.{n.name}" for folder in (MODELS, REPO_ROOT / "pipelines", REPO_ROOT / "analysis")
                   for p in folder.rglob("*.py") for n in ast.walk(ast.parse(p.read_text()))
                   if isinstance(n, ast.FunctionDef) and n.name.startswith("register")]
    assert not registering, registering
    script = f"""
import importlib, json, sys
sys.path.insert(0, {str(REPO_ROOT)!r})
from tests.test_architecture import dependency_order, registry_like
seen, changed = {{}}, []
for name in dependency_order():
    module = importlib.import_module(name)
    for other, sizes in seen.items():
        now = registry_like(sys.modules[other])
        changed += [f"importing {{name}} changed {{other}}.{{k}}" for k, n in sizes.items() if now.get(k) != n]
    seen[name] = registry_like(module)
print(json.dumps(changed))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def dependency_order() -> list[str]:
    """Every module of models/ and pipelines/, each after the modules of ours it imports (package __init__s first:
    importing a.b runs a/__init__.py)."""
    modules = {module_name(p): p for folder in (MODELS, REPO_ROOT / "pipelines", REPO_ROOT / "analysis")
               for p in folder.rglob("*.py")}
    deps = {}
    for name, path in modules.items():
        parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        deps[name] = {m for m in imports_of(path) | parents if m in modules and m != name}
    order, done = [], set()

    def visit(name, stack=()):
        if name in done or name in stack:
            return
        for dep in sorted(deps[name]):
            visit(dep, (*stack, name))
        done.add(name)
        order.append(name)

    for name in sorted(modules):
        visit(name)
    return order


def owner_seen_changing(tmp_path, owner: str, other: str) -> tuple[object, bool]:
    """Module reg_a (source `owner`) imported, then reg_b (source `other`): (reg_a, whether the check saw reg_a's
    containers change). Both are dropped from sys.modules by the caller's cleanup (forget_modules)."""
    import importlib
    import sys

    (tmp_path / "reg_a.py").write_text(owner)
    (tmp_path / "reg_b.py").write_text(other)
    sys.path.insert(0, str(tmp_path))
    try:
        reg_a = importlib.import_module("reg_a")
        before = registry_like(reg_a)
        importlib.import_module("reg_b")
        return reg_a, registry_like(reg_a) != before
    finally:
        sys.path.remove(str(tmp_path))


def forget_modules():
    import sys

    for name in ("reg_a", "reg_b"):
        sys.modules.pop(name, None)


def test_the_registry_check_sees_a_registration(tmp_path):
    """The check's comparison catches a module whose import fills another's container."""
    try:
        assert owner_seen_changing(tmp_path, "KINDS = {}\n", "import reg_a\nreg_a.KINDS['b'] = 1\n")[1]
    finally:
        forget_modules()


def test_the_registry_check_sees_a_rebound_tuple(tmp_path):
    """Rebinding another module's tuple (a method appended to METHODS from outside) is a registration too."""
    try:
        reg_a, changed = owner_seen_changing(tmp_path, "METHODS = ('a',)\n",
                                             "import reg_a\nreg_a.METHODS = (*reg_a.METHODS, 'd')\n")
        assert changed
        before = registry_like(reg_a)
        reg_a.METHODS = tuple(list(reg_a.METHODS))                     # a new tuple of the same size
        assert registry_like(reg_a) != before
    finally:
        forget_modules()


def test_every_method_package_is_listed_and_every_listed_method_has_a_config():
    """Every package under models/methods/ declares a Method of METHODS, every Method's family comes from the
    package it is listed for, and every Method has a conf/heads option naming its family: a method added without
    its entry, or an entry without its package or config, fails here."""
    import yaml

    from models.methods import METHODS

    packages = {p.name for p in (MODELS / "methods").iterdir() if (p / "__init__.py").is_file()}
    listed = {type(m.family).__module__.split(".")[2] for m in METHODS}
    assert packages == listed, (packages, listed)
    assert len({m.name for m in METHODS}) == len(METHODS)
    configs = {yaml.safe_load(p.read_text()).get("family") for p in (REPO_ROOT / "conf" / "heads").glob("*.yaml")}
    assert {m.name for m in METHODS} <= configs, {m.name for m in METHODS} - configs


def test_the_library_uses_no_relative_import():
    """Relative imports would slip past the checks above (they resolve only at run time)."""
    relative = [f"{module_name(p)}: from {'.' * n.level}{n.module or ''}" for p in MODELS.rglob("*.py")
                for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ImportFrom) and n.level > 0]
    assert not relative, relative


def test_analysis_uses_the_interval_statistics_alone():
    """analysis/ turns results files into tables: of models/ it imports the interval statistics only, of pipelines/
    nothing (its package docstring says so)."""
    imported = {".".join(m.split(".")[:3]) for p in (REPO_ROOT / "analysis").rglob("*.py") for m in imports_of(p)
                if m.split(".")[0] in ("models", "pipelines")}
    assert imported == {"models.measure.intervals"}, imported
