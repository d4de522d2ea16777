"""The one pattern-matching mechanism of every pass: onnxscript's rewriter patterns over onnx_ir.

A `Rule` is a `pattern(op, ...)` written as ordinary op calls (onnxscript's pattern builder) and a
`check(m)` that returns None to accept a match or the reason it is rejected. `find(model, rule)`
tries the rule at every node of the main graph and returns the accepted matches and the rejections
with their reasons, so a pass can say what it did not touch and why. Passes never walk index paths
(`node.inputs[0].producer().inputs[1]...`) themselves: what they need is a named binding.

Unlike onnxscript's `RewriteRule`, nothing is rewritten here: folding and quantization passes change
initializers and insert Q/DQ nodes around matched linears, which is not a subgraph replacement.
The rules are run with `check_nodes_are_removable=False`; `private_interior` is the check a rule
uses when it needs to know that the matched chain's intermediate values are used nowhere else.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Iterable

import onnx_ir as ir
from onnxscript.rewriter import pattern as _pattern


@dataclass(frozen=True)
class Match:
    """An accepted (or candidate) match: its root node, the nodes it covers and the named bindings."""

    rule: str
    root: ir.Node
    nodes: tuple[ir.Node, ...]
    bindings: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.bindings.get(name)


@dataclass(frozen=True)
class Rejection:
    rule: str
    node: str                  # the rejected root's name (what reports show)
    reason: str
    root: ir.Node | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> dict:
        return {"node": self.node, "reason": self.reason}


class Rule(abc.ABC):
    """`pattern` + `check`; subclasses take variant switches as constructor arguments."""

    name: str = "rule"

    @abc.abstractmethod
    def pattern(self, op, *args):
        """The subgraph, as op calls on `op`; returns the root value."""

    def check(self, m: Match) -> str | None:
        """None to accept `m`, else the reason it is rejected."""
        return None

    def compiled(self) -> _pattern.Pattern:
        if getattr(self, "_compiled", None) is None:
            self._compiled = _pattern.Pattern(self.pattern, name=self.name)
        return self._compiled


def find(model: ir.Model, rule: Rule) -> tuple[list[Match], list[Rejection]]:
    """Every match of `rule` in the main graph (in graph order) and every candidate it rejected."""
    compiled = rule.compiled()
    matches, rejections = [], []
    for node in model.graph:
        result = compiled.match(model, model.graph, node, check_nodes_are_removable=False)
        if not result:
            continue
        m = Match(rule.name, node, tuple(result.nodes), dict(result.bindings))
        reason = rule.check(m)
        if reason is None:
            matches.append(m)
        else:
            rejections.append(Rejection(rule.name, node.name or node.op_type, reason, node))
    return matches, rejections


def find_all(model: ir.Model, rules: Iterable[Rule]) -> tuple[list[Match], list[Rejection]]:
    """`find` for several variants of one structure, matches in graph order; a node accepted by one
    variant is not reported as rejected by another."""
    matches, rejections = [], []
    for rule in rules:
        found, rejected = find(model, rule)
        matches += found
        rejections += rejected
    accepted = {id(m.root) for m in matches}
    order = {id(n): i for i, n in enumerate(model.graph)}
    matches.sort(key=lambda m: order[id(m.root)])
    return matches, [r for r in rejections if id(r.root) not in accepted]


# ---- small predicates shared by the rules' checks -------------------------------------------------

def gqa_repeat(op, kv):
    """Pattern of the exporter's GQA repeat of K/V along the head axis: Reshape(Expand(Unsqueeze(kv)))."""
    return op.Reshape(op.Expand(op.Unsqueeze(kv, _pattern.ANY_VALUE), _pattern.ANY_VALUE), _pattern.ANY_VALUE,
                      _allow_other_attributes=True)


def constant(value: ir.Value | None) -> ir.TensorProtocol | None:
    """The tensor of an initializer / Constant-folded value, or None if `value` is computed."""
    if value is None:
        return None
    return value.const_value


def int_list(value: ir.Value | None) -> list[int] | None:
    tensor = constant(value)
    if tensor is None:
        return None
    return [int(v) for v in tensor.numpy().reshape(-1)]


def attr(node: ir.Node, name: str, default: Any = None) -> Any:
    a = node.attributes.get(name)
    return default if a is None else a.value


def private_interior(m: Match, allow_graph_outputs: bool = False) -> str | None:
    """None if every value produced inside the match, except the root's, is consumed only by nodes
    of the match (and, if allowed, by the graph's outputs); else the reason naming the leak."""
    inside = {id(n) for n in m.nodes}
    graph = m.root.graph
    outputs = {id(v) for v in graph.outputs} if graph is not None else set()
    for node in m.nodes:
        if node is m.root:
            continue
        for value in node.outputs:
            if id(value) in outputs and not allow_graph_outputs:
                return f"{value.name} is a graph output"
            for use in value.uses():
                if id(use.node) not in inside:
                    return f"{value.name} is also used by {use.node.op_type} {use.node.name}"
    return None
