"""Fold every tensor that depends only on the graph's key into a constant.

A graph is built for one key (kind, B, K) and fixed state geometry, so an aranged position offset, a
block's causal pattern, a zero-filled accumulator or a scratch-row index is the same on every replay.
Such a node reads no graph input (placeholder) and no weight or state tensor (get_attr), and is not
random or mutating. The pass evaluates the outermost ones once, at compile time, and puts the values
in the graph as constants (`_folded_<digest>`), leaving computed only what depends on live sequence
lengths, slots, drafts, noise and weights.

Constants are named by a digest of their value, and every folded value is also kept in `FOLDED`, so
a capture artifact (built without constants) can store and reload them by name.
"""

from __future__ import annotations

import hashlib

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.utils._pytree import tree_map_only

PREFIX = "_folded_"
# name -> value of every constant this process folded (capture stores the ones a package needs)
FOLDED: dict[str, torch.Tensor] = {}


class FoldKeyConstants(CustomGraphPass):
    def __call__(self, graph: fx.Graph) -> None:
        values = [(node, _evaluate(node)) for node in frontier(graph)]
        constants: dict[str, fx.Node] = {}
        for node, value in values:
            name = folded_name(value)
            if name not in constants:
                FOLDED[name] = value
                graph.owning_module.register_buffer(name, value)
                with graph.inserting_before(next(n for n in graph.nodes if n.op != "placeholder")):
                    constants[name] = graph.get_attr(name)
                constants[name].meta.update(val=node.meta["val"], tensor_meta=node.meta.get("tensor_meta"))
            node.replace_all_uses_with(constants[name])
        graph.eliminate_dead_code()

    def uuid(self) -> str:
        return get_hash_for_files((__file__,)).hex()


def key_only(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose value is fixed by the graph's shapes alone."""
    fixed: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function" or node.is_impure() or _random(node):
            continue
        if all(a in fixed for a in node.all_input_nodes) and isinstance(node.meta.get("val"), torch.Tensor):
            fixed.add(node)
    return fixed


def frontier(graph: fx.Graph) -> list[fx.Node]:
    """The key-only nodes something else reads: folding these removes every key-only node."""
    fixed = key_only(graph)
    return [n for n in graph.nodes if n in fixed and any(u not in fixed for u in n.users)]


def _random(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags


def _evaluate(node: fx.Node) -> torch.Tensor:
    """Run `node` and its (key-only) inputs on real tensors."""
    env: dict[fx.Node, object] = {}
    for n in _ancestors(node):
        args, kwargs = tree_map_only(fx.Node, env.__getitem__, (n.args, n.kwargs))
        env[n] = n.target(*args, **kwargs)
    return env[node].clone()


def _ancestors(node: fx.Node) -> list[fx.Node]:
    seen, stack, found = set(), [node], []
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            found.append(n)
            stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(found, key=order.get)


def folded_name(value: torch.Tensor) -> str:
    """The constant's name: a digest of everything about its value."""
    data = value.detach().cpu().contiguous()
    meta = f"{data.dtype}:{tuple(data.shape)}:{value.stride()}:{value.device.type}".encode()
    return PREFIX + hashlib.sha256(meta + data.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
