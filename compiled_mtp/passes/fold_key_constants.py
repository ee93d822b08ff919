"""Fold every tensor that depends only on the graph's key into a constant.

A graph is built for one key (kind, B, K) and fixed state geometry, so an aranged position offset, a
block's causal pattern, a zero-filled accumulator or a scratch-row index is the same on every replay.
Such a node reads no graph input (placeholder) and no weight or state tensor (get_attr), and is not
random or mutating. The pass evaluates the outermost ones once, at compile time, and puts the values
in the graph as constants (`_folded_<digest>`), leaving computed only what depends on live sequence
lengths, slots, drafts, noise and weights.

Constants are named by a digest of their value, and every folded value is also kept by name (in
this process and in Inductor's cache directory), so a capture artifact, built without constants,
can store them even when Inductor's FX graph cache served its code and this pass did not run.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch.utils._pytree import tree_map_only

from .fx_nodes import upstream

PREFIX = "_folded_"
# name -> value of every constant this process folded or read back
_FOLDED: dict[str, torch.Tensor] = {}


class FoldKeyConstants(CustomGraphPass):
    def __call__(self, graph: fx.Graph) -> None:
        values = [(node, _evaluate(node)) for node in frontier(graph)]
        constants: dict[str, fx.Node] = {}
        for node, value in values:
            name = folded_name(value)
            if name not in constants:
                _remember(name, value)
                module = graph.owning_module
                assert module is not None, "post-grad graphs belong to a GraphModule"
                module.register_buffer(name, value)
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
    return (
        isinstance(node.target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded in node.target.tags
    )


def _evaluate(node: fx.Node) -> torch.Tensor:
    """Run `node` and its (key-only) inputs on real tensors."""
    env: dict[fx.Node, Any] = {}
    for n in upstream([node]):
        args, kwargs = tree_map_only(fx.Node, env.__getitem__, (n.args, n.kwargs))
        assert callable(n.target), "key-only values are computed by calls, not read from attributes"
        env[n] = n.target(*args, **kwargs)
    return env[node].clone()


def folded_name(value: torch.Tensor) -> str:
    """The constant's name: a digest of everything about its value."""
    data = value.detach().cpu().contiguous()
    meta = f"{data.dtype}:{tuple(data.shape)}:{value.stride()}:{value.device.type}".encode()
    return (
        PREFIX + hashlib.sha256(meta + data.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
    )


def folded_value(name: str) -> torch.Tensor | None:
    """The value of folded constant `name`, if this process or an earlier one folded it."""
    if name not in _FOLDED:
        try:
            value = torch.load(_store() / f"{name}.pt", weights_only=True)
        except Exception:  # missing, truncated or not a tensor file: as if never folded
            return None
        if folded_name(value) != name:  # a damaged file: never hand out another value
            return None
        _FOLDED[name] = value
    return _FOLDED[name]


def _remember(name: str, value: torch.Tensor) -> None:
    _FOLDED[name] = value
    path = _store() / f"{name}.pt"
    if path.exists():
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as tmp:
            torch.save(value.cpu(), tmp)
        os.replace(tmp.name, path)
    except OSError:
        pass  # only an optimization for capture builds served by the FX graph cache


def _store() -> Path:
    return Path(cache_dir()) / "compiled_mtp_folded"
