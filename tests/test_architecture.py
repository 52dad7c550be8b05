"""The library's shape: models/ imports no pipeline, Hydra, DVC or MLflow code, and its modules form no import
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
    banned = ("pipelines", "hydra", "omegaconf", "mlflow", "dvc")
    offenders = [f"{module_name(p)} imports {m}" for p in MODELS.rglob("*.py") for m in imports_of(p)
                 if m.split(".")[0] in banned]
    assert not offenders, offenders


def package_of(module: str) -> str:
    """models.engine.drafters.tree -> models.engine; models.base -> models.base (a module of models/ itself); a method's
    modules count as their method's package: models.methods.eagle.eagle3 -> models.methods.eagle (models.methods alone:
    the modules that import every method: models/methods/__init__.py and drafting.py)."""
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
    (models/shared: Medusa, Hydra, EAGLE, the draft model) reaches it by registering its proposer."""
    graph = package_graph()
    assert {"models.engine", "models.shared", "models.measure", "models.methods.eagle"} <= set(graph)
    assert find_cycle(graph) is None, f"import cycle between packages: {' -> '.join(find_cycle(graph))}"
    assert graph["models.engine"] <= {"models.base", "models.hardware"}, graph["models.engine"]


def test_each_method_is_a_package_that_no_shared_code_imports():
    """models/methods/<method>/ holds one method each. The engine and the shared base (models/shared) import no method
    package (the base finds the built-in methods by importing models.methods by name, on a lookup of a family, recipe
    kind or format not registered yet); a method imports the shared packages, never another method; every method is
    imported by models.methods (its families, recipes and formats; models/methods/drafting.py its proposer). Checked on
    the package graph above, every import counted."""
    graph = package_graph()
    methods = {p for p in graph if p.startswith("models.methods.")}
    assert {"models.methods.medusa", "models.methods.hydra", "models.methods.eagle", "models.methods.draft_model"} <= methods
    for shared in ("models.engine", "models.shared", "models.base", "models.hardware"):
        wrong = {p for p in graph.get(shared, set()) if p.startswith("models.methods")}
        assert not wrong, f"{shared} imports {sorted(wrong)}"
    for method in methods:
        wrong = {p for p in graph[method] if p.startswith("models.methods")}
        assert not wrong, f"{method} imports another method: {sorted(wrong)}"
    assert graph["models.methods"] == methods, graph["models.methods"]


def test_the_library_uses_no_relative_import():
    """Relative imports would slip past the checks above (they resolve only at run time)."""
    relative = [f"{module_name(p)}: from {'.' * n.level}{n.module or ''}" for p in MODELS.rglob("*.py")
                for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ImportFrom) and n.level > 0]
    assert not relative, relative


def compared_strings(tree: ast.AST) -> set[str]:
    """Every string constant in a comparison (==, !=, in, not in; tuples, lists and sets of them included)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for part in (node.left, *node.comparators):
                items = part.elts if isinstance(part, (ast.Tuple, ast.List, ast.Set)) else [part]
                out |= {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}
    return out


def test_no_method_name_is_tested_outside_its_own_package():
    """Shared code asks a method for a capability (a family's attribute, a module's method), never which method it
    is: no comparison with a family name or recipe kind in models/ or pipelines/ outside models/methods/."""
    import models.methods  # noqa: F401  (registers every family and recipe kind)
    from models.shared.families import FAMILIES
    from models.shared.recipes import RECIPE_TYPES

    names = set(FAMILIES) | set(RECIPE_TYPES)
    assert {"medusa", "hydra_pp", "eagle3", "draft_model", "medusa2"} <= names
    files = [p for folder in (MODELS, REPO_ROOT / "pipelines") for p in folder.rglob("*.py")
             if not p.is_relative_to(MODELS / "methods")]
    offenders = {str(p.relative_to(REPO_ROOT)): sorted(compared_strings(ast.parse(p.read_text())) & names)
                 for p in files}
    assert not {p: n for p, n in offenders.items() if n}


def test_the_name_check_sees_a_comparison():
    assert compared_strings(ast.parse('if family == "hydra_pp" or kind in ("eagle3", "x"): pass')) == \
        {"hydra_pp", "eagle3", "x"}
