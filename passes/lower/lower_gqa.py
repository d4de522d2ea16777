"""lower_gqa: exported attention with a growing KV cache -> com.microsoft.GroupQueryAttention over
one fixed KV buffer per layer, which the runtime binds as both past and present (ORT CUDA's fast
decode path: no concat, no copy, CUDA-graph friendly).

Dimension legend: B batch, S new tokens, C KV capacity (buffer length), H query heads, Hkv key/value
heads, D head size, E hidden size.

    x ─ MatMul(Wq)[+bq] ─ Reshape ─ Transpose ─ rotary(cos,sin) ─────────────────────────┐
    x ─ MatMul(Wk)[+bk] ─ Reshape ─ Transpose ─ rotary(cos,sin) ─ Concat(past_k) ─[repeat]┤ Attention ─ Transpose ─ Reshape ─▶
    x ─ MatMul(Wv)[+bv] ─ Reshape ─ Transpose ──────────────────── Concat(past_v) ─[repeat]┘   (mask)
                                                           └▶ present_k / present_v (graph outputs)
  =>
    x ─ MatMul([Wq|Wk|Wv])[+b] ─ GroupQueryAttention(packed qkv, past_k, past_v, seqlens_k,
                                 total_sequence_length, cos_cache, sin_cache; do_rotary) ─▶
                                 └▶ present_k / present_v: the same [B, Hkv, C, D] buffers

rotary is ONNX RotaryEmbedding or its decomposition x*cos + rotate_half(x)*sin. cos/sin are the
graph's own tables: the subgraph that computes them from `position_ids` is evaluated at positions
0..C-1, so any RoPE variant (scaled, llama3) that is a function of the position comes along.

Interface after the pass: inputs input_ids [B, S], seqlens_k int32 [B] (tokens in the cache after
this step, minus 1), total_sequence_length int32 scalar (the longest row's), past_key_values.* [B,
Hkv, C, D]; attention_mask and position_ids are gone: GQA masks causally by per-row lengths, and
positions are the row's cache positions. A layer with a sliding window of W tokens (the export's
`enginesmith.attention` metadata) gets local_window_size = W. That is exact for caches without holes (no left padding);
the runtime (runtime/engines/ort_cuda.py) keeps rows contiguous from slot 0. The pass is checked against the
unlowered graph by tests/passes/test_lower_gqa.py (the pass manager cannot feed the new interface).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass
from onnxscript.rewriter import pattern as _p

from enginesmith.core.errors import UserError
from enginesmith.export import attention_meta
from enginesmith.core import io_names
from enginesmith.core.io_names import MS_DOMAIN
from enginesmith.passes.machinery import match
from enginesmith.passes.machinery.edit import Namer, add_initializer, drop_unused_initializers
from enginesmith.passes.machinery.match import Match, Rejection, Rule, gqa_repeat
from enginesmith.passes.machinery.registry import PassContext, PassResult, register

SEQLENS, TOTAL = "seqlens_k", "total_sequence_length"
CAPACITY_KEY = "enginesmith.kv_capacity"


@dataclass(frozen=True)
class LowerGqaParams:
    capacity: int = 4096   # KV buffer length C: rotary tables cover positions 0..C-1

    def __post_init__(self):
        if not isinstance(self.capacity, int) or self.capacity < 1:
            raise UserError(f"lower_gqa capacity={self.capacity!r} is not a positive integer",
                            "use the model's context length, e.g. capacity=8192")


def _heads(op, x, w, b, tag):
    proj = _p.OrValue([op.Add(op.MatMul(x, w), b), op.MatMul(x, w)], tag_var=f"{tag}_bias",
                      tag_values=[True, False])
    return op.Transpose(op.Reshape(proj, _p.ANY_VALUE, _allow_other_attributes=True), perm=[0, 2, 1, 3])


def _normed_heads(op, x, w, b, tag):
    """q or k heads, with an RMSNorm where Qwen 3 and Gemma 3 (each head) or OLMo 2 (the whole
    projection) put it before RoPE; the norm's node is captured as `{tag}_norm`, its form as `{tag}_norm_at`."""
    proj = _p.OrValue([op.Add(op.MatMul(x, w), b), op.MatMul(x, w)], tag_var=f"{tag}_bias",
                      tag_values=[True, False])
    def rms(x, cast=True):  # an fp16 export may normalize in fp32 and Cast the output back (OLMo 2, Gemma 3)
        x = _p.OrValue([op.Cast(x), x])  # X cast to the scale's type (export.to_onnx.cast_rms_inputs)
        y = op.RMSNormalization(x, _p.ANY_VALUE, _allow_other_attributes=True, _outputs=[f"{tag}_norm"])
        return _p.OrValue([op.Cast(y, _outputs=[f"{tag}_norm_cast"]), y]) if cast else y

    heads = op.Reshape(_p.OrValue([rms(proj), proj], tag_var=f"{tag}_flat", tag_values=[True, False]), _p.ANY_VALUE,
                       _allow_other_attributes=True)
    heads = _p.OrValue([rms(heads), heads], tag_var=f"{tag}_per_head", tag_values=[True, False])
    t = op.Transpose(heads, perm=[0, 2, 1, 3])
    t = _p.OrValue([rms(t, cast=False), t], tag_var=f"{tag}_after", tag_values=[True, False])
    # one Cast here: the after-norm's back to the projection's type (Gemma 3), or up to fp32 for a rotation in
    # fp32 that is cast back after it (OLMo 2; `{tag}_down` in _rotary); check() tells which
    return _p.OrValue([op.Cast(t, _outputs=[f"{tag}_cast"]), t])


