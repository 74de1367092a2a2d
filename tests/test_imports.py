"""The direction of imports inside the package (DESIGN.md, "Owners"): shared modules at the
bottom, stages in the middle, the command line and the Snakefile's helpers on top.

- a shared module (contracts, guards, keys, launch_flags, settings, model, redaction) imports no
  stage and nothing above it;
- a stage imports no top module and no other module's private (underscore) names;
- nothing but the entry point imports `tokenmill.cli`;
- a stage imports only the stages before it in the pipeline's order (STAGE_ORDER), and no two
  packages import each other, directly or through others;
- no two modules import each other, directly or through others (function-level imports count).

Read from the source with `ast`: nothing is imported, so the test costs milliseconds and a
failing import of one module cannot hide another's violation.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "workflow" / "tokenmill"

SHARED = {"contracts", "guards", "keys", "launch_flags", "layout", "settings", "model", "redaction",
          "prefix_reuse",
          "engines", "jobs"}  # fmt: skip
STAGES = {"prepare", "tokenization", "generate", "dataset", "provenance", "hidden_states"}
TOP = {"cli", "config", "plan", "retire", "run_summary", "status", "workflow_support", "__main__"}
# The stages in the pipeline's order: a stage may import those before it, never one after it.
STAGE_ORDER = ("prepare", "tokenization", "generate", "dataset", "hidden_states", "provenance")
assert set(STAGE_ORDER) == STAGES
TOOLING = {"testing"}  # demo and test tooling: may use anything, nothing in production uses it


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The package module an imported dotted name belongs to (a module or its attribute)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every tokenmill import in a module,
    function-level ones included."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "tokenmill":
                    out.append((_resolve(alias.name), None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "tokenmill":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in MODULES:  # `from tokenmill.generate import journal`
                    out.append((sub, None, node.lineno))
                else:
                    out.append((_resolve(base), alias.name, node.lineno))
    return [(m, n, line) for m, n, line in out if m is not None and m != module]


def _private_attributes(module: str) -> list[tuple[str, str, int]]:
    """`alias._name` where alias is an imported tokenmill module: a private name used across
    modules without a from-import."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tokenmill"):
            for a in node.names:
                if f"{node.module}.{a.name}" in MODULES:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name in MODULES:
                    aliases[a.asname] = a.name
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append((aliases[node.value.id], node.attr, node.lineno))
    return found


def _layer(module: str) -> str:
    part = module.split(".")[1] if "." in module else "__init__"
    if part in SHARED:
        return "shared"
    if part in STAGES:
        return "stage"
    if part in TOP:
        return "top"
    if part in TOOLING:
        return "tooling"
    return "package"  # tokenmill/__init__.py


def test_every_module_has_a_layer():
    assert "tokenmill.contracts" in MODULES and "tokenmill.generate.stage" in MODULES
    unknown = [m for m in MODULES if _layer(m) == "package" and m != "tokenmill"]
    assert not unknown, f"modules outside every layer (add them to a layer): {unknown}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m) == "shared"))
def test_shared_modules_import_no_stage(module):
    bad = [
        f"line {line}: {target}"
        for target, _, line in _imports(module)
        if _layer(target) != "shared"
    ]
    assert not bad, f"{module} (a shared module) imports from above it: {bad}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m) == "stage"))
def test_stages_import_neither_the_top_nor_private_names(module):
    bad = [
        f"line {line}: {target}"
        for target, _, line in _imports(module)
        if _layer(target) in ("top", "tooling")
    ]
    bad += [
        f"line {line}: {target}.{name}"
        for target, name, line in _imports(module)
        if name and name.startswith("_") and not name.startswith("__")
    ]
    bad += [f"line {line}: {target}.{name}" for target, name, line in _private_attributes(module)]
    assert not bad, f"{module} imports from the top layer or another module's private names: {bad}"


