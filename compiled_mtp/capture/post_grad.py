"""The post-grad graph of a step, before and after the passes, as modules that run.

For tests, benchmarks and bisecting a pass: the graph is exported and handed to Inductor exactly as
a capture would, and taken at the point where Inductor runs the custom passes; code generation is
skipped. Both modules read and write the live model's and state's tensors, like the compiled graph.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import ClassVar

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..graphs.plan import GraphKind
from ..graphs.state import StaticState
from ..models.family import CausalLM
from ..passes.manager import PassManager
from .aot import compile_package, export_step


class _Stop(Exception):
    """Ends the compile once the graphs are taken."""


class _Record(CustomGraphPass):
    # Inductor copies the pass object it is configured with, so the graphs go to the class.
    graphs: ClassVar[list[fx.GraphModule]] = []

    def __init__(self, manager: PassManager) -> None:
        self.manager = manager

    def __call__(self, graph: fx.Graph) -> None:
        _Record.graphs.append(_runnable(graph))
        self.manager(graph)
        _Record.graphs.append(_runnable(graph))
        raise _Stop

    def uuid(self) -> None:  # never cached
        return None


def _runnable(graph: fx.Graph) -> fx.GraphModule:
    copied = copy.deepcopy(graph)
    copied._codegen = (
        fx.graph.CodeGen()
    )  # plain positional inputs instead of the export's pytree calling convention
    assert graph.owning_module is not None, "Inductor's post-grad graphs belong to a GraphModule"
    return fx.GraphModule(graph.owning_module, copied)


def post_grad_graphs(
    kind: GraphKind,
    model: CausalLM,
    state: StaticState,
    inputs: tuple[torch.Tensor, ...],
    passes: tuple[str, ...],
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """(graph before the passes, graph after them) of step `kind` on step tensors shaped like `inputs`.
    Call them with the step tensors."""
    ep = export_step(kind, model, state, inputs)
    _Record.graphs.clear()
    options = {"post_grad_custom_post_pass": _Record(_manager(model, passes)), "fx_graph_cache": False}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            compile_package(ep, Path(tmp) / "graph.pt2", options)
        except Exception:
            if len(_Record.graphs) != 2:
                raise
    before, after = _Record.graphs
    _Record.graphs.clear()
    return before, after


def passes_applied(before: fx.GraphModule, model: CausalLM, passes: tuple[str, ...]) -> fx.GraphModule:
    """`before` (post_grad_graphs' first graph) after `passes`, run on a copy of it outside Inductor:
    the graph post_grad_graphs gives, in about a tenth of the time, for trying several pass sets on
    a step lowered once."""
    after = fx.GraphModule(before, copy.deepcopy(before.graph))
    _manager(model, passes)(after.graph)
    after.recompile()
    return after


def _manager(model: CausalLM, passes: tuple[str, ...]) -> PassManager:
    manager = PassManager(passes)
    manager.learn(model)  # what a capture's passes know of the weights; nothing packed
    return manager