def norm_cast(m: Match, tag: str) -> bool:
    """Whether q's or k's norm output is cast back to the projection's type (in fp16 exports)."""
    return m[f"{tag}_norm_cast"] is not None or (bool(m[f"{tag}_after"]) and m[f"{tag}_cast"] is not None
                                                 and m[f"{tag}_down"] is None)


def norm_form(m: Match, tag: str) -> str | None:
    """Where q's or k's RMSNorm sits: "flat" (over the projection, [B, S, H*D]), "head" (over each head's
    D values, before or after the transpose) or None."""
    if m[f"{tag}_flat"]:
        return "flat"
    if m[f"{tag}_per_head"] or m[f"{tag}_after"]:
        return "head"
    return None


def _rotary(op, x, cos, sin, tag):
    def decomposed(up: bool):
        lo = op.Slice(x, _allow_other_inputs=True, _outputs=[f"{tag}_lo"])
        hi = op.Slice(x, _allow_other_inputs=True, _outputs=[f"{tag}_hi"])
        x_, rotated = x, op.Concat(op.Neg(hi), lo, axis=-1)
        if up:  # OLMo 2 (fp16) rotates in fp32: x and rotate_half(x) each cast up, the sum cast back below
            x_, rotated = op.Cast(x, _outputs=[f"{tag}_up"]), op.Cast(rotated, _outputs=[f"{tag}_rotated_up"])
        return op.Add(op.Mul(x_, op.Unsqueeze(cos, _p.ANY_VALUE), _outputs=[f"{tag}_x_cos"]),
                      op.Mul(rotated, op.Unsqueeze(sin, _p.ANY_VALUE)))

    # one whole alternative each (the matcher does not backtrack into an alternative that matched locally)
    unfused = _p.OrValue([decomposed(True), decomposed(False)])
    # rotated in fp32 (x cast up here or once before the slices, `{tag}_cast` in _normed_heads) and cast
    # back; GQA rotates with fp16 tables in fp32 arithmetic
    unfused = _p.OrValue([op.Cast(unfused, _outputs=[f"{tag}_down"]), unfused])
    fused = op.RotaryEmbedding(x, cos, sin, _allow_other_attributes=True, _outputs=[f"{tag}_rope"])
    return _p.OrValue([fused, unfused], tag_var=f"{tag}_fused", tag_values=[True, False])


