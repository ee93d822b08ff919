"""FX graph walks the passes share."""

from __future__ import annotations

from collections.abc import Iterable

from torch import fx


def in_graph_order(nodes: Iterable[fx.Node], graph: fx.Graph) -> list[fx.Node]:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return sorted(nodes, key=order.__getitem__)


def upstream(nodes: list[fx.Node], stop: Iterable[fx.Node] = ()) -> list[fx.Node]:
    """`nodes` and every node they are computed from, not crossing `stop`, in graph order."""
    seen, stack, found = set(stop), list(nodes), []
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            found.append(n)
            stack.extend(n.all_input_nodes)
    return in_graph_order(found, nodes[0].graph)
