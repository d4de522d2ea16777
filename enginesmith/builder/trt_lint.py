"""trt-lint: will TensorRT's ONNX parser take this graph? Checked statically, in seconds, without TensorRT.

Rules (each finding names the node, what is wrong and the fix):
  opset                  default-domain opset inside the target's range
  unsupported-op         op not imported by the target's parser (or newer than the target)
  unsupported-attribute  op imported, but this attribute/input/output/shape is not (operators.md notes)
  dtype                  tensor types TensorRT cannot hold (string, int16, uint16/32/64, complex, double)
  qdq-scale              Q/DQ scales must be build-time constants
  qdq-zero-point         zero points must be constant and 0, and signed (no uint8/uint4)
  qdq-activation-scale   activations quantize per tensor (one scale)
  qdq-weight-axis        per-channel weight scales run along the output-channel axis of the consumer
  int4-blocking          INT4 is weight-only; blocks run along the last or second-to-last dim
  int4-even              INT4 tensors hold an even number of elements (two per byte)
  plugin                 custom ops match one of our plugin creators: name, version, namespace, fields

Weights are not loaded: only the zero-point tensors the rules read (small) come from external data.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from enginesmith.builder import trt_ops
from enginesmith.core.errors import UserError

EXIT_FINDINGS = 4  # the CLI's exit code when the graph has findings (0 clean, 2 bad input)
_BAD_DTYPES: dict[int, str] = {TensorProto.STRING: "string", TensorProto.INT16: "int16", TensorProto.UINT16: "uint16",
               TensorProto.UINT32: "uint32", TensorProto.UINT64: "uint64", TensorProto.COMPLEX64: "complex64",
               TensorProto.COMPLEX128: "complex128"}
_INT4: set[int] = {TensorProto.INT4, TensorProto.UINT4}
_DEFAULT_DOMAINS = ("", "ai.onnx")


@dataclass(frozen=True)
class Finding:
    rule: str
    node: str
    op_type: str
    message: str
    fix: str

    def __str__(self) -> str:
        where = f"{self.node} ({self.op_type})" if self.node else "graph"
        return f"[{self.rule}] {where}: {self.message} (fix: {self.fix})"


class Graph:
    """Read-only view of a model: constants, tensor types/shapes and consumers, weights left on disk."""

    def __init__(self, model: onnx.ModelProto, base_dir: Path | None = None) -> None:
        try:
            model = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        except Exception:  # shapes are a help, not a requirement
            pass
        self.model = model
        self.base_dir = base_dir
        self.nodes = list(_walk(model.graph))
        self.initializers = {t.name: t for t in model.graph.initializer}
        self.constant_nodes = {o: n for n in self.nodes if n.op_type == "Constant" for o in n.output}
        self.types: dict[str, tuple[int, list[int | None] | None]] = {}
        for vi in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
            tt = vi.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim] \
                if tt.HasField("shape") else None
            self.types[vi.name] = (tt.elem_type, dims)
        for t in model.graph.initializer:
            self.types[t.name] = (t.data_type, list(t.dims))
        self.consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
        for n in self.nodes:
            for i, name in enumerate(n.input):
                self.consumers.setdefault(name, []).append((n, i))

    def is_constant(self, name: str) -> bool:
        return name in self.initializers or name in self.constant_nodes

    def value(self, name: str) -> np.ndarray | None:
        """A constant's value (loads just this tensor's external data), or None if not constant."""
        if name in self.initializers:
            tensor = self.initializers[name]
            if tensor.data_location == TensorProto.EXTERNAL and self.base_dir is None:
                return None
            return numpy_helper.to_array(tensor, base_dir=str(self.base_dir or ""))
        node = self.constant_nodes.get(name)
        if node is not None:
            for a in node.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
        return None

    def dtype(self, name: str) -> int | None:
        return self.types.get(name, (None, None))[0]

    def shape(self, name: str) -> list[int | None] | None:
        return self.types.get(name, (None, None))[1]


def _walk(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _walk(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _walk(g)


def _attr(node: onnx.NodeProto, name: str, default: object = None) -> object:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _input(node: onnx.NodeProto, i: int) -> str:
    return node.input[i] if len(node.input) > i else ""


def _version(v: trt_ops.Version) -> str:
    return f"{v[0]}.{v[1]}"


# ----------------------------------------------------------------------------- rules

def check_opset(g: Graph, target: trt_ops.Version) -> Iterator[Finding]:
    ceiling, source = trt_ops.opset_ceiling(target)
    for imp in g.model.opset_import:
        if imp.domain in _DEFAULT_DOMAINS and not trt_ops.MIN_OPSET <= imp.version <= ceiling:
            yield Finding("opset", "", "", f"default-domain opset {imp.version} is outside TensorRT "
                          f"{_version(target)}'s range {trt_ops.MIN_OPSET}..{ceiling} ({source})",
                          f"export with --opset {ceiling} or lower, or target a newer TensorRT")


def check_op(g: Graph, node: onnx.NodeProto, target: trt_ops.Version) -> Iterator[Finding]:
    name, op = node.name, node.op_type
    if node.domain not in _DEFAULT_DOMAINS:
        return  # plugins: check_plugin
    if op in trt_ops.UNSUPPORTED:
        note = trt_ops.UNSUPPORTED[op]
        yield Finding("unsupported-op", name, op, f"TensorRT's ONNX parser does not import {op}",
                      note or "rewrite it with supported ops or implement it as a plugin")
        return
    since = trt_ops.supported_since(op)
    if since is None:
        if not any(c.name == op for c in trt_ops.PLUGIN_CREATORS):
            yield Finding("unsupported-op", name, op, f"{op} is not in TensorRT's ONNX operator support list "
                          "and no plugin creator of ours is named so",
                          "rewrite it with supported ops or implement it as a plugin")
        return
    if since > target:
        fix = ("export with --opset 22 or lower so attention and norms stay decomposed (TensorRT fuses "
               "MatMul-Softmax-MatMul itself)" if op in ("Attention", "RMSNormalization", "RotaryEmbedding")
               else "keep the KV cache as Concat (dense layout)" if op == "TensorScatter"
               else "rewrite it with older ops")
        yield Finding("unsupported-op", name, op, f"{op} is imported only since TensorRT {_version(since)}, "
                      f"the target is {_version(target)}", fix + f", or target TensorRT >= {_version(since)}")
        return
    yield from _restrictions(g, node)


def _rank(g: Graph, name: str) -> int | None:
    shape = g.shape(name)
    return None if shape is None else len(shape)


def _restrictions(g: Graph, node: onnx.NodeProto) -> Iterator[Finding]:
    """The 'Restrictions' column of operators.md, for the ops an LLM graph uses."""
    name, op = node.name, node.op_type

    def bad(message: str, fix: str) -> Finding:
        return Finding("unsupported-attribute", name, op, message, fix)

    if op == "Attention":
        for i, what in ((4, "past_key"), (5, "past_value"), (6, "nonpad_kv_seqlen")):
            if _input(node, i):
                yield bad(f"input {what} is not supported by TensorRT's IAttention",
                          "keep the KV cache outside Attention (Concat or TensorScatter before it)")
        for i, what in ((1, "present_key"), (2, "present_value"), (3, "qk_matmul_output")):
            if len(node.output) > i and node.output[i]:
                yield bad(f"output {what} is not supported", "produce the cache outside Attention")
        # Explicit defaults are fine (the exporter writes them); other values are not imported.
        if _attr(node, "qk_matmul_output_mode", 0) != 0:
            yield bad("attribute qk_matmul_output_mode is not supported", "leave it at 0")
        if _attr(node, "softcap", 0.0) != 0.0:
            yield bad("attribute softcap is not supported", "apply the soft cap outside Attention or drop it")
        for i, what in ((0, "Q"), (1, "K"), (2, "V")):
            rank = _rank(g, _input(node, i))
            if rank is not None and rank != 4:
                yield bad(f"{what} is {rank}-D; TensorRT takes 4-D [B, H, S, D] (q/kv_num_heads come from shapes)",
                          "reshape Q, K, V to 4-D before Attention")
    elif op == "TensorScatter":
        if _attr(node, "axis", -2) != -2:
            yield bad(f"axis={_attr(node, 'axis')}; TensorRT's IKVCacheUpdateLayer needs axis -2",
                      "lay the cache out as [B, H, S, D] and scatter along -2")
        for i, what in ((0, "past_cache"), (1, "update")):
            rank = _rank(g, _input(node, i))
            if rank is not None and rank != 4:
                yield bad(f"{what} is {rank}-D, must be 4-D", "use [B, H, S, D] caches")
    elif op == "RotaryEmbedding":
        pos = _input(node, 3)
        if pos and g.dtype(pos) not in (None, 0, TensorProto.INT64):
            yield bad("position_ids must be int64", "Cast position_ids to int64")
    elif op == "TopK":
        if _attr(node, "sorted", 1) != 1:
            yield bad("sorted must be 1", "set sorted=1")
        k = g.value(_input(node, 1)) if _input(node, 1) else None
        if k is not None and int(np.asarray(k).reshape(-1)[0]) >= 3840:
            yield bad(f"K={int(np.asarray(k).reshape(-1)[0])} must be < 3840", "take a smaller K")
    elif op == "ScatterND" and _attr(node, "reduction", b"none") not in (b"none", "none"):
        yield bad("reduction other than none is not supported", "use ScatterElements or rewrite")
    elif op == "LayerNormalization" and any(o for o in node.output[1:]):
        yield bad("only the first output Y is supported", "drop Mean/InvStdDev outputs")
    elif op == "Constant":
        for a in node.attribute:
            if a.name in ("sparse_value", "value_string", "value_strings"):
                yield bad(f"attribute {a.name} is not supported", "use a dense numeric constant")
    elif op in ("CumSum", "OneHot"):
        i = 1
        if _input(node, i) and not g.is_constant(_input(node, i)):
            what = "axis" if op == "CumSum" else "depth"
            yield bad(f"{what} must be a build-time constant", f"make {what} an initializer")
    elif op == "Dropout":
        training = _input(node, 2)
        if training and (not g.is_constant(training) or bool(np.asarray(g.value(training)).any())):
            yield bad("training_mode must be a constant False", "export in eval mode")
    elif op.startswith("Reduce") and _input(node, 1) and not g.is_constant(_input(node, 1)):
        yield bad("axes must be an initializer", "make axes a constant")


def check_dtypes(g: Graph) -> Iterator[Finding]:
    seen: set[str] = set()
    for n in g.nodes:
        for name in [*n.input, *n.output]:
            dt = g.dtype(name)
            if name and name not in seen and dt in _BAD_DTYPES:
                seen.add(name)
                yield Finding("dtype", n.name, n.op_type, f"tensor {name!r} is {_BAD_DTYPES[dt]}, "
                              "which TensorRT has no type for", "Cast it to int32/int64/float earlier")


def check_qdq(g: Graph, node: onnx.NodeProto) -> Iterator[Finding]:
    if node.domain not in _DEFAULT_DOMAINS or node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
        return
    name, op = node.name, node.op_type
    x, scale, zp = _input(node, 0), _input(node, 1), _input(node, 2)
    # The quantized type: the zero point's, else DQ's input, else Q's output_dtype (opset 21).
    qtype = g.dtype(zp) if zp else g.dtype(x) if op == "DequantizeLinear" else _attr(node, "output_dtype")
    if scale and not g.is_constant(scale):
        yield Finding("qdq-scale", name, op, f"scale {scale!r} is computed at run time",
                      "make the scale an initializer")
    if zp:
        value = g.value(zp)
        if not g.is_constant(zp):
            yield Finding("qdq-zero-point", name, op, f"zero point {zp!r} is not a constant", "use a zero initializer")
        elif value is not None and np.any(value.astype(np.float64) != 0):
            yield Finding("qdq-zero-point", name, op, "zero point is not 0 (TensorRT quantizes symmetrically)",
                          "requantize symmetrically (zero points 0)")
    if qtype in (TensorProto.UINT8, TensorProto.UINT4):
        yield Finding("qdq-zero-point", name, op, f"{TensorProto.DataType.Name(qtype).lower()} quantization is "
                      "asymmetric; TensorRT takes signed types only", "quantize to int8 / int4 with zero points 0")
    weight = g.is_constant(x) if op == "DequantizeLinear" else False
    axis = int(_attr(node, "axis", 1))  # type: ignore[call-overload]
    block = int(_attr(node, "block_size", 0))  # type: ignore[call-overload]
    scale_shape = g.shape(scale) or []
    scale_size = math.prod(d or 0 for d in scale_shape) if scale_shape else 1
    if not weight:
        if scale_size != 1:
            yield Finding("qdq-activation-scale", name, op, f"activation {x!r} has {scale_size} scales "
                          "(per-channel or blocked); TensorRT quantizes activations per tensor",
                          "use one scale for the whole activation")
        if qtype in _INT4:
            yield Finding("int4-blocking", name, op, "INT4 on an activation; TensorRT's INT4 is weight-only",
                          "keep activations in int8/float (W4A16)")
        return
    shape = g.shape(x) or []
    rank = len(shape)
    if qtype in _INT4:
        count = math.prod(d or 0 for d in shape)
        if count % 2:
            yield Finding("int4-even", name, op, f"INT4 weight {x!r} has {count} elements (odd)",
                          "pad the weight to an even element count")
    if block > 0:
        norm = axis % rank if rank else axis
        if rank and norm not in (rank - 1, rank - 2):
            yield Finding("int4-blocking", name, op, f"blocks run along axis {axis} of a {rank}-D weight; "
                          "TensorRT blocks only the last or second-to-last dim",
                          "transpose the weight so its blocked dim is one of the last two")
        elif rank and scale_shape and len(scale_shape) == rank:
            want = [(-(-(d or 0) // block) if i == norm else d) for i, d in enumerate(shape)]
            if list(scale_shape) != want:
                yield Finding("int4-blocking", name, op, f"scale shape {scale_shape} does not match weight "
                              f"{shape} in blocks of {block} along axis {axis} (expected {want})",
                              "give one scale per block")
        return
    if scale_size <= 1 or not rank:
        return
    expected = _channel_axis(g, node.output[0], rank)
    norm = axis % rank
    if expected is not None and norm != expected:
        yield Finding("qdq-weight-axis", name, op, f"per-channel scales run along axis {axis}; the consumer's "
                      f"output channels are axis {expected}", f"quantize per channel along axis {expected}")
    elif scale_shape and shape[norm] not in (None, scale_size):
        yield Finding("qdq-weight-axis", name, op, f"{scale_size} scales for {shape[norm]} channels on axis {axis}",
                      "give one scale per output channel")


def _channel_axis(g: Graph, dq_out: str, rank: int) -> int | None:
    """Output-channel axis of a weight, from the op that consumes the dequantized tensor."""
    for consumer, index in g.consumers.get(dq_out, []):
        if consumer.op_type == "MatMul" and index == 1:
            return rank - 1                      # B [.., K, N]
        if consumer.op_type == "Gemm" and index == 1:
            return 0 if _attr(consumer, "transB", 0) else 1
        if consumer.op_type == "Conv" and index == 1:
            return 0                             # W [Cout, Cin/g, ...]
        if consumer.op_type == "ConvTranspose" and index == 1:
            return 1                             # W [Cin, Cout/g, ...]
    return None


def check_plugin(g: Graph, node: onnx.NodeProto, target: trt_ops.Version) -> Iterator[Finding]:
    """A node the parser hands to the plugin registry: op_type = creator name, plugin_version/namespace."""
    is_default = node.domain in _DEFAULT_DOMAINS
    if is_default and trt_ops.supported_since(node.op_type) is not None:
        return
    if is_default and node.op_type in trt_ops.UNSUPPORTED:
        return
    name, op = node.name, node.op_type
    if node.domain == "com.microsoft":
        yield Finding("unsupported-op", name, op, f"com.microsoft.{op} is an ONNX Runtime contrib op",
                      "build from the graph before the ONNX Runtime lowering (lower for trt instead)")
        return
    creators = [c for c in trt_ops.PLUGIN_CREATORS if c.name == op]
    if not creators:
        if not is_default:
            yield Finding("plugin", name, op, f"no plugin creator named {op!r} in our plugin library "
                          f"(domain {node.domain!r})", "implement the plugin or rewrite the node with ONNX ops")
        return
    version = _attr(node, "plugin_version", b"1")
    version = version.decode() if isinstance(version, bytes) else str(version)
    namespace_attr = _attr(node, "plugin_namespace")
    if namespace_attr is not None:
        namespace = namespace_attr.decode() if isinstance(namespace_attr, bytes) else str(namespace_attr)
    else:
        namespace = node.domain if target >= trt_ops.NAMESPACE_FROM_DOMAIN_SINCE else ""
    creator = next((c for c in creators if c.version == version), None)
    if creator is None:
        yield Finding("plugin", name, op, f"plugin_version {version!r}; our library has "
                      f"{', '.join(c.version for c in creators)}", "set plugin_version to a version we build")
        return
    if namespace != creator.namespace:
        how = ("TensorRT < 10.10 ignores the node's domain" if namespace_attr is None and node.domain
               else f"namespace {namespace!r}")
        yield Finding("plugin", name, op, f"resolves to {how}; the creator is registered in "
                      f"namespace {creator.namespace!r}", f'set attribute plugin_namespace="{creator.namespace}"')
    fields = {f.name: f for f in creator.fields}
    attrs = {a.name: a for a in node.attribute if a.name not in trt_ops.PARSER_PLUGIN_ATTRIBUTES}
    for extra in sorted(set(attrs) - set(fields)):
        yield Finding("plugin", name, op, f"attribute {extra!r} is not a field of the {op} creator "
                      "(TensorRT passes only getFieldNames() fields; it would be dropped)",
                      f"remove it; fields are {', '.join(fields)}")
    for f in creator.fields:
        a = attrs.get(f.name)
        if a is None:
            if f.required:
                yield Finding("plugin", name, op, f"required field {f.name!r} is missing", f"add attribute {f.name}")
            continue
        ok = {"int32": a.type == onnx.AttributeProto.INT,
              "float32": a.type == onnx.AttributeProto.FLOAT,
              "half-tensor": a.type == onnx.AttributeProto.TENSOR
              and a.t.data_type in (TensorProto.FLOAT16, TensorProto.BFLOAT16)}[f.kind]
        if not ok:
            yield Finding("plugin", name, op, f"field {f.name!r} has the wrong type "
                          f"({onnx.AttributeProto.AttributeType.Name(a.type)})",
                          {"int32": "make it an int attribute", "float32": "make it a float attribute",
                           "half-tensor": "make it a float16 or bfloat16 tensor attribute"}[f.kind])
        elif f.kind == "int32" and not -2**31 <= a.i < 2**31:
            yield Finding("plugin", name, op, f"field {f.name!r}={a.i} does not fit int32", "use a smaller value")


# ----------------------------------------------------------------------------- entry points

def lint(model: onnx.ModelProto | str | Path, target: str = trt_ops.DEFAULT_TARGET) -> list[Finding]:
    """Every finding for `model` (a ModelProto or a path to .onnx) against TensorRT `target`."""
    try:
        version = trt_ops.parse_target(target)
    except ValueError as exc:
        raise UserError(str(exc), "pass --trt-version like 10.15 or 11") from None
    base_dir = None
    if not isinstance(model, onnx.ModelProto):
        path = Path(model)
        if path.is_dir():
            path = path / "model.onnx"
        if not path.is_file():
            raise UserError(f"{path} does not exist", "give an .onnx file or an engine directory")
        try:
            model = onnx.load(str(path), load_external_data=False)
        except Exception as exc:
            raise UserError(f"{path} is not an ONNX model ({type(exc).__name__})", "give an .onnx file") from None
        base_dir = path.parent
    g = Graph(model, base_dir)
    findings = list(check_opset(g, version))
    findings += check_dtypes(g)
    for node in g.nodes:
        findings += check_op(g, node, version)
        findings += check_qdq(g, node)
        findings += check_plugin(g, node, version)
    return findings


def main(argv: list[str] | None = None) -> int:
    """`python -m enginesmith.builder.trt_lint MODEL [--trt-version V] [--json]`: 0 clean, 4 findings, 2 bad input."""
    parser = argparse.ArgumentParser(prog="enginesmith trt-lint",
                                     description="Check an ONNX graph against TensorRT's ONNX parser, without TensorRT.")
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="an .onnx file or an engine directory (its model.onnx)")
    parser.add_argument("--trt-version", default=trt_ops.DEFAULT_TARGET,
                        help=f"TensorRT version to check against (default {trt_ops.DEFAULT_TARGET}; e.g. 10.3 for "
                             "JetPack 6, 10.13 for JetPack 7, 11)")
    parser.add_argument("--json", action="store_true", help="print findings as JSON")


def run(args: argparse.Namespace) -> int:
    """The `trt-lint` verb: print the findings; return 0 (clean) or EXIT_FINDINGS. Bad input raises UserError."""
    findings = lint(args.model, args.trt_version)
    if args.json:
        print(json.dumps([asdict(f) for f in findings], indent=2))
    else:
        for f in findings:
            print(f)
        print(f"{len(findings)} finding(s) for TensorRT {args.trt_version}", file=sys.stderr)
    return EXIT_FINDINGS if findings else 0


if __name__ == "__main__":
    sys.exit(main())
