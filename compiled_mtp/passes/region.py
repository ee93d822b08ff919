"""The skeleton of the passes that replace each call of a traced function with one op.

Such a pass names the function (its calls are found by provenance, `fx_nodes.calls_of`), the op, and
the region's arity; it says which of the region's inputs is which of the op's arguments (`roles`).
Shapes rarely tell every input apart, so `roles` lists the assignments shapes allow and
`one_agreeing` runs the region and the op on seeded probe inputs under each of them: the region is
replaced only where exactly one assignment reproduces it. A region that cannot be replaced raises
`Unfusable`, which leaves it as traced with one log line.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TypeVar

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import stable_topological_sort

from ..ops import library
from . import fx_nodes
from .fx_nodes import call_in_place_of, calls_of, device_types, on_cpu_float32, signature, standalone

log = logging.getLogger("compiled_mtp.passes")
Candidate = TypeVar("Candidate")
# Runs the region on probe values given to the nodes named, in that order; returns its outputs.
Region = Callable[[Sequence[fx.Node], Sequence[torch.Tensor]], tuple[torch.Tensor, ...]]


class Unfusable(Exception):
    """Why a region stays as traced. `expected`: a skip by design (a device or a size the op does not
    serve), logged at INFO; otherwise the region is not what the pass expects, a WARNING."""

    def __init__(self, reason: str, expected: bool = False) -> None:
        super().__init__(reason)
        self.expected = expected


class RegionPass(CustomGraphPass):
    """Replaces each call of `traced` in a post-grad graph with one call of the op
    `torch.ops.compiled_mtp.<op_name>`, where `roles` finds the op's arguments. The pass's name is its
    module's."""

    traced: Callable  # the function whose calls are replaced
    op_name: str
    # The op is one of the C++ ops (ops/csrc): the regions stay as traced where they do not build.
    native: bool = False
    arity: tuple[int, int]  # the region's inputs and outputs, as the function's
    # What the replacement depends on beyond this file, fx_nodes and the pass's own module.
    modules: tuple[ModuleType, ...] = ()

    def roles(
        self, region: set[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]
    ) -> tuple[list, list[fx.Node]]:
        """(the op's arguments, the outputs its results replace, in its order), or raise Unfusable."""
        raise NotImplementedError

    def serves(self, devices: set[str]) -> bool:
        """Whether the op replaces regions whose inputs are on `devices`."""
        return devices == {"cpu"}

    @property
    def settings(self) -> tuple:
        """The module settings the pass's decisions depend on (thresholds, switches), for the uuid."""
        return ()

    @property
    def op(self) -> torch._ops.OpOverload:
        return getattr(torch.ops.compiled_mtp, self.op_name).default

    def op_for(self, devices: set[str]) -> torch._ops.OpOverload:
        """The op that replaces a region whose inputs are on `devices` (and runs on its probes)."""
        return self.op

    @property
    def name(self) -> str:
        return type(self).__module__.rsplit(".", 1)[-1]

    def __call__(self, graph: fx.Graph) -> None:
        found = False
        for region, inputs, outputs in calls_of(graph, self.traced):
            found = True
            try:
                self._check(inputs, outputs)
                args, replaced = self.roles(region, inputs, outputs)
            except Unfusable as e:
                log.log(
                    logging.INFO if e.expected else logging.WARNING, "%s: left as traced: %s", self.name, e
                )
                continue
            call_in_place_of(graph, self.op_for(device_types(inputs)), args, replaced)
        if not found:  # a model family without this function (GLM-4 MoE has no latent attention)
            log.info("%s: skipped, the graph has no call of %s", self.name, self.traced.__name__)
        graph.eliminate_dead_code()
        stable_topological_sort(graph)  # users of an output may precede the op's last input

    def _check(self, inputs: list[fx.Node], outputs: list[fx.Node]) -> None:
        if not all(isinstance(n.meta.get("val"), torch.Tensor) for n in inputs + outputs):
            raise Unfusable("a region input or output is not a tensor")
        devices = device_types(inputs)
        if not self.serves(devices):
            raise Unfusable(f"the op is not used on {'/'.join(sorted(devices))}", expected=True)
        if self.native and not on_cpu_float32(*(n for n in inputs + outputs if _floating(n))):
            raise Unfusable("not a float32 graph (the C++ kernels take float32)", expected=True)
        if self.native and not library.load():
            raise Unfusable("the C++ ops did not build", expected=True)
        if (len(inputs), len(outputs)) != self.arity:
            raise Unfusable(
                f"the region has {len(inputs)} inputs and {len(outputs)} "
                f"outputs, expected {self.arity[0]} and {self.arity[1]}"
            )

    def uuid(self) -> str:
        files = (
            inspect.getfile(type(self)),
            __file__,
            fx_nodes.__file__,
            *(m.__file__ for m in self.modules),
        )
        native = library.version() if self.native else ""
        return get_hash_for_files(files, repr(self.settings) + native).hex()


def _floating(node: fx.Node) -> bool:
    return node.meta["val"].is_floating_point()


def one_agreeing(
    inputs: list[fx.Node],
    outputs: list[fx.Node],
    candidates: list[Candidate],
    agreement: Callable[[Region, Candidate], float],
    threshold: float = 1.0,
) -> Candidate:
    """The one candidate under which the op reproduces the region (inputs -> outputs) on probe inputs.
    `agreement(region, candidate)` is the share of probes where it does; exactly one candidate must
    reach `threshold`."""
    try:
        module = standalone(inputs, outputs)

        def region(nodes: Sequence[fx.Node], values: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
            env = dict(zip(nodes, values))
            return module(*(env[n] for n in inputs))

        shares = [agreement(region, candidate) for candidate in candidates]
    except Exception as e:  # the region does not run as the traced function would: another graph
        first_line = str(e).splitlines()[0] if str(e) else ""
        raise Unfusable(f"the region does not run on probe inputs ({type(e).__name__}: {first_line})") from e
    if sum(share >= threshold for share in shares) != 1:
        listed = ", ".join(f"{share:.0%}" for share in shares) or "none"
        raise Unfusable(
            f"the op reproduces the region on {listed} of the probes "
            f"under the {len(candidates)} assignments of its inputs, "
            f"expected exactly one at {threshold:.0%} or more"
        )
    return next(c for c, share in zip(candidates, shares) if share >= threshold)


def by_signature(nodes: list[fx.Node], counts: dict[tuple[int, bool], int], what: str) -> list[list[fx.Node]]:
    """`nodes` grouped by signature (dimensions, whether floating point), a group per key of `counts`
    in its order, each of that many nodes; or Unfusable, naming them (`what`: "inputs (x, y)")."""
    groups = [[n for n in nodes if signature(n) == kind] for kind in counts]
    if [len(group) for group in groups] != list(counts.values()) or len(nodes) != sum(counts.values()):
        raise Unfusable(f"its {what} do not have the expected shapes")
    return groups
