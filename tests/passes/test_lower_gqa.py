"""lower_gqa (+ skip_rmsnorm, + W4A16): the lowered graph, run by runtime.engines.ort_cuda.GqaEngine on the
CPU EP, gives the unlowered graph's logits (OrtEngine) through prefill, decode, a multi-token
verify step, a rollback and a left-padded batch."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import enginesmith.passes.lower.lower_gqa  # noqa: F401  (registers the passes)
import enginesmith.passes.fusion.skip_rmsnorm  # noqa: F401
from enginesmith.core.errors import UserError
from enginesmith.passes import run_pipeline
from enginesmith.passes.lower.lower_gqa import LowerGqaParams, lower_gqa


def _ops(path) -> collections.Counter:
    return collections.Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


def _lowered(src, tmp_path, steps="lower_gqa:capacity=64,skip_rmsnorm"):
    out = tmp_path / "model.onnx"
    report = run_pipeline(src, out, steps, progress=False)
    return out, {e["name"]: e["counts"] for e in report}


def _compare(reference, lowered, atol):
    """Max |logits difference| over the runtime's kinds of calls."""
    from enginesmith.runtime.decoding.generate import left_pad, positions
    from enginesmith.runtime.engines.ort_cuda import GqaEngine
    from enginesmith.runtime.engines.ort_engine import OrtEngine

    ref = OrtEngine(reference, device="cpu", threads=1)
    low = GqaEngine(lowered, device="cpu", max_batch=2, capacity=64, threads=1)
    rng = np.random.default_rng(0)
    c_ref, c_low = ref.new_cache(1), low.new_cache(1)

    def step(ids, past):
        mask = np.ones((1, past + ids.shape[1]), np.int64)
        pos = np.arange(past, past + ids.shape[1])[None]
        a, b = ref.forward(ids, mask, pos, c_ref), low.forward(ids, mask, pos, c_low)
        np.testing.assert_allclose(b, a, atol=atol)

    step(rng.integers(0, ref.vocab, (1, 7)), 0)    # prefill
    step(rng.integers(0, ref.vocab, (1, 1)), 7)    # decode
    step(rng.integers(0, ref.vocab, (1, 4)), 8)    # verify k + 1 tokens after a cache
    c_ref.truncate(10)
    c_low.truncate(10)
    step(rng.integers(0, ref.vocab, (1, 3)), 10)   # after a rollback
    ids, mask = left_pad([[5, 6, 7, 8, 9], [11, 12]], 0)
    c_ref, c_low = ref.new_cache(2), low.new_cache(2)
    a = ref.forward(ids, mask, positions(mask, 5), c_ref)[:, -1]
    b = low.forward(ids, mask, positions(mask, 5), c_low)[:, -1]
    np.testing.assert_allclose(b, a, atol=atol)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_lowered_fp32_graph_gives_the_same_logits(tiny_engine, tmp_path, family):
    """fp32 exports: fused RotaryEmbedding; qwen2 has q/k/v biases, mistral 4 query heads per KV head."""
    out, counts = _lowered(tiny_engine(family) / "model.onnx", tmp_path)
    assert counts["lower_gqa"] == {"gqa": 2, "not_lowered": 0}
    assert counts["skip_rmsnorm"]["skip_rmsnorm"] == 4
    ops = _ops(out)
    assert ops["GroupQueryAttention"] == 2 and ops["SkipSimplifiedLayerNormalization"] == 4
    for gone in ("Attention", "Concat", "RotaryEmbedding", "Expand", "Transpose"):
        assert ops[gone] <= (1 if gone == "Transpose" else 0), gone  # the tied lm_head's Transpose stays
    inputs = {i.name for i in onnx.load(str(out), load_external_data=False).graph.input}
    assert {"seqlens_k", "total_sequence_length"} <= inputs and "attention_mask" not in inputs
    _compare(tiny_engine(family) / "model.onnx", out, atol=1e-4)


def test_lowered_fp16_graph_with_decomposed_rotary(tmp_path):
    """fp16 exports keep RoPE decomposed (x*cos + rotate_half(x)*sin): lowered the same way."""
    from enginesmith.builder.engine import BuildConfig, cached_engine

    src = cached_engine(BuildConfig(model="tiny:llama", dtype="fp16"), progress=False) / "model.onnx"
    assert _ops(src)["RotaryEmbedding"] == 0
    out, counts = _lowered(src, tmp_path)
    assert counts["lower_gqa"]["gqa"] == 2
    _compare(src, out, atol=1e-2)  # fp16 rounding


def test_w4a16_after_lowering_runs(tiny_engine, tmp_path):
    from enginesmith.runtime.engines.ort_cuda import GqaEngine

    out, counts = _lowered(tiny_engine("llama") / "model.onnx", tmp_path,
                           "lower_gqa:capacity=64,skip_rmsnorm,quantize_w4a16:block_size=32,lower_ort")
    assert counts["lower_ort"]["matmulnbits"] == 10  # qkv, o, gate, up, down per layer
    engine = GqaEngine(out, device="cpu", capacity=64)
    cache = engine.new_cache(1)
    logits = engine.forward(np.array([[1, 2, 3]]), np.ones((1, 3), np.int64), np.arange(3)[None], cache)
    assert np.isfinite(logits).all()