def _repeat(op, kv):
    return _p.OrValue([gqa_repeat(op, kv), kv])


class KVCacheAttention(Rule):
    """Root: the Reshape of the attention output back to [B, S, H*D], the o_proj's input."""

    name = "kv_cache_attention"

    def pattern(self, op, x, wq, wk, wv, bq, bk, bv, past_k, past_v, cos_q, sin_q, cos_k, sin_k):
        q = _rotary(op, _normed_heads(op, x, wq, bq, "q"), cos_q, sin_q, "q")
        k = _rotary(op, _normed_heads(op, x, wk, bk, "k"), cos_k, sin_k, "k")
        v = _heads(op, x, wv, bv, "v")
        present_k = op.Concat(past_k, k, _allow_other_attributes=True, _outputs=["present_k"])
        present_v = op.Concat(past_v, v, _allow_other_attributes=True, _outputs=["present_v"])
        y = op.Attention(q, _repeat(op, present_k), _repeat(op, present_v), _allow_other_inputs=True,
                         _allow_other_attributes=True, _outputs=["attention"])
        return op.Reshape(op.Transpose(y, perm=[0, 2, 1, 3]), _p.ANY_VALUE, _allow_other_attributes=True)

    def check(self, m: Match) -> str | None:
        graph = m.root.graph
        attention = m["attention"].producer()
        if len(attention.inputs) > 4 and any(v is not None for v in attention.inputs[4:]):
            return "Attention already takes a past_key/past_value (a different cache form)"
        if match.attr(attention, "qk_matmul_output_mode", 0) != 0 or len(attention.outputs) > 1 \
                and any(o.uses() for o in attention.outputs[1:]):
            return "Attention's extra outputs are used"
        for name in ("past_k", "past_v"):
            if not m[name].is_graph_input():
                return f"{name} is not a graph input"
        outputs = {id(v) for v in graph.outputs}
        for name in ("present_k", "present_v"):
            if id(m[name]) not in outputs:
                return f"{name} is not a graph output"
            if match.attr(m[name].producer(), "axis") not in (-2, 2):
                return f"{name} does not concatenate along the sequence axis"
        dims = _kv_dims(m)
        if dims is None:
            return "past K/V are not [B, Hkv, P, D] with static Hkv and D"
        hkv, d = dims
        weights = [match.constant(m[w]) for w in ("wq", "wk", "wv")]
        if any(w is None or len(w.shape) != 2 for w in weights):
            return "q/k/v projections are not constant matrices"
        wq, wk, wv = weights
        if wq.shape[1] % d or wk.shape[1] != hkv * d or wv.shape[1] != hkv * d or \
                not wq.shape[0] == wk.shape[0] == wv.shape[0]:
            return f"projection shapes {wq.shape}, {wk.shape}, {wv.shape} do not fit Hkv={hkv}, D={d}"
        if (wq.shape[1] // d) % hkv:
            return "query heads are not a multiple of the key/value heads"
        if len({m["q_bias"], m["k_bias"], m["v_bias"]}) != 1:
            return "only some of q/k/v have a bias"
        if m["q_bias"] and any(match.constant(m[b]) is None for b in ("bq", "bk", "bv")):
            return "a q/k/v bias is not a constant"
        if m["q_fused"] != m["k_fused"]:
            return "q and k use different rotary forms"
        for tag in ("q", "k"):
            reason = _norm_reason(m, tag, d)
            if reason:
                return reason
        for tag in ("q", "k"):
            reason = _rotary_reason(m, tag, d)
            if reason:
                return reason
        for cos in ("cos_q", "sin_q", "cos_k", "sin_k"):
            if _position_inputs(m[cos]) != {io_names.POSITION_IDS}:
                return f"{cos} is not computed from position_ids and constants alone"
        return None


def _kv_dims(m: Match) -> tuple[int, int] | None:
    shape = m["past_k"].shape
    if shape is None or shape.rank() != 4 or not all(isinstance(shape[i], int) for i in (1, 3)):
        return None
    return int(shape[1]), int(shape[3])


def _norm_reason(m: Match, tag: str, d: int) -> str | None:
    form = norm_form(m, tag)
    if form is None:
        return None
    if sum(bool(m[f"{tag}_{at}"]) for at in ("flat", "per_head", "after")) > 1:
        return f"{tag} is normalized twice"
    norm = m[f"{tag}_norm"].producer()
    if match.attr(norm, "axis", -1) != -1:
        return f"{tag}'s RMSNorm is not over the last axis"
    cast = m[f"{tag}_norm_cast"]
    if cast is not None and match.attr(cast.producer(), "to") != int(m["x"].type.dtype):
        return f"{tag}'s RMSNorm is cast to another type than the projection's"
    if m[f"{tag}_after"] and m[f"{tag}_cast"] is None and m["x"].type.dtype != norm.inputs[1].dtype:
        return f"{tag}'s RMSNorm changes the type and is not cast back"
    scale = norm.inputs[1]
    dims = scale.shape.rank() if scale is not None and scale.shape is not None else None
    if dims != 1 or not isinstance(scale.shape[0], int) or (form == "head" and scale.shape[0] != d):
        return f"{tag}'s RMSNorm scale is not one static vector of the normalized size"
    return None


def _rotary_reason(m: Match, tag: str, d: int) -> str | None:
    if m[f"{tag}_fused"]:
        rope = m[f"{tag}_rope"].producer()
        if match.attr(rope, "rotary_embedding_dim", 0) not in (0, d):
            return "partial rotary (rotary_embedding_dim < head size)"
        if len(rope.inputs) > 3 and rope.inputs[3] is not None:
            return "RotaryEmbedding takes position_ids (a cos/sin cache indexed by the op)"
        return None
    cast, down, dtype = m[f"{tag}_cast"], m[f"{tag}_down"], int(m["x"].type.dtype)
    lo, hi = m[f"{tag}_lo"].producer(), m[f"{tag}_hi"].producer()
    ups = (m[f"{tag}_up"], m[f"{tag}_rotated_up"])
    x = ups[0].producer().inputs[0] if ups[0] is not None else m[f"{tag}_x_cos"].producer().inputs[0]
    if not (x is lo.inputs[0] is hi.inputs[0]):
        return f"{tag}'s rotation reads x and rotate_half(x) from different values"
    if ups[0] is not None:  # x and rotate_half(x) cast up separately
        if (cast is not None and not m[f"{tag}_after"]) or \
                match.attr(ups[0].producer(), "to") != match.attr(ups[1].producer(), "to"):
            return f"{tag}'s rotation casts x and rotate_half(x) differently"
        cast = ups[0]  # the cast before the rotation, for the checks below
    if down is not None and (cast is None or (m[f"{tag}_after"] and ups == (None, None))):
        return f"{tag}'s rotation is cast back without a cast before it"
    if down is not None and match.attr(down.producer(), "to") != dtype:
        return f"{tag}'s rotation is cast back to another type than the projection's"
    if down is None and cast is not None and not (m[f"{tag}_after"] and match.attr(cast.producer(), "to") == dtype):
        return f"{tag} is cast before its rotation and not back"
    want = {"lo": (0, d // 2), "hi": (d // 2, None)}
    for name, node in (("lo", lo), ("hi", hi)):
        starts, ends = match.int_list(node.inputs[1]), match.int_list(node.inputs[2])
        axes = match.int_list(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
        steps = match.int_list(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else [1]
        start, end = want[name]
        if starts != [start] or axes not in ([-1], [3]) or steps != [1] or ends is None or \
                (end is not None and ends != [end]) or (end is None and ends[0] < d):
            return f"{tag}'s rotate_half slices are not [:D/2] and [D/2:]"
    return None


def _position_inputs(value: ir.Value) -> set[str]:
    """Names of the graph inputs `value` is computed from, apart from inputs it reads only the
    shape of (transformers 5.17 sizes the inv_freq Expand by the batch of a past KV input)."""
    return _inputs_of(value)[0]


def _inputs_of(value: ir.Value) -> tuple[set[str], dict[str, ir.Value]]:
    """(graph inputs whose values `value` depends on, {name: input} read only through Shape)."""
    seen, stack, found, shaped = set(), [value], set(), {}
    while stack:
        v = stack.pop()
        if id(v) in seen or v is None:
            continue
        seen.add(id(v))
        node = v.producer()
        if v.is_graph_input():
            found.add(v.name)
        elif node is not None and node.op_type == "Shape" and node.domain == "" and node.inputs[0].is_graph_input():
            shaped[node.inputs[0].name] = node.inputs[0]
        elif node is not None:
            stack.extend(node.inputs)
    return found, {k: v for k, v in shaped.items() if k not in found}


def position_table(model: ir.Model, value: ir.Value, capacity: int) -> np.ndarray:
    """`value` (a function of position_ids [B, S]) evaluated for position_ids = [[0 .. C-1]]:
    the producer subgraph is cut out and run on ONNX Runtime's CPU EP. Returns [C, ...]."""
    import onnx
    import onnxruntime as ort

    nodes, seen, stack = [], set(), [value.producer()]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        stack.extend(i.producer() for i in node.inputs if i is not None)
    order = {id(n): i for i, n in enumerate(model.graph)}
    nodes.sort(key=lambda n: order[id(n)])
    consts = {i.name: i for n in nodes for i in n.inputs if i is not None and i.const_value is not None}
    # Inputs read only through Shape: batch 1 like position_ids, every other unknown dim 1.
    shaped = _inputs_of(value)[1]
    dummies = {name: np.zeros([d if isinstance(d, int) else 1 for d in v.shape], ir.DataType(v.dtype).numpy())
               for name, v in shaped.items()}
    dummies = {name: a.reshape((1,) + a.shape[1:]) if a.ndim else a for name, a in dummies.items()}
    graph = onnx.helper.make_graph(
        [ir.serde.serialize_node(n) for n in nodes], "rotary_table",
        [onnx.helper.make_tensor_value_info(io_names.POSITION_IDS, onnx.TensorProto.INT64, [1, capacity])] +
        [onnx.helper.make_tensor_value_info(name, int(shaped[name].dtype), list(a.shape))
         for name, a in dummies.items()],
        [onnx.helper.make_value_info(value.name, onnx.TypeProto())],
        [ir.serde.serialize_tensor(ir.Tensor(c.const_value.numpy())) for c in consts.values()])  # inline
    for init, name in zip(graph.initializer, consts):
        init.name = name
    proto = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid(d, v)
                                                         for d, v in model.opset_imports.items()])
    proto.ir_version = min(model.ir_version, proto.ir_version)  # onnx's newest may be past this ORT's
    proto = onnx.shape_inference.infer_shapes(proto)  # gives the output its type
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    out = session.run(None, {io_names.POSITION_IDS: np.arange(capacity, dtype=np.int64)[None], **dummies})[0]
    return out.reshape(capacity, -1)


def _tables(model: ir.Model, m: Match, capacity: int, d: int, memo: dict) -> tuple[np.ndarray, np.ndarray]:
    """GQA's cos_cache, sin_cache [C, D/2] from the rotary inputs of q (k's must be the same)."""
    result = []
    for q_name, k_name in (("cos_q", "cos_k"), ("sin_q", "sin_k")):
        tables = []
        for name in (q_name, k_name):
            value = m[name]
            if id(value) not in memo:
                memo[id(value)] = position_table(model, value, capacity)
            tables.append(memo[id(value)])
        if not np.array_equal(tables[0], tables[1]):
            raise _Reject("q and k use different rotary tables")
        table = tables[0]
        if table.shape[1] == d:  # rotate_half form: [freqs, freqs]
            if not np.array_equal(table[:, : d // 2], table[:, d // 2:]):
                raise _Reject("the rotary table's halves differ (not the rotate_half layout)")
            table = table[:, : d // 2]
        if table.shape[1] != d // 2:
            raise _Reject(f"rotary table width {table.shape[1]} does not fit head size {d}")
        result.append(np.ascontiguousarray(table))
    return result[0], result[1]


def _shared_table(graph: ir.Graph, namer: Namer, memo: dict, name: str, table: np.ndarray) -> ir.Value:
    """One initializer per distinct rotary table (every layer usually shares one)."""
    key = (name, table.dtype.str, table.shape, hash(table.tobytes()))
    if key not in memo:
        memo[key] = add_initializer(graph, namer, name, table)
    return memo[key]


def lowered_capacity(model: ir.Model, who: str) -> int:
    """The KV capacity lower_gqa recorded in the graph's metadata; `who` (a later pass) needs it."""
    text = model.metadata_props.get(CAPACITY_KEY, "")
    if not text.isdigit() or int(text) < 1:
        raise UserError(f"{who} needs a graph lowered by lower_gqa (metadata {CAPACITY_KEY} is "
                        f"{text or 'missing'})", "run lower_gqa and ort_attention first")
    return int(text)


class _Reject(Exception):
    pass


def _lower(model: ir.Model, m: Match, namer: Namer, feeds: dict, capacity: int, memo: dict,
           window: int | None) -> None:
    graph = model.graph
    hkv, d = _kv_dims(m)
    wq, wk, wv = (m[w].const_value.numpy() for w in ("wq", "wk", "wv"))
    heads = wq.shape[1] // d
    dtype = m["x"].type.dtype
    cos, sin = _tables(model, m, capacity, d, memo)
    np_dtype = dtype.numpy()
    attention = m["attention"].producer()
    base = attention.name or "attention"
    wqkv = add_initializer(graph, namer, f"{base}.qkv_weight", np.concatenate([wq, wk, wv], axis=1))
    cos_v, sin_v = (_shared_table(graph, namer, memo, name, table.astype(np_dtype))
                    for name, table in (("rotary.cos_cache", cos), ("rotary.sin_cache", sin)))
    nodes = [ir.Node("", "MatMul", [m["x"], wqkv], num_outputs=1, name=namer(f"{base}_qkv"))]
    qkv = nodes[-1].outputs[0]
    if m["q_bias"]:
        bias = np.concatenate([m[b].const_value.numpy() for b in ("bq", "bk", "bv")])
        nodes.append(ir.Node("", "Add", [qkv, add_initializer(graph, namer, f"{base}.qkv_bias", bias)],
                             num_outputs=1, name=namer(f"{base}_qkv_bias")))
        qkv = nodes[-1].outputs[0]
    qkv.name, qkv.type = namer(f"{base}_qkv_out"), ir.TensorType(dtype)
    if norm_form(m, "q") or norm_form(m, "k"):
        qkv = _normalized_qkv(graph, m, namer, nodes, qkv, base, [heads * d, hkv * d, hkv * d], d, dtype)
    scale = match.attr(attention, "scale", None)
    attrs = [ir.AttrInt64("num_heads", heads), ir.AttrInt64("kv_num_heads", hkv), ir.AttrInt64("do_rotary", 1),
             ir.AttrInt64("rotary_interleaved", 0),
             ir.AttrFloat32("scale", float(scale) if scale is not None else 1.0 / math.sqrt(d))]
    if match.attr(attention, "softcap", 0.0):
        attrs.append(ir.AttrFloat32("softcap", float(match.attr(attention, "softcap"))))
    if window is not None:  # transformers: q - k < W; ORT's GQA then takes local_window_size = W (checked
        attrs.append(ir.AttrInt64("local_window_size", window))  # on CPU by tests/models/test_families.py)
    gqa = ir.Node(MS_DOMAIN, "GroupQueryAttention",
                  [qkv, None, None, m["past_k"], m["past_v"], feeds[SEQLENS], feeds[TOTAL], cos_v, sin_v],
                  attrs, num_outputs=3, name=namer(f"{base}_gqa"))
    nodes.append(gqa)
    for node in nodes:
        graph.insert_before(attention, node)
    out, new_k, new_v = gqa.outputs
    old = m.root.outputs[0]
    out.name, out.type, out.shape = namer(f"{base}_gqa_out"), old.type, old.shape
    ir.convenience.replace_all_uses_with(old, out)
    for old_present, new in ((m["present_k"], new_k), (m["present_v"], new_v)):
        name = old_present.name
        old_present.name = namer(f"{name}_unlowered")
        new.name, new.type = name, old_present.type
        new.shape = ir.Shape([old_present.shape[0], hkv, "kv_capacity", d]) if old_present.shape else None
        graph.outputs[graph.outputs.index(old_present)] = new
    for past in (m["past_k"], m["past_v"]):
        past.shape = ir.Shape([past.shape[0], hkv, "kv_capacity", d])


def _normalized_qkv(graph: ir.Graph, m: Match, namer: Namer, nodes: list, qkv: ir.Value, base: str,
                    widths: list[int], d: int, dtype) -> ir.Value:
    """The packed [B, S, (H + 2 Hkv) D] projection with q's and k's RMSNorm applied as the export did
    (the same node attributes and scale; a per-head norm over [B, S, heads, D]): Split, norm, Concat."""
    split = ir.Node("", "Split", [qkv, add_initializer(graph, namer, f"{base}.qkv_split", np.array(widths, np.int64))],
                    [ir.AttrInt64("axis", -1)], num_outputs=3, name=namer(f"{base}_qkv_split"))
    nodes.append(split)
    parts = list(split.outputs)
    for i, tag in ((0, "q"), (1, "k")):
        form = norm_form(m, tag)
        if form is None:
            continue
        old = m[f"{tag}_norm"].producer()
        x = parts[i]
        if form == "head":
            shape = add_initializer(graph, namer, f"{base}.{tag}_heads", np.array([0, 0, -1, d], np.int64))
            nodes.append(ir.Node("", "Reshape", [x, shape], num_outputs=1, name=namer(f"{base}_{tag}_heads")))
            x = nodes[-1].outputs[0]
        attrs = [a for a in old.attributes.values()]
        scale_type = old.inputs[1].dtype
        if scale_type is not None and scale_type != dtype:  # X in the scale's type, as the export has it
            nodes.append(ir.Node("", "Cast", [x], [ir.AttrInt64("to", int(scale_type))], num_outputs=1,
                                 name=namer(f"{base}_{tag}_norm_in")))
            x = nodes[-1].outputs[0]
        nodes.append(ir.Node(old.domain, "RMSNormalization", [x, old.inputs[1]], attrs, num_outputs=1,
                             name=namer(f"{base}_{tag}_norm")))
        x = nodes[-1].outputs[0]
        if norm_cast(m, tag):  # back to the projection's type, as the export did
            nodes.append(ir.Node("", "Cast", [x], [ir.AttrInt64("to", int(dtype))], num_outputs=1,
                                 name=namer(f"{base}_{tag}_norm_cast")))
            x = nodes[-1].outputs[0]
        if form == "head":
            flat = add_initializer(graph, namer, f"{base}.{tag}_flat", np.array([0, 0, widths[i]], np.int64))
            nodes.append(ir.Node("", "Reshape", [x, flat], num_outputs=1, name=namer(f"{base}_{tag}_flat")))
            x = nodes[-1].outputs[0]
        parts[i] = x
    nodes.append(ir.Node("", "Concat", parts, [ir.AttrInt64("axis", -1)], num_outputs=1,
                         name=namer(f"{base}_qkv_normed")))
    for node in nodes[nodes.index(split):]:  # types for the checker: a norm's output (and its input cast)
        for value in node.outputs:              # has the scale's type
            value.name = value.name or namer(f"{node.name}_out")
            to = match.attr(node, "to") if node.op_type == "Cast" else None
            norm = node.op_type == "RMSNormalization" and node.inputs[1].dtype is not None
            value.type = ir.TensorType(node.inputs[1].dtype if norm else ir.DataType(to) if to else dtype)
    return nodes[-1].outputs[0]


def _new_inputs(graph: ir.Graph) -> dict:
    feeds = {}
    batch = next((v.shape[0] for v in graph.inputs if v.name == io_names.INPUT_IDS and v.shape), "batch")
    for name, dtype, shape in ((SEQLENS, ir.DataType.INT32, [batch]), (TOTAL, ir.DataType.INT32, [])):
        value = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape))
        graph.inputs.append(value)
        feeds[name] = value
    return feeds


RULES = [KVCacheAttention()]


@register("lower_gqa", LowerGqaParams, exact=False)
def lower_gqa(model: ir.Model, params: LowerGqaParams, ctx: PassContext | None = None) -> PassResult:
    """Attention + concatenated KV cache -> com.microsoft.GroupQueryAttention on shared KV buffers
    (packed QKV, rotary inside the op). Changes the graph's inputs; see the module doc."""
    found, rejected = match.find_all(model, RULES)
    attention_nodes = sum(1 for n in model.graph if n.op_type == "Attention")
    if not attention_nodes:
        raise UserError("lower_gqa found no ONNX Attention node (an export with unfused attention?)",
                        "run the fuse_attention pass first (or export at opset 23 with the dynamo exporter)")
    if not found:
        raise UserError(f"lower_gqa matched none of the {attention_nodes} attention layers "
                        f"({'; '.join(sorted({r.reason for r in rejected})) or 'no KV-cache attention pattern'})",
                        "build this model without the GQA lowering (plain ORT engine)")
    namer = Namer(model.graph)
    feeds = _new_inputs(model.graph)
    memo: dict = {}
    lowered = 0
    layers = attention_meta.layers(model.metadata_props)  # per layer: the sliding window, if any
    for m in found:  # collect the matches first, then change the graph
        layer = io_names.layer_of(m["past_k"].name)
        window = layers[layer].window if layers and layer is not None else None
        if layers and layer is None and attention_meta.windows(model.metadata_props):
            rejected.append(Rejection(KVCacheAttention.name, m.root.name or "Reshape",
                                      f"{m['past_k'].name} names no layer, so its sliding window is unknown", m.root))
            continue
        try:
            _lower(model, m, namer, feeds, params.capacity, memo, window)
            lowered += 1
        except _Reject as why:
            rejected.append(Rejection(KVCacheAttention.name, m.root.name or "Reshape", str(why), m.root))
    if lowered != attention_nodes:
        raise UserError(f"lower_gqa lowered {lowered} of {attention_nodes} attention layers "
                        f"({'; '.join(sorted({r.reason for r in rejected})) or 'no match'})",
                        "build this model without the GQA lowering (plain ORT engine)")
    RemoveUnusedNodesPass()(model)
    for name in (io_names.ATTENTION_MASK, io_names.POSITION_IDS):
        value = next((v for v in model.graph.inputs if v.name == name), None)
        if value is not None and not value.uses():
            model.graph.inputs.remove(value)
    drop_unused_initializers(model.graph)
    model.opset_imports.setdefault(MS_DOMAIN, 1)
    model.metadata_props[CAPACITY_KEY] = str(params.capacity)
    return PassResult({"gqa": lowered, "not_lowered": attention_nodes - lowered}, rejected)


__all__ = ["LowerGqaParams", "KVCacheAttention", "lower_gqa", "position_table", "lowered_capacity", "CAPACITY_KEY"]
