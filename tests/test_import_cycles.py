"""No import cycle among decoderlm's modules, imports inside functions included (grimp reads every
import statement, wherever it is)."""

import grimp


def strongly_connected(graph: grimp.ImportGraph) -> list[set[str]]:
    """The sets of two or more modules that each import (perhaps through others) all the rest."""
    upstream = {
        m: graph.find_upstream_modules(m) for m in graph.modules
    }  # what m imports, transitively
    components: list[set[str]] = []
    for module in sorted(graph.modules):
        component = {module} | {other for other in upstream[module] if module in upstream[other]}
        if len(component) > 1 and component not in components:
            components.append(component)
    return components


def one_cycle(graph: grimp.ImportGraph, component: set[str]) -> str:
    """One import cycle through the component's first module: "a → b → … → a"."""
    first = min(component)
    step = min(component & graph.find_modules_directly_imported_by(first))
    back = graph.find_shortest_chain(importer=step, imported=first) or (step, first)
    return " → ".join((first, *back))


def test_no_import_cycle_among_decoderlm_modules():
    graph = grimp.build_graph("decoderlm")
    components = strongly_connected(graph)
    cycles = [one_cycle(graph, c) for c in components]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    graph = grimp.ImportGraph()
    for module in ("p", "p.a", "p.b", "p.c"):
        graph.add_module(module)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.c")
    graph.add_import(importer="p.c", imported="p.a")  # as an import inside a function would
    assert strongly_connected(graph) == [{"p.a", "p.b", "p.c"}]
    assert one_cycle(graph, {"p.a", "p.b", "p.c"}) == "p.a → p.b → p.c → p.a"
