"""sparsify: prune linears to 2:4 semi-structured sparsity and mark them `enginesmith.SparseGemm24`.

    x [.., K] ─ MatMul(W [K, N]) ─ y         every aligned group of 4 weights along K (per output n)
                                             keeps its 2 highest-scoring entries:
      magnitude   score = |W[k, n]|
      wanda       score = |W[k, n]| · ‖X[:, k]‖   (Sun et al. 2023; ‖X_k‖ from calibration: the RMS of
                                                   input channel k over the sampled token rows, the
                                                   norm up to a factor common to a row's groups)

The plugin (plugins/sparse_gemm) is worth a second code path only where it beats the dense GEMM:
`profitability.sparse_is_profitable(K, N, tokens)` (measured per GPU) decides per layer, and a
layer where sparse does not pay stays dense and unpruned (`only_profitable=false` prunes every
linear, e.g. to measure what 2:4 costs in accuracy). The lm_head stays dense unless asked.

Lowerings (`lower`):
  ort   the pruned weight stays in the same MatMul/Gemm: ONNX Runtime runs it dense (same numbers
        as the TensorRT engine, so accuracy is measured on CPU)
  trt   SparseGemm24 plugin node (plugin_version "1", plugin_namespace "enginesmith"; fields
        `weight` = W [N, K] as a float16/bfloat16 tensor attribute, `out_features`, `in_features`),
        + Add for a Gemm bias; float16/bfloat16 graphs only, N and K multiples of 16
  none  enginesmith.SparseGemm24(x, W [N, K]) [+ Add(bias)]: the IR op, for `lower_sparse`

Where the weights live: with `ort` and `none`, W is an initializer and goes to the external data
file like every other weight. The plugin takes W as a build-time *field* (it has one input, X, and
compresses W once when the engine is built), and TensorRT's ONNX parser fills plugin fields from
node attributes only; so with `trt` every W is a tensor attribute, serialized inside the ONNX
protobuf, which cannot exceed 2 GiB. W goes in dense (zeros included, the plugin compresses it), so
that is about a billion sparsified float16 parameters: the lowering refuses more with a UserError
instead of failing in the protobuf writer when the graph is saved.

Lossy: measured by perplexity (benchmarks/sparsity/), not compared by the pass manager.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from enginesmith.core.errors import UserError
from enginesmith.core.io_names import GRAPH_DOMAIN as DOMAIN, TRT_DOMAIN
from enginesmith.passes.machinery.edit import Namer, set_constant
from enginesmith.passes.analysis.linears import Linear, find_linears, select
from enginesmith.passes.machinery.match import Rejection
from enginesmith.passes.machinery.registry import PassContext, PassResult, register
from enginesmith.plugins.limits import limits as kernel_limits
from enginesmith.plugins.profitability import load_table, sparse_is_profitable

METHODS = ("magnitude", "wanda")
LOWERINGS = ("ort", "trt", "none")
METADATA_KEY = "enginesmith.sparsity"
HALF = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
# Bytes of tensor attributes one ONNX file can hold: protobuf's 2 GiB message limit, less room for
# the rest of the serialized graph (nodes, names, small inline initializers).
INLINE_LIMIT = 2**31 - (64 << 20)


@dataclass(frozen=True)
class SparsifyParams:
    method: str = "wanda"
    lower: str = "ort"
    tokens: int = 256             # rows of X per GEMM call the engine is built for (prefill chunk)
    only_profitable: bool = True  # keep dense (unpruned) the layers where 2:4 does not pay
    profitability: str = ""       # JSON table (plugins/sparse_gemm/profitability.json by default)
    include_lm_head: bool = False

    def __post_init__(self):
        if self.method not in METHODS:
            raise UserError(f"sparsify method={self.method!r} is not one of {', '.join(METHODS)}",
                            "use method=magnitude or method=wanda")
        if self.lower not in LOWERINGS:
            raise UserError(f"sparsify lower={self.lower!r} is not one of {', '.join(LOWERINGS)}",
                            "use lower=ort (dense on ONNX Runtime), trt (plugin) or none (IR op)")
        if not isinstance(self.tokens, int) or self.tokens < 1:
            raise UserError(f"sparsify tokens={self.tokens!r} must be a positive integer",
                            "give the GEMM rows per call the engine serves, e.g. 256")


@dataclass(frozen=True)
class LowerSparseParams:
    target: str = "ort"

    def __post_init__(self):
        if self.target not in LOWERINGS[:2]:
            raise UserError(f"lower_sparse target={self.target!r} is not ort or trt", "use ort or trt")


# ----------------------------------------------------------------------------- 2:4 math

def prune_24(w_nk: np.ndarray, score_nk: np.ndarray) -> np.ndarray:
    """W [N, K] with the 2 lowest-scoring entries of every aligned group of 4 along K set to 0."""
    n, k = w_nk.shape
    groups = score_nk.reshape(n, k // 4, 4)
    drop = np.argsort(groups, axis=-1, kind="stable")[..., :2]             # [N, K/4, 2]
    mask = np.ones(groups.shape, dtype=bool)
    np.put_along_axis(mask, drop, False, axis=-1)
    return np.where(mask.reshape(n, k), w_nk, np.zeros((), w_nk.dtype))


def check_24(w_nk: np.ndarray, name: str = "weight") -> None:
    """Raise UserError when W [N, K] has more than 2 nonzeros in an aligned group of 4 along K
    (naming the first bad row/columns and how many groups are bad, as the plugin's creator does)."""
    n, k = w_nk.shape
    if k % 4:
        raise UserError(f"{name}: in_features {k} is not a multiple of 4", "2:4 groups run along K")
    bad = np.count_nonzero(w_nk.reshape(n, k // 4, 4), axis=-1) > 2
    if bad.any():
        row, group = np.argwhere(bad)[0]
        raise UserError(f"{name} is not 2:4 sparse: row {row}, columns {4 * group}..{4 * group + 3} hold more than "
                        f"2 nonzeros ({int(bad.sum())} bad groups of 4 in all)",
                        "prune it with the sparsify pass (magnitude or Wanda) first")


def sparse_gemm24_reference(x: np.ndarray, w_nk: np.ndarray) -> np.ndarray:
    """The oracle of enginesmith.SparseGemm24: Y[.., N] = X[.., K] · Wᵀ, W 2:4 along K (checked)."""
    check_24(w_nk)
    if x.shape[-1] != w_nk.shape[1]:
        raise UserError(f"x has {x.shape[-1]} features, the weight expects {w_nk.shape[1]}",
                        "give X [.., in_features]")
    return (x.astype(np.float32) @ w_nk.astype(np.float32).T).astype(x.dtype)


def channel_norms(rows: np.ndarray) -> np.ndarray:
    """‖X[:, k]‖ up to a common factor: the RMS of each input channel over calibration rows [R, K]."""
    return np.sqrt(np.mean(np.square(rows.astype(np.float64)), axis=0)).astype(np.float32)


def plugin_dim_align() -> int:
    """cuSPARSELt's shape rule (N and K multiples of this) as plugins/limits.json defines it for the plugin."""
    return int(kernel_limits()["sparse_gemm"]["dim_align"])


# ----------------------------------------------------------------------------- choosing layers

def _choose(linears: list[Linear], params: SparsifyParams, table) -> tuple[list[Linear], list[Rejection]]:
    chosen, skipped = [], []
    for lin in linears:
        why = None
        if lin.k % 4:
            why = f"in_features {lin.k} is not a multiple of 4"
        elif params.only_profitable and not sparse_is_profitable(lin.k, lin.n, params.tokens, table):
            why = (f"sparse does not pay for K={lin.k} N={lin.n} at {params.tokens} tokens "
                   f"(profitability table of {table.get('device', '?')}); kept dense")
        if why:
            skipped.append(Rejection("sparsify", lin.name, why, lin.node))
        else:
            chosen.append(lin)
    return chosen, skipped


def _scores(lin: Linear, w_nk: np.ndarray, params: SparsifyParams, stats) -> np.ndarray:
    score = np.abs(w_nk.astype(np.float32))
    if params.method == "wanda":
        score = score * channel_norms(stats[lin.x.name].rows)[None, :]
    return score


# ----------------------------------------------------------------------------- marking and lowering

def _mark(graph: ir.Graph, namer: Namer, lin: Linear, w_nk: np.ndarray, dtype: ir.DataType) -> ir.Node:
    """Replace the linear by enginesmith.SparseGemm24(x, W [N, K]) [+ Add(bias)]."""
    w = ir.Value(name=namer(f"{lin.weight.name}_24"), shape=ir.Shape(w_nk.shape), type=ir.TensorType(dtype))
    w.const_value = ir.Tensor(np.ascontiguousarray(w_nk.astype(ir.DataType(dtype).numpy())), name=w.name)
    graph.register_initializer(w)
    node = ir.Node(DOMAIN, "SparseGemm24", [lin.x, w], num_outputs=1, name=namer(f"{lin.name}_24"))
    new_nodes, out = [node], node.outputs[0]
    out.name = namer(f"{lin.name}_24_out")
    if lin.bias is not None:
        add = ir.Node("", "Add", [out, lin.bias], num_outputs=1, name=namer(f"{lin.name}_24_bias"))
        new_nodes.append(add)
        out = add.outputs[0]
    old = [lin.node] + ([lin.transposed_by] if lin.transposed_by is not None else [])
    ir.convenience.replace_nodes_and_values(graph, lin.node, old, new_nodes, [lin.node.outputs[0]], [out])
    return node


def _sparse_nodes(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.domain == DOMAIN and n.op_type == "SparseGemm24"]


def _lower_ort(graph: ir.Graph, namer: Namer, node: ir.Node) -> None:
    x, w = node.inputs
    wt = ir.Value(name=namer(f"{w.name}_kn"), shape=ir.Shape([w.shape[1], w.shape[0]]), type=w.type)
    wt.const_value = ir.Tensor(np.ascontiguousarray(w.const_value.numpy().T), name=wt.name)
    graph.register_initializer(wt)
    mm = ir.Node("", "MatMul", [x, wt], num_outputs=1, name=namer(f"{node.name}_dense"))
    ir.convenience.replace_nodes_and_values(graph, node, [node], [mm], [node.outputs[0]], [mm.outputs[0]])


def _lower_trt(graph: ir.Graph, namer: Namer, node: ir.Node, align: int) -> None:
    x, w = node.inputs
    w_nk = w.const_value.numpy()
    n, k = w_nk.shape
    where = f"SparseGemm24 {node.name!r}"
    if w.const_value.dtype not in HALF or x.type.dtype != w.const_value.dtype:
        raise UserError(f"{where}: the TensorRT plugin runs float16/bfloat16, the graph is {x.type.dtype}",
                        "export with --dtype fp16 (or bf16) before lowering for TensorRT")
    if n % align or k % align:
        raise UserError(f"{where}: out_features {n} and in_features {k} must be multiples of {align} (cuSPARSELt)",
                        "keep this layer dense (lower=ort) or pad the model")
    check_24(w_nk, f"{where} weight")
    attrs = [ir.AttrTensor("weight", ir.Tensor(np.ascontiguousarray(w_nk), name="weight")),
             ir.AttrInt64("out_features", n), ir.AttrInt64("in_features", k),
             ir.AttrString("plugin_version", "1"), ir.AttrString("plugin_namespace", DOMAIN)]
    new = ir.Node(TRT_DOMAIN, "SparseGemm24", [x], attrs, num_outputs=1, name=namer(f"{node.name}_trt"))
    ir.convenience.replace_nodes_and_values(graph, node, [node], [new], [node.outputs[0]], [new.outputs[0]])


def _check_inline_size(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    """Refuse plugin weights that, as tensor attributes, would not fit one protobuf (checked before
    any weight is copied into an attribute)."""
    weights = sum(n.inputs[1].const_value.nbytes for n in nodes)
    inline = sum(a.value.nbytes for n in graph for a in n.attributes.values() if a.type == ir.AttributeType.TENSOR)
    if weights + inline > INLINE_LIMIT:
        raise UserError(f"the SparseGemm24 TensorRT plugin takes its weights as node attributes, stored inside "
                        f"the ONNX protobuf, which holds at most {INLINE_LIMIT / 2**20:.1f} MiB of them: with these "
                        f"{len(nodes)} layers the graph would hold {(weights + inline) / 2**20:.1f} MiB",
                        "sparsify fewer layers for TensorRT (only_profitable=true, include_lm_head=false), or use "
                        "lower=ort (the pruned weights stay in MatMul initializers, in external data, run dense)")


def lower_sparse_graph(model: ir.Model, target: str) -> int:
    """Lower every enginesmith.SparseGemm24 node for `target` (ort | trt); returns the count."""
    nodes = _sparse_nodes(model)
    graph, namer = model.graph, Namer(model.graph)
    align = 0
    if target == "trt" and nodes:
        _check_inline_size(graph, nodes)
        align = plugin_dim_align()
    for node in nodes:
        if target == "ort":
            _lower_ort(graph, namer, node)
        else:
            _lower_trt(graph, namer, node, align)
    if nodes and target == "trt":
        model.opset_imports[TRT_DOMAIN] = 1
    if not _sparse_nodes(model):
        model.opset_imports.pop(DOMAIN, None)
    return len(nodes)


# ----------------------------------------------------------------------------- the passes

@register("sparsify", SparsifyParams, exact=False, calibrated=lambda p: p.method == "wanda")
def sparsify(model: ir.Model, params: SparsifyParams | None = None, ctx: PassContext | None = None) -> PassResult:
    """Prune linears to 2:4 (magnitude, or Wanda |W|·‖X‖ from calibration) where the sparse GEMM pays,
    marked enginesmith.SparseGemm24; lowered dense for ONNX Runtime or to the TensorRT plugin. Lossy.
    Only method=wanda needs calibration data."""
    params = params or SparsifyParams()
    linears, rejected = find_linears(model)
    candidates, skipped = select(linears, params.include_lm_head)
    table = None
    if params.only_profitable:
        table = load_table(params.profitability or None)
    chosen, unprofitable = _choose(candidates, params, table)
    stats = {}
    if params.method == "wanda" and chosen:
        if ctx is None:
            raise UserError("sparsify method=wanda needs calibration data", "pass a calibration set, or "
                            "use method=magnitude")
        stats = ctx.stats(sorted({lin.x.name for lin in chosen}))
    graph, namer = model.graph, Namer(model.graph)
    details = []
    for lin in chosen:  # collect the layers first, then change the graph
        dtype = lin.weight.const_value.dtype
        w_nk = lin.weight_kn().T                                             # [N, K] float32
        pruned = prune_24(w_nk, _scores(lin, w_nk, params, stats))
        kept = float(np.abs(pruned).sum() / max(np.abs(w_nk).sum(), 1e-30))
        details.append({"linear": lin.name, "K": lin.k, "N": lin.n, "kept_l1": round(kept, 4)})
        if params.lower == "ort":
            stored = pruned.T if lin.k_axis == 0 else pruned
            set_constant(graph, namer, lin.reader, lin.weight, stored)
        else:
            _mark(graph, namer, lin, pruned, dtype)
    if chosen and params.lower != "ort":
        model.opset_imports[DOMAIN] = 1
        if params.lower == "trt":
            lower_sparse_graph(model, "trt")
    model.metadata_props[METADATA_KEY] = json.dumps(
        {"pattern": "2:4", "method": params.method, "layers": [d["linear"] for d in details],
         "lower": params.lower})
    counts = {"pruned_24": len(chosen), "kept_dense_unprofitable": len(unprofitable),
              "skipped": len(skipped) + len(rejected)}
    return PassResult(counts, skipped + unprofitable + rejected, details)


@register("lower_sparse", LowerSparseParams, exact=False)
def lower_sparse(model: ir.Model, params: LowerSparseParams | None = None, ctx: PassContext | None = None) -> PassResult:
    """enginesmith.SparseGemm24 (sparsify:lower=none) -> dense MatMul (ort) or the TensorRT plugin
    node (trt). Not compared by the manager: its input does not run on ONNX Runtime."""
    params = params or LowerSparseParams()
    return PassResult({"lowered": lower_sparse_graph(model, params.target)})
