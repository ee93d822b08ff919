"""FX graph walks and rewrites the passes share."""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import fx
from torch.utils._pytree import tree_map_only

aten = torch.ops.aten


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


def calls_of(graph: fx.Graph, fn: Callable) -> Iterator[tuple[set[fx.Node], list[fx.Node], list[fx.Node]]]:
    """Each call of the traced function `fn` in `graph` (one connected part of its region): (its
    nodes, the external nodes they read, those of its nodes read outside it).

    Found by provenance: every node traced inside `fn` carries `fn`'s frame in its stack trace, through
    torch.compile or a strict torch.export (a non-strict one keeps only `forward` frames) into
    Inductor's post-grad graph; tests/test_passes.py fails if a torch release stops carrying them.
    (`torch.fx.traceback.annotate` markers would be explicit, but do not survive the export.)
    Nodes Inductor created without a trace join when all their users are in the region."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for region in sorted(
        connected_parts(_traced_region(graph, _frame(fn))), key=lambda part: min(map(order.__getitem__, part))
    ):
        yield (
            region,
            *boundary(graph, region),
        )  # in graph order, so that the ops' node names do not vary from run to run


def _frame(fn: Callable) -> re.Pattern:
    """The stack-trace line of a frame of `fn`: its file's last two path parts, any line, its name."""
    path = Path(fn.__code__.co_filename)
    return re.compile(
        rf'{re.escape(path.parent.name)}[/\\]{re.escape(path.name)}", line \d+, in {re.escape(fn.__name__)}\n'
    )


def _traced_region(graph: fx.Graph, frame: re.Pattern) -> set[fx.Node]:
    """The nodes traced inside a function, found by `frame` in their stack traces, and the nodes
    Inductor created without a trace whose users are all in the region."""
    region = {
        n for n in graph.nodes if n.op == "call_function" and frame.search(n.meta.get("stack_trace") or "")
    }
    grown = bool(region)
    while grown:
        grown = False
        for n in graph.nodes:
            if (
                n.op == "call_function"
                and n not in region
                and not n.meta.get("stack_trace")
                and n.users
                and set(n.users) <= region
            ):
                region.add(n)
                grown = True
    return region


def connected_parts(region: set[fx.Node]) -> list[set[fx.Node]]:
    """The region's connected parts (one per call of the traced function, where calls share no node)."""
    parts, seen = [], set()
    for start in region:
        if start in seen:
            continue
        part, stack = set(), [start]
        while stack:
            n = stack.pop()
            if n in part:
                continue
            part.add(n)
            stack.extend(m for m in (*n.all_input_nodes, *n.users) if m in region)
        seen |= part
        parts.append(part)
    return parts


