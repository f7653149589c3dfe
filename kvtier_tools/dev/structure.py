"""The shape of the source tree, measured: module and function sizes, import cycles.

    python -m kvtier_tools.dev.structure    (prints what breaks the limits; exit 1 if anything)

Limits: no line over 100 characters, no function over 40 statements, no import cycle
between modules (counting every import: at the top, under TYPE_CHECKING and inside
functions, and the package `__init__` that importing a submodule runs first), no module over
800 lines (declarative tables excepted), and the library (kvtier) never importing the tools
(kvtier_tools). A module over 400 lines is listed to be looked at (split where its concepts
split), not refused: a number to pack code under decides where code is cut and how it is
written.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

LOOK_AT_MODULE_LINES = 400
MAX_MODULE_LINES = 800
MAX_FUNCTION_STATEMENTS = 40
MAX_LINE = 100
# Declarative tables: data, not code paths.
TABLES = {"kvtier.config.lmcache_keys"}
REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("kvtier", "kvtier_tools")
LIBRARY = "kvtier"


@dataclass
class Report:
    long_modules: list[tuple[str, int]] = field(default_factory=list)
    to_look_at: list[tuple[str, int]] = field(default_factory=list)  # over 400 lines
    long_functions: list[tuple[str, int]] = field(default_factory=list)
    long_lines: list[tuple[str, int]] = field(default_factory=list)  # (module, line number)
    cycles: list[list[str]] = field(default_factory=list)
    library_to_tools: list[tuple[str, str]] = field(default_factory=list)

    def problems(self) -> list[str]:
        return (
            [f"module {m}: {n} lines" for m, n in self.long_modules]
            + [f"function {f}: {n} statements" for f, n in self.long_functions]
            + [f"line {m}:{n}: over {MAX_LINE} characters" for m, n in self.long_lines]
            + ["import cycle: " + " -> ".join(c) for c in self.cycles]
            + [f"the library imports the tools: {a} -> {b}" for a, b in self.library_to_tools]
        )


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    paths = [p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))]
    return {module_name(p): p for p in paths}


def statements(node: ast.AST) -> int:
    """The statements in a function's body, its nested functions' bodies excepted."""
    count = 0
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            count += 1
        elif isinstance(child, ast.stmt):
            count += 1 + statements(child)
    return count


def function_lengths(tree: ast.AST, prefix: str) -> list[tuple[str, int]]:
    """Each function's statements (kvtier_tools.dev.structure.statements)."""
    out: list[tuple[str, int]] = []

    def walk(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{scope}.{child.name}"
                out.append((name, statements(child)))
                walk(child, name)
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{scope}.{child.name}")

    walk(tree, prefix)
    return out


def imports_of(tree: ast.AST, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The kvtier modules `name` imports, wherever the import statement is."""
    found: set[str] = set()
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod where there is one.
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
                found |= _packages_run_first(target, package, known)
    return found


def _packages_run_first(target: str, package: str, known: set[str]) -> set[str]:
    """The packages whose `__init__` importing `target` runs first, those that hold the
    importer (`package`) excepted: they are being imported already."""
    parts = target.split(".")
    ancestors = {".".join(parts[:i]) for i in range(1, len(parts))}
    inside = {p for p in ancestors if package == p or package.startswith(p + ".")}
    return {p for p in ancestors - inside if p in known}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
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


def measure() -> Report:
    report = Report()
    found = modules()
    known = set(found)
    graph: dict[str, set[str]] = {}
    for name, path in found.items():
        text = path.read_text()
        tree = ast.parse(text)
        rows = text.splitlines()
        lines = len(rows)
        report.long_lines += [(name, i) for i, row in enumerate(rows, 1) if len(row) > MAX_LINE]
        if lines > MAX_MODULE_LINES and name not in TABLES:
            report.long_modules.append((name, lines))
        elif lines > LOOK_AT_MODULE_LINES and name not in TABLES:
            report.to_look_at.append((name, lines))
        lengths = function_lengths(tree, name)
        report.long_functions += [(f, n) for f, n in lengths if n > MAX_FUNCTION_STATEMENTS]
        graph[name] = imports_of(tree, name, path.name == "__init__.py", known)
        if name.split(".")[0] == LIBRARY:
            tools = [t for t in graph[name] if t.split(".")[0] != LIBRARY]
            report.library_to_tools += [(name, t) for t in sorted(tools)]
    report.cycles = cycles(graph)
    return report


def main() -> int:
    report = measure()
    for name, lines in sorted(report.to_look_at, key=lambda x: -x[1]):
        print(f"to look at: module {name}: {lines} lines")
    problems = report.problems()
    for line in problems:
        print(line)
    print(f"{len(problems)} over the limits" if problems else "within the limits")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
