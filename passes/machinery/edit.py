"""Direct graph edits shared by the passes: replace a constant, add an initializer, add a node,
build a group of nodes for one rewrite (Emit), Q/DQ around a value, raise the opset, drop dead nodes;
and the graph conventions more than one folder of passes writes (the KV layout metadata key).

Passes change only the tensors they touch; every other initializer stays a lazy external tensor
(onnx_ir memory-maps it), so a pass over a large model holds only its own new arrays in RAM.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from enginesmith.core import kv_spec

KV_LAYOUT_KEY = kv_spec.GRAPH_KEY  # graph metadata: the KV layout the kv and lower passes wrote (JSON)
SWAP_HEADS_SEQ = [0, 2, 1, 3]            # Transpose perm: [B, heads, S, D] <-> [B, S, heads, D]


class Namer:
    """Unique value names for one graph (initializers and node outputs)."""

    def __init__(self, graph: ir.Graph):
        self.graph = graph
        self.taken = set(graph.initializers) | {v.name for v in graph.inputs}
        self.taken |= {out.name for node in graph for out in node.outputs}

    def __call__(self, base: str) -> str:
        name, i = base, 1
        while name in self.taken:
            name, i = f"{base}_{i}", i + 1
        self.taken.add(name)
        return name


def tensor_type(value: ir.Value) -> ir.DataType:
    return value.const_value.dtype if value.const_value is not None else value.type.dtype


def add_initializer(graph: ir.Graph, namer: Namer, base: str, array: np.ndarray,
                    dtype: ir.DataType | None = None) -> ir.Value:
    """A new initializer holding `array` (stored as `dtype`, e.g. INT4, when given)."""
    name = namer(base)
    tensor = ir.Tensor(array, dtype=dtype, name=name) if dtype is not None else ir.Tensor(array, name=name)
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(tensor.dtype),
                     const_value=tensor)
    graph.register_initializer(value)
    return value


def set_constant(graph: ir.Graph, namer: Namer, node: ir.Node, value: ir.Value, array: np.ndarray
                 ) -> ir.Value:
    """Make `node` read `array` where it read the constant `value`, in the same dtype.

    In place when `node` is the only reader; otherwise a new initializer, so the other readers
    (a norm weight deduplicated across layers, an embedding tied to the lm_head) keep theirs.
    """
    dtype = tensor_type(value)
    array = np.ascontiguousarray(array.astype(ir.DataType(dtype).numpy(), copy=False))
    if all(use.node is node for use in value.uses()):
        value.const_value = ir.Tensor(array, name=value.name)
        return value
    new = add_initializer(graph, namer, value.name, array)
    for i, inp in enumerate(node.inputs):
        if inp is value:
            node.replace_input_with(i, new)
    return new


def add_node(graph: ir.Graph, namer: Namer, op_type: str, inputs: list[ir.Value | None],
             attributes: dict | None = None, like: ir.Value | None = None,
             dtype: ir.DataType | None = None, shape: ir.Shape | None = None, before: ir.Node | None = None,
             domain: str = "", base: str | None = None) -> ir.Value:
    """Insert a one-output node before `before` (or at the end); its output takes `like`'s shape and
    type unless `dtype`/`shape` say otherwise. Returns the output value."""
    node = ir.Node(domain, op_type, inputs, attributes=to_attrs(attributes),
                   num_outputs=1, name=namer(f"{base or op_type}"))
    out = node.outputs[0]
    out.name = namer(f"{base or op_type}_out")
    out.type = ir.TensorType(dtype if dtype is not None else like.type.dtype)
    out.shape = shape if shape is not None else (like.shape if like is not None else None)
    if before is not None:
        graph.insert_before(before, node)
    else:
        graph.append(node)
    return out


class Emit:
    """Makes the nodes of one rewrite, named `base/op`, collected in `nodes` (the caller inserts
    them: before the node they replace, or through ir.convenience.replace_nodes_and_values)."""

    def __init__(self, graph: ir.Graph, namer: Namer, base: str):
        self.graph, self.namer, self.base = graph, namer, base
        self.nodes: list[ir.Node] = []

    def __call__(self, op: str, inputs, attrs: dict | None = None, dtype=None, shape=None, domain: str = "",
                 outputs: int = 1):
        """A new node; returns its output (or its outputs when `outputs` > 1), the first one typed
        `dtype` and shaped `shape` when given."""
        node = ir.Node(domain, op, inputs, to_attrs(attrs),
                       num_outputs=outputs, name=self.namer(f"{self.base}/{op}"))
        for out in node.outputs:
            out.name = self.namer(f"{self.base}/{op}_out")
        if dtype is not None:
            node.outputs[0].type = ir.TensorType(dtype)
        if shape is not None:
            node.outputs[0].shape = ir.Shape(shape)
        self.nodes.append(node)
        return node.outputs[0] if outputs == 1 else node.outputs

    def const(self, name: str, array) -> ir.Value:
        """A new initializer `base/name` holding `array`."""
        return add_initializer(self.graph, self.namer, f"{self.base}/{name}", np.asarray(array))


def to_attrs(values: dict | None) -> list[ir.Attr]:
    """ONNX attributes from plain values (int/bool, float, str, int lists)."""
    return [_attr(k, v) for k, v in (values or {}).items()]


def _attr(name: str, value) -> ir.Attr:
    if isinstance(value, (bool, int, np.integer)):
        return ir.AttrInt64(name, int(value))
    if isinstance(value, float):
        return ir.AttrFloat32(name, value)
    if isinstance(value, str):
        return ir.AttrString(name, value)
    if isinstance(value, (list, tuple)):
        return ir.AttrInt64s(name, [int(v) for v in value])
    raise TypeError(f"attribute {name}: unsupported {type(value).__name__}")


def drop_unused_initializers(graph: ir.Graph) -> int:
    """Remove initializers nothing reads (left behind by replacements); returns how many."""
    outputs = {id(v) for v in graph.outputs}
    unused = [name for name, v in graph.initializers.items() if not v.uses() and id(v) not in outputs]
    for name in unused:
        graph.initializers.pop(name)
    return len(unused)


def replace_value(graph: ir.Graph, old: ir.Value, new: ir.Value, name: str) -> None:
    """Every use of `old`, and its place among the graph outputs, goes to `new` (named `name`, typed and
    shaped as `old`); a graph output keeps its name (logits stays logits)."""
    new.name, new.type, new.shape = name, old.type, old.shape
    output_name = None
    for i, out in enumerate(graph.outputs):
        if out is old:
            graph.outputs[i], output_name = new, old.name
    ir.convenience.replace_all_uses_with(old, new)
    if output_name is not None:
        old.name, new.name = None, output_name


def qdq(graph: ir.Graph, namer: Namer, x: ir.Value, scale: ir.Value, zp: ir.Value,
        before: ir.Node) -> ir.Value:
    """QuantizeLinear + DequantizeLinear of `x` (int8), inserted before `before`; returns the
    dequantized value, of x's type and shape."""
    q = add_node(graph, namer, "QuantizeLinear", [x, scale, zp], like=x, dtype=ir.DataType.INT8,
                 before=before, base=f"{x.name}_q")
    return add_node(graph, namer, "DequantizeLinear", [q, scale, zp], like=x, dtype=x.type.dtype,
                    before=before, base=f"{x.name}_dq")


def ensure_opset(model: ir.Model, opset: int) -> bool:
    """Raise the default-domain opset to at least `opset` (version converter); True if it changed."""
    current = model.opset_imports.get("", 1)
    if current >= opset:
        return False
    from onnxscript import version_converter

    version_converter.convert_version(model, opset, fallback=True)
    model.opset_imports[""] = opset
    return True


def remove_dead_nodes(model: ir.Model) -> None:
    """Drop the nodes whose outputs nothing reads (after a rewrite left the old ones behind)."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    RemoveUnusedNodesPass()(model)
