"""The source tree keeps its shape (kvtier/dev/structure.py): no module over 400
lines, no function over 50, no import cycle between kvtier's modules."""

from kvtier.dev import structure


def test_the_tree_is_within_its_limits():
    assert structure.measure().problems() == []


def test_the_check_finds_a_cycle_a_long_function_and_a_long_module():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert structure.cycles(graph) == [["a", "b", "c"]]
    import ast

    body = "\n".join(["def f():"] + ["    x = 1"] * 60)
    assert structure.function_lengths(ast.parse(body), "m") == [("m.f", 61)]