def boundary(graph: fx.Graph, region: set[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """External nodes the region reads and region nodes read outside it, in graph order."""
    inputs = {a for n in region for a in n.all_input_nodes if a not in region}
    outputs = {n for n in region if any(u not in region for u in n.users)}
    return in_graph_order(inputs, graph), in_graph_order(outputs, graph)


def call_in_place_of(graph: fx.Graph, target: Callable, args: list, outputs: list[fx.Node]) -> None:
    """Call `target(*args)` after the last node among `args`. One output: the result takes its uses
    (its metadata computed from the inputs' fake values). Several: `target` returns a tuple, whose
    items take the uses of `outputs` in order."""
    with graph.inserting_after(in_graph_order([a for a in args if isinstance(a, fx.Node)], graph)[-1]):
        if len(outputs) == 1:
            outputs[0].replace_all_uses_with(call(graph, target, *args))
            return
        fused = graph.call_function(target, tuple(args))
    fused.meta["val"] = tuple(n.meta["val"] for n in outputs)
    with graph.inserting_after(fused):
        items = [graph.call_function(operator.getitem, (fused, i)) for i in range(len(outputs))]
    for item, old in zip(items, outputs):
        item.meta["val"] = old.meta["val"]
        old.replace_all_uses_with(item)


def signature(node: fx.Node) -> tuple[int, bool]:
    """(dimensions, whether floating point) of the tensor `node` produces."""
    val = node.meta["val"]
    return val.dim(), val.dtype.is_floating_point


def device_types(nodes: Iterable[fx.Node]) -> set[str]:
    """The device types of the tensors `nodes` produce."""
    return {n.meta["val"].device.type for n in nodes if isinstance(n.meta.get("val"), torch.Tensor)}


def standalone(inputs: list[fx.Node], outputs: list[fx.Node]) -> fx.GraphModule:
    """The nodes between `inputs` and `outputs` as a module of their own: inputs -> outputs."""
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {n: sub.placeholder(f"in{i}") for i, n in enumerate(inputs)}
    for n in upstream(outputs, stop=inputs):
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(tuple(env[n] for n in outputs))
    return fx.GraphModule(torch.nn.Module(), sub)


@dataclass(frozen=True)
class LinearNode:
    """A linear as it reaches the post-grad graph: `mm(x, permute(W, [1, 0]))`, or
    `addmm(added, x, permute(W))` where `added` is a bias or a residual Inductor folded in."""

    node: fx.Node
    x: fx.Node  # [rows, in]
    weight: fx.Node  # [out, in], a tensor the graph reads (an input or a constant)
    added: fx.Node | None

    @property
    def rows(self) -> int:
        return self.x.meta["val"].shape[0]

    @property
    def weight_size(self) -> int:
        return self.weight.meta["val"].numel()

    def on_cpu_float32(self) -> bool:
        return on_cpu_float32(self.x, self.weight)

    def replace(self, build: Callable[[fx.Graph], fx.Node], adds: bool) -> None:
        """Put `build(graph)`'s result in the linear's place; `adds`: whether it already adds `added`."""

        def build_all(graph: fx.Graph) -> fx.Node:
            result = build(graph)
            return result if self.added is None or adds else call(graph, aten.add.Tensor, self.added, result)

        replace(self.node, build_all)


def on_cpu_float32(*nodes: fx.Node) -> bool:
    vals = [n.meta.get("val") for n in nodes]
    return all(
        isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.dtype == torch.float32 for v in vals
    )


def replace(node: fx.Node, build: Callable[[fx.Graph], fx.Node]) -> None:
    """Put `build(graph)`'s result, built just before `node`, in its place."""
    graph = node.graph
    with graph.inserting_before(node):
        result = build(graph)
    result.meta.update(node.meta)
    node.replace_all_uses_with(result)
    graph.erase_node(node)


def linears(graph: fx.Graph) -> list[LinearNode]:
    """Every linear of `graph` on a weight the graph reads, in graph order."""
    found = []
    for node in graph.nodes:
        if (
            node.op != "call_function"
            or node.kwargs
            or node.target not in (aten.mm.default, aten.addmm.default)
        ):
            continue
        added, x, weight_t = (None, *node.args) if node.target is aten.mm.default else node.args
        if not (
            isinstance(weight_t, fx.Node)
            and weight_t.target is aten.permute.default
            and weight_t.args[1] in ([1, 0], (1, 0))
        ):
            continue
        weight = weight_t.args[0]
        if isinstance(weight, fx.Node) and weight.op in ("placeholder", "get_attr"):
            found.append(LinearNode(node, x, weight, added))
    return found


def call(graph: fx.Graph, target: Callable, *args: fx.node.Argument, **kwargs: fx.node.Argument) -> fx.Node:
    """A new call_function node, with its value's metadata computed from its inputs' fake values."""
    node = graph.call_function(target, args, kwargs)
    vals = tree_map_only(fx.Node, lambda n: n.meta.get("val"), args)
    fake = next((v for v in vals if isinstance(v, torch._subclasses.FakeTensor)), None)
    if fake is not None:
        with fake.fake_mode:
            node.meta["val"] = target(*vals, **kwargs)
    return node
