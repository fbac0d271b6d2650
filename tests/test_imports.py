"""The import graph of agentd/ and agentctl/, read from the source (every import
statement: at module level, in functions, under TYPE_CHECKING).

- No cycles: a module never imports, directly or through others, a module that
  imports it. `from pkg import name` counts as importing `pkg.name` when that is
  a module, else `pkg` (its `__init__`).
- Private stays private (docs/architecture.md, "Private modules"): a module whose
  name starts with `_` is imported only from inside the package that holds it
  (the root's `agentd/_x.py` from anywhere in agentd/, never from agentctl/); a
  name that starts with `_` is imported only from a module of the same package.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("agentd", "agentctl")


def _modules() -> dict[str, Path]:
    out = {}
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _package_of(module: str) -> str:
    """The package a module belongs to (a package's `__init__` belongs to itself)."""
    path = MODULES[module]
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _imports(module: str) -> Iterator[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import in `module`."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    package = _package_of(module)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            if source not in MODULES:
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in MODULES:
                    yield sub, None, node.lineno
                else:
                    yield source, alias.name, node.lineno


def _graph() -> dict[str, set[str]]:
    return {m: {target for target, _, _ in _imports(m) if target != m} for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _private_module_owner(module: str) -> str | None:
    """The package that holds the first private component of `module`'s name."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


KNOWN_CYCLES: list[list[str]] = []


def test_no_import_cycles() -> None:
    cycles = [c for c in _cycles(_graph()) if c not in KNOWN_CYCLES]
    assert cycles == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_private_modules_and_names_stay_in_their_package() -> None:
    found = []
    for module in MODULES:
        package = _package_of(module)
        for target, name, line in _imports(module):
            owner = _private_module_owner(target)
            if owner is not None and not _inside(module, owner):
                found.append(f"{module}:{line} imports the private module {target}")
            if (name is not None and name.startswith("_") and not name.startswith("__")
                    and _package_of(target) != package):
                found.append(f"{module}:{line} imports the private name {target}.{name}")
    assert found == [], "\n".join(found)


def test_the_walk_sees_a_cycle_and_a_private_import() -> None:
    """The checks can fail: a two-module loop is a cycle, and a private module of
    another package is found."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _private_module_owner("agentd.federation._remote") == "agentd.federation"
    assert not _inside("agentd._daemon", "agentd.federation")
    assert _inside("agentd.federation._link", "agentd.federation")


def _pump_assignments(tree: ast.AST) -> list[int]:
    """Lines that assign an attribute of something named `pump` (`pump.x = ...`,
    `self.pump.x = ...`, `pump.x += ...`)."""
    lines = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for one in target.elts if isinstance(target, ast.Tuple) else [target]:
                if not isinstance(one, ast.Attribute):
                    continue
                owner = one.value
                name = (owner.id if isinstance(owner, ast.Name)
                        else owner.attr if isinstance(owner, ast.Attribute) else "")
                if name == "pump":
                    lines.append(node.lineno)
    return lines


def test_nothing_assigns_to_a_pump_after_it_is_built() -> None:
    """The pump takes what it runs with at construction (`PumpOptions`, the kernel,
    `on_security`, `intents`, `clock`) and a reload's changes through `Pump.reload`:
    no module, test or benchmark sets its attributes afterwards."""
    found = []
    for top in (*PACKAGES, "tests", "benchmarks"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for line in _pump_assignments(ast.parse(path.read_text(), str(path))):
                found.append(f"{path.relative_to(ROOT)}:{line}")
    assert found == [], "assigned after construction:\n" + "\n".join(found)
    assert _pump_assignments(ast.parse("h.pump.intents = x\npump.kernel = k")) == [1, 2]
