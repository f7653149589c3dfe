"""The shape of the source tree, measured: module and function sizes, import cycles.

    python -m kvtier.dev.structure          (prints what breaks the limits; exit 1 if anything)

Limits, on what the formatter cannot change: no function over 40 statements, no import
cycle between kvtier's modules (counting every import: at the top, under TYPE_CHECKING
and inside functions), no module over 800 lines (declarative tables excepted). A module
over 400 lines is listed to be looked at (split where its concepts split), not refused:
a number to pack code under decides where code is cut and how it is written.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

LOOK_AT_MODULE_LINES = 400
MAX_MODULE_LINES = 800
MAX_FUNCTION_STATEMENTS = 40
# Declarative tables: data, not code paths.
TABLES = {"kvtier.config.lmcache_keys"}
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Report:
    long_modules: list[tuple[str, int]] = field(default_factory=list)
    to_look_at: list[tuple[str, int]] = field(default_factory=list)  # over 400 lines
    long_functions: list[tuple[str, int]] = field(default_factory=list)
    cycles: list[list[str]] = field(default_factory=list)

    def problems(self) -> list[str]:
        return (
            [f"module {m}: {n} lines" for m, n in self.long_modules]
            + [f"function {f}: {n} statements" for f, n in self.long_functions]
            + ["import cycle: " + " -> ".join(c) for c in self.cycles]
        )


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


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
    """Each function's statements (kvtier.dev.structure.statements)."""
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
    return found


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
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES and name not in TABLES:
            report.long_modules.append((name, lines))
        elif lines > LOOK_AT_MODULE_LINES and name not in TABLES:
            report.to_look_at.append((name, lines))
        lengths = function_lengths(tree, name)
        report.long_functions += [(f, n) for f, n in lengths if n > MAX_FUNCTION_STATEMENTS]
        graph[name] = imports_of(tree, name, path.name == "__init__.py", known)
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
