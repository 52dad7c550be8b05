"""python -m pipelines.deps [--check]

The code files each DVC stage runs: the import closure of its `python -m pipelines.<stage>` module
over this repository's packages (models/, pipelines/, analysis/), read from the source (imports
inside functions count too). `--check` compares it with dvc.yaml and exits 1 naming every stage
that runs a file it does not depend on (a folder dep covers the files under it), and every code folder dep that
holds a file its stage does not run (a folder dep is allowed where the stage runs all of it: a change to any other
file would rerun the stage for nothing); without it, prints each stage's closure for pasting into dvc.yaml.
Every method's package is in every chain's closure (models/methods/__init__.py imports them all, so that a family
named in a config is found), so the stages of one method's chain depend on the same code as another's.
"""
from __future__ import annotations

import ast
import hashlib
import re
import sys
from functools import lru_cache
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("models", "pipelines", "analysis")
STAGE_MODULE = re.compile(r"python -m (pipelines\.\w+)")


def module_file(name: str, root: Path = REPO_ROOT) -> Path | None:
    """models.shared -> models/shared/__init__.py or models/shared/__init__.py (None: not one of ours)."""
    if name.split(".")[0] not in PACKAGES:
        return None
    base = root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported_modules(path: Path, root: Path = REPO_ROOT) -> set[str]:
    """Dotted names of the modules `path` imports (for `from a import b`: a, and a.b when b is a module)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    package = parts[:-1]                                     # the package the file is in (for __init__: itself)
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join([*base, *([node.module] if node.module else [])])
            out.add(mod)
            out.update(f"{mod}.{alias.name}" for alias in node.names)
    return out


@lru_cache(maxsize=None)
def import_closure(module: str, root: Path = REPO_ROOT) -> tuple[str, ...]:
    """Repository-relative paths of every file of ours that `module` imports, directly or not, itself included
    (with the __init__.py of every package on the way)."""
    seen: set[Path] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):                   # a.b.c imports a/__init__, a/b/__init__ too
            path = module_file(".".join(parts[:i]), root)
            if path is None or path in seen:
                continue
            seen.add(path)
            todo.extend(imported_modules(path, root))
    return tuple(sorted(str(p.relative_to(root)) for p in seen))


@lru_cache(maxsize=None)
def code_digest(module: str) -> str:
    """sha256 (16 hex digits) of the code `module` runs: its import closure (a stage's DVC code deps), each file
    with its relative name. Once per process: the code a process runs is what it imported, not what is on disk
    later."""
    h = hashlib.sha256()
    for rel in import_closure(module):
        h.update(rel.encode() + b"\0" + (REPO_ROOT / rel).read_bytes())
    return h.hexdigest()[:16]


def stage_modules(dvc_yaml: Path) -> dict[str, tuple[str, list[str]]]:
    """{stage: (module its cmd runs, declared deps)} of dvc.yaml (foreach stages once, by their template)."""
    stages = yaml.safe_load(dvc_yaml.read_text())["stages"]
    out = {}
    for name, stage in stages.items():
        body = stage.get("do", stage)
        match = STAGE_MODULE.search(str(body.get("cmd", "")))
        if match:
            out[name] = (match.group(1), [str(d) if not isinstance(d, dict) else next(iter(d)) for d in body.get("deps", [])])
    return out


def missing_deps(dvc_yaml: Path = REPO_ROOT / "dvc.yaml", root: Path = REPO_ROOT) -> dict[str, list[str]]:
    """{stage: code files it runs but does not depend on} (empty when every stage is complete)."""
    out = {}
    for name, (module, deps) in stage_modules(dvc_yaml).items():
        folders = [d.rstrip("/") + "/" for d in deps]
        missing = [f for f in import_closure(module, root) if f not in deps and not any(f.startswith(d) for d in folders)]
        if missing:
            out[name] = missing
    return out


def broad_deps(dvc_yaml: Path = REPO_ROOT / "dvc.yaml", root: Path = REPO_ROOT) -> dict[str, list[str]]:
    """{stage: code files under one of its folder deps that it does not run} (empty when every folder dep is exact)."""
    out = {}
    for name, (module, deps) in stage_modules(dvc_yaml).items():
        closure = set(import_closure(module, root))
        folders = [d.rstrip("/") for d in deps if d.split("/")[0] in PACKAGES and (root / d).is_dir()]
        extra = sorted(str(f.relative_to(root)) for d in folders for f in (root / d).rglob("*.py")
                       if "__pycache__" not in f.parts and str(f.relative_to(root)) not in closure)
        if extra:
            out[name] = extra
    return out


def main(argv: list[str]) -> int:
    if "--check" in argv:
        missing, broad = missing_deps(), broad_deps()
        for name, files in missing.items():
            print(f"stage {name}: runs {', '.join(files)} without depending on them (dvc.yaml)")
        for name, files in broad.items():
            print(f"stage {name}: a folder dep holds {', '.join(files)}, which it does not run (list its files instead)")
        return 1 if missing or broad else 0
    for name, (module, _) in stage_modules(REPO_ROOT / "dvc.yaml").items():
        print(f"{name} ({module}):")
        print("\n".join(f"  - {f}" for f in import_closure(module)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