def _part(module: str) -> str:
    """A module's package (its first folder, or the module itself) under tokenmill."""
    return module.split(".")[1] if "." in module else module


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m) == "stage"))
def test_stages_import_only_earlier_stages(module):
    rank = STAGE_ORDER.index(_part(module))
    bad = [
        f"line {line}: {target}"
        for target, _, line in _imports(module)
        if _layer(target) == "stage" and STAGE_ORDER.index(_part(target)) > rank
    ]
    assert not bad, f"{module} imports a later stage ({' < '.join(STAGE_ORDER)}): {bad}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, state, stack = [], {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(stack[stack.index(t) :] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return cycles


def test_no_package_cycles():
    """Packages (stage folders, engines, jobs) and top modules form no cycle either."""
    graph: dict[str, set[str]] = {}
    for m in MODULES:
        graph.setdefault(_part(m), set()).update(
            _part(t) for t, *_ in _imports(m) if _part(t) != _part(m)
        )
    cycles = _cycles(graph)
    assert not cycles, "package cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_only_the_entry_point_imports_cli():
    users = [
        m
        for m in MODULES
        if m != "tokenmill.__main__" and any(t == "tokenmill.cli" for t, *_ in _imports(m))
    ]
    assert not users, f"modules importing tokenmill.cli (only __main__ may): {users}"


def test_no_import_cycles():
    graph = {m: {t for t, *_ in _imports(m) if t in MODULES} for m in MODULES}
    # a package's __init__ re-exporting its modules is not a cycle of logic
    for m in graph:
        graph[m] = {t for t in graph[m] if not m.startswith(t + ".")}
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_checks_see_violations(tmp_path, monkeypatch):
    """The readers above find what they look for (a check that cannot fail proves nothing)."""
    fake = tmp_path / "tokenmill"
    (fake / "generate").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "keys.py").write_text("from tokenmill.generate import stage\n")
    (fake / "generate" / "__init__.py").write_text("")
    (fake / "generate" / "stage.py").write_text(
        "from tokenmill.generate.other import _private\nfrom tokenmill import cli\n"
    )
    (fake / "generate" / "other.py").write_text(
        "def f():\n    from tokenmill.generate import stage as st\n    return st._run\n"
    )
    (fake / "cli.py").write_text("")
    this = sys.modules[__name__]
    monkeypatch.setattr(this, "PACKAGE", fake)
    modules = {_module_name(p): p for p in sorted(fake.rglob("*.py"))}
    monkeypatch.setattr(this, "MODULES", modules)
    assert ("tokenmill.generate.stage", None, 1) in _imports("tokenmill.keys")
    assert ("tokenmill.generate.other", "_private", 1) in _imports("tokenmill.generate.stage")
    assert ("tokenmill.cli", None, 2) in _imports("tokenmill.generate.stage")
    assert _private_attributes("tokenmill.generate.other") == [
        ("tokenmill.generate.stage", "_run", 3)
    ]
    with pytest.raises(AssertionError, match="cycles"):
        test_no_import_cycles()
    # A stage importing a later one, and two packages importing each other.
    (fake / "dataset").mkdir()
    (fake / "dataset" / "__init__.py").write_text("")
    (fake / "dataset" / "merge.py").write_text("")
    (fake / "generate" / "other.py").write_text("from tokenmill.dataset import merge\n")
    (fake / "dataset" / "stats.py").write_text("from tokenmill.generate import other\n")
    modules = {_module_name(p): p for p in sorted(fake.rglob("*.py"))}
    monkeypatch.setattr(this, "MODULES", modules)
    with pytest.raises(AssertionError, match="imports a later stage"):
        test_stages_import_only_earlier_stages("tokenmill.generate.other")
    test_stages_import_only_earlier_stages("tokenmill.dataset.stats")
    with pytest.raises(AssertionError, match="package cycles: dataset -> generate -> dataset"):
        test_no_package_cycles()