def test_refuses_models_without_rotary_attention(tiny_engine):
    """gpt2 (learned positions, no RoPE): nothing to lower; the pass says why instead of half-lowering."""
    model = ir.load(tiny_engine("gpt2") / "model.onnx")
    with pytest.raises(UserError, match="lower_gqa"):
        lower_gqa(model, LowerGqaParams(capacity=64))


def test_capacity_must_be_positive():
    with pytest.raises(UserError, match="capacity"):
        LowerGqaParams(capacity=0)


def test_rotary_table_matches_the_graph(tiny_engine):
    """cos/sin tables come from evaluating the graph's own position subgraph."""
    from enginesmith.passes.machinery import match
    from enginesmith.passes.lower.lower_gqa import RULES, position_table

    model = ir.load(tiny_engine("llama") / "model.onnx")
    found, _ = match.find_all(model, RULES)
    cos = position_table(model, found[0]["cos_q"], 16)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, 16, 2) / 16))  # tiny llama: head size 16, theta 1e4
    np.testing.assert_allclose(cos, np.cos(np.arange(16)[:, None] * inv_freq[None]), atol=1e-5)


def test_fused_gate_up_gives_the_same_logits(tiny_engine, tmp_path):
    """fuse_matmul after the lowering: each MLP's gate and up projections become one MatMul + Split
    (q/k/v are already one MatMul); the decode paths give the unfused graph's logits."""
    out, counts = _lowered(tiny_engine("llama") / "model.onnx", tmp_path,
                           "lower_gqa:capacity=64,skip_rmsnorm,fuse_matmul")
    assert counts["fuse_matmul"] == {"fused_groups": 2, "matmuls_fused": 4}
    ops = _ops(out)
    assert ops["Split"] == 2 and ops["MatMul"] == 2 * 4 + 1  # qkv, o, gate|up, down per layer + lm_head
    _compare(tiny_engine("llama") / "model.onnx", out, atol=1e-4)


def test_fused_gate_up_quantizes_as_one_matmulnbits(tiny_engine, tmp_path):
    _, counts = _lowered(tiny_engine("llama") / "model.onnx", tmp_path,
                           "lower_gqa:capacity=64,skip_rmsnorm,fuse_matmul,quantize_w4a16:block_size=32,lower_ort")
    assert counts["lower_ort"]["matmulnbits"] == 8  # qkv, o, gate|up, down per layer


def test_transposed_weights_after_lowering_give_the_same_logits(tiny_engine, tmp_path):
    """matmul_transb on the lowered graph (FusedMatMul on [N, K] weights, the tied lm_head on the
    embedding table) keeps the decode paths' logits."""
    import enginesmith.passes.fusion.matmul_transb  # noqa: F401

    out, counts = _lowered(tiny_engine("llama") / "model.onnx", tmp_path,
                           "lower_gqa:capacity=64,skip_rmsnorm,matmul_transb")
    assert counts["matmul_transb"]["fused_matmul_transb"] == 2 * 5 + 1
    assert _ops(out)["MatMul"] == 0
    _compare(tiny_engine("llama") / "model.onnx", out, atol=1e-4)


def test_rotary_sized_by_a_past_kv_shape_is_lowered(tiny_engine, tmp_path):
    """transformers 5.17 exports size the rotary inv_freq Expand by the batch of a past KV input
    (Shape(past_key_values.*)): the table is still a function of position_ids alone and lowers.
    Here the same dependency is added to a newer export: cos/sin = Expand(cos/sin, [B_past, 1, 1])."""
    src = tiny_engine("llama") / "model.onnx"
    model = ir.load(src)
    graph = model.graph
    past = next(v for v in graph.inputs if v.name.startswith("past_key_values."))
    rotary = [n for n in graph if n.op_type == "RotaryEmbedding"]
    assert rotary, "the fp32 export has fused RotaryEmbedding nodes"
    shape = ir.Node("", "Shape", [past], [ir.AttrInt64("start", 0), ir.AttrInt64("end", 1)], name="past_batch")
    ones = ir.Value(name="ones_2", const_value=ir.tensor(np.ones(2, np.int64), name="ones_2"))
    graph.register_initializer(ones)
    target = ir.Node("", "Concat", [shape.outputs[0], ones], [ir.AttrInt64("axis", 0)], name="past_batch_shape")
    graph.insert_before(rotary[0], [shape, target])
    for node in (shape, target):
        node.outputs[0].name, node.outputs[0].type = f"{node.name}_out", ir.TensorType(ir.DataType.INT64)
    for i, table in enumerate({id(n.inputs[k]): n.inputs[k] for n in rotary for k in (1, 2)}.values()):
        expand = ir.Node("", "Expand", [table, target.outputs[0]], name=f"batch_expand_{i}")
        graph.insert_before(rotary[0], expand)
        expand.outputs[0].name, expand.outputs[0].type = f"batch_expanded_{i}", ir.TensorType(ir.DataType.FLOAT)
        for n in rotary:
            for k in (1, 2):
                if n.inputs[k] is table:
                    n.replace_input_with(k, expand.outputs[0])
    edited = tmp_path / "edited" / "model.onnx"
    edited.parent.mkdir()
    ir.save(model, edited, external_data="model.onnx.data")
    out, counts = _lowered(edited, tmp_path)
    assert counts["lower_gqa"] == {"gqa": 2, "not_lowered": 0}
    _compare(src, out, atol=1e-4)
