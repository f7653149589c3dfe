"""The source tree keeps its shape (kvtier_tools/dev/structure.py): no line over 100
characters, no function over 40 statements, no import cycle (package `__init__` files
counted), no module over 800 lines, and the library never importing the tools."""

import ast

from kvtier_tools.dev import structure


def test_the_tree_is_within_its_limits():
    report = structure.measure()
    assert report.problems() == []
    assert {m.split(".")[0] for m in structure.modules()} == {"kvtier", "kvtier_tools"}


def test_the_check_finds_a_cycle_a_long_function_and_a_long_module():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert structure.cycles(graph) == [["a", "b", "c"]]
    body = "\n".join(["def f():"] + ["    x = 1"] * 60)
    assert structure.function_lengths(ast.parse(body), "m") == [("m.f", 60)]
    nested = "def g():\n    if x:\n        y = 1\n    def h():\n        z = 1\n        z = 2\n"
    assert structure.function_lengths(ast.parse(nested), "m") == [("m.g", 3), ("m.g.h", 2)]


def test_a_cycle_through_a_package_init_is_found():
    # p/__init__.py imports q.y; q/__init__.py imports q.z; q/z.py imports p.a. Importing
    # q.y runs q/__init__ first, so p -> q -> q.z -> p: a cycle no module edge shows alone.
    known = {"p", "p.a", "q", "q.y", "q.z"}
    sources = {
        "p": ("from q.y import thing", True),
        "q": ("from q.z import other", True),
        "q.z": ("from p.a import value", False),
        "p.a": ("", False),
        "q.y": ("", False),
    }
    graph = {
        name: structure.imports_of(ast.parse(text), name, is_package, known)
        for name, (text, is_package) in sources.items()
    }
    assert graph["p"] == {"q", "q.y"}
    assert graph["q"] == {"q.z"}  # its own package is being imported already
    assert structure.cycles(graph) == [["p", "q", "q.z"]]
