"""The source tree keeps its shape (kvtier/dev/structure.py): no function over 40
statements, no import cycle between kvtier's modules, no module over 800 lines."""

from kvtier.dev import structure


def test_the_tree_is_within_its_limits():
    assert structure.measure().problems() == []


def test_the_check_finds_a_cycle_a_long_function_and_a_long_module():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert structure.cycles(graph) == [["a", "b", "c"]]
    import ast

    body = "\n".join(["def f():"] + ["    x = 1"] * 60)
    assert structure.function_lengths(ast.parse(body), "m") == [("m.f", 60)]
    nested = "def g():\n    if x:\n        y = 1\n    def h():\n        z = 1\n        z = 2\n"
    assert structure.function_lengths(ast.parse(nested), "m") == [("m.g", 3), ("m.g.h", 2)]
