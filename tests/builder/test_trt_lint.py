"""trt-lint: accepts what our exporter produces, rejects one planted violation per rule."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from enginesmith.builder import trt_ops
from enginesmith.builder.trt_lint import EXIT_FINDINGS, lint, main
from enginesmith.core.errors import UserError

REPO = Path(__file__).resolve().parents[2]
from helpers.tiny_families import FAMILIES


def rules(findings) -> list[str]:
    return sorted({f.rule for f in findings})


# ----------------------------------------------------------------------------- real graphs

@pytest.fixture(scope="module")
def tiny_llama_opset24(tmp_path_factory) -> Path:
    from enginesmith.export.to_onnx import export
    from enginesmith.models.tiny import build

    out = tmp_path_factory.mktemp("export") / "model.onnx"
    return export(build("tiny:llama"), out, opset=24)


def test_accepts_a_fresh_export_at_opset_24(tiny_llama_opset24):
    assert lint(tiny_llama_opset24, "10.15") == []
    assert lint(tiny_llama_opset24, "11") == []


@pytest.mark.parametrize("family", FAMILIES)
def test_accepts_every_tiny_family_engine(tiny_engine, family):
    engine = tiny_engine(family)
    assert lint(engine, "10.15") == [], family
    assert lint(engine / "model.onnx", "11.1") == []


@pytest.mark.slow
def test_accepts_the_default_smollm2_engine(smollm2_engine):
    assert lint(smollm2_engine, "10.15") == []


def test_jetpack_targets_flag_the_fused_llm_ops(tiny_engine):
    """JetPack 7 ships TensorRT 10.13: no Attention/RMSNormalization/RotaryEmbedding importers yet."""
    findings = lint(tiny_engine("llama"), "10.13")
    ops = {f.op_type for f in findings if f.rule == "unsupported-op"}
    assert ops == {"Attention", "RMSNormalization", "RotaryEmbedding"}
    assert all("10.14" in f.message or "10.15" in f.message for f in findings if f.rule == "unsupported-op")
    assert all("--opset 22" in f.fix for f in findings if f.rule == "unsupported-op")
    # opset 23 is above what 10.3 (JetPack 6) documents
    assert "opset" in rules(lint(tiny_engine("llama"), "10.3"))


# ----------------------------------------------------------------------------- planted violations

def model(nodes, inputs, outputs, initializers=(), opset=23, extra_opsets=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    opsets = [helper.make_opsetid("", opset), *[helper.make_opsetid(d, v) for d, v in extra_opsets]]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def vi(name, dtype, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


def fp(name, shape):
    return vi(name, TensorProto.FLOAT, shape)


def test_rule_opset():
    m = model([helper.make_node("Relu", ["x"], ["y"], name="r")], [fp("x", [1])], [fp("y", [1])], opset=24)
    assert rules(lint(m, "10.3")) == ["opset"]
    assert lint(m, "10.15") == []


def test_rule_unsupported_op():
    m = model([helper.make_node("Unique", ["x"], ["y"], name="u"), helper.make_node("NotAnOp", ["y"], ["z"], name="n")],
              [fp("x", [4])], [fp("z", [4])])
    findings = lint(m, "10.15")
    assert {(f.rule, f.node) for f in findings} == {("unsupported-op", "u"), ("unsupported-op", "n")}


def test_rule_unsupported_op_contrib_domain():
    m = model([helper.make_node("MatMulNBits", ["x"], ["y"], name="q", domain="com.microsoft")],
              [fp("x", [4])], [fp("y", [4])], extra_opsets=[("com.microsoft", 1)])
    (f,) = lint(m, "10.15")
    assert (f.rule, f.node) == ("unsupported-op", "q") and "contrib" in f.message


def test_rule_unsupported_attribute_attention_past_and_softcap():
    q = [fp(n, [1, 2, 3, 4]) for n in ("q", "k", "v", "pk", "pv")]
    node = helper.make_node("Attention", ["q", "k", "v", "", "pk", "pv"], ["y", "present_k", "present_v"],
                            name="attn", softcap=30.0)
    m = model([node], q, [fp("y", [1, 2, 3, 4]), fp("present_k", None), fp("present_v", None)])
    findings = lint(m, "10.15")
    assert rules(findings) == ["unsupported-attribute"]
    text = " ".join(f.message for f in findings)
    for what in ("past_key", "past_value", "present_key", "present_value", "softcap"):
        assert what in text


def test_rule_unsupported_attribute_attention_3d_and_tensor_scatter_axis():
    attn = helper.make_node("Attention", ["q", "k", "v"], ["y"], name="attn3d", q_num_heads=2, kv_num_heads=2)
    scatter = helper.make_node("TensorScatter", ["cache", "upd", "idx"], ["new"], name="ts", axis=1)
    m = model([attn, scatter],
              [fp("q", [1, 3, 8]), fp("k", [1, 3, 8]), fp("v", [1, 3, 8]), fp("cache", [1, 2, 16, 4]),
               fp("upd", [1, 2, 1, 4]), vi("idx", TensorProto.INT64, [1])],
              [fp("y", [1, 3, 8]), fp("new", [1, 2, 16, 4])], opset=24)
    findings = lint(m, "10.15")
    assert {f.node for f in findings} == {"attn3d", "ts"} and rules(findings) == ["unsupported-attribute"]


def test_rule_dtype():
    m = model([helper.make_node("Identity", ["x"], ["y"], name="id")],
              [vi("x", TensorProto.UINT16, [2])], [vi("y", TensorProto.UINT16, [2])])
    assert rules(lint(m)) == ["dtype"]


def w8a8_matmul(zero_point=0, act_scales=1, weight_axis=1, w_scales=8, zp_dtype=TensorProto.INT8):
    """x -Q-DQ- MatMul(., DQ(W int8 [16, 8])): a per-channel W8A8 linear."""
    act_shape = [act_scales] if act_scales > 1 else []
    zp_np = np.int8 if zp_dtype == TensorProto.INT8 else np.uint8
    inits = [
        numpy_helper.from_array(np.full(act_shape, 0.1, np.float32), "xs"),
        numpy_helper.from_array(np.full(act_shape, zero_point, zp_np), "xz"),
        numpy_helper.from_array(np.ones([16, 8], np.int8), "w"),
        numpy_helper.from_array(np.full([w_scales], 0.01, np.float32), "ws"),
        numpy_helper.from_array(np.zeros([w_scales], np.int8), "wz"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="q_x", axis=1),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"], name="dq_x", axis=1),
        helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], name="dq_w", axis=weight_axis),
        helper.make_node("MatMul", ["xd", "wd"], ["y"], name="mm"),
    ]
    return model(nodes, [fp("x", [2, 16])], [fp("y", [2, 8])], inits)


def test_qdq_reference_graph_is_clean():
    assert lint(w8a8_matmul()) == []


def test_rule_qdq_zero_point():
    findings = lint(w8a8_matmul(zero_point=3))
    assert rules(findings) == ["qdq-zero-point"] and {f.node for f in findings} == {"q_x", "dq_x"}


def test_rule_qdq_zero_point_unsigned():
    assert rules(lint(w8a8_matmul(zp_dtype=TensorProto.UINT8))) == ["qdq-zero-point"]


def test_rule_qdq_activation_scale():
    findings = lint(w8a8_matmul(act_scales=16))
    assert rules(findings) == ["qdq-activation-scale"]


def test_rule_qdq_weight_axis():
    findings = lint(w8a8_matmul(weight_axis=0, w_scales=16))
    assert rules(findings) == ["qdq-weight-axis"] and findings[0].node == "dq_w"
    assert "axis 1" in findings[0].fix


def test_rule_qdq_scale_must_be_constant():
    nodes = [helper.make_node("Abs", ["s0"], ["s"], name="runtime_scale"),
             helper.make_node("QuantizeLinear", ["x", "s"], ["xq"], name="q", output_dtype=TensorProto.INT8),
             helper.make_node("DequantizeLinear", ["xq", "s"], ["y"], name="dq")]
    m = model(nodes, [fp("x", [4]), fp("s0", [])], [fp("y", [4])], opset=21)
    assert rules(lint(m)) == ["qdq-scale"]


def int4_weight(shape, block_axis, block=4, opset=23):
    w = helper.make_tensor("w", TensorProto.INT4, shape, np.zeros(int(np.prod(shape)), np.int8).tolist())
    scale_shape = [(-(-d // block) if i == block_axis % len(shape) else d) for i, d in enumerate(shape)]
    s = numpy_helper.from_array(np.full(scale_shape, 0.1, np.float16), "s")
    dq = helper.make_node("DequantizeLinear", ["w", "s"], ["wd"], name="dq_w", axis=block_axis, block_size=block)
    mm = helper.make_node("MatMul", ["x", "wd"], ["y"], name="mm")
    k, n = shape[-2], shape[-1]
    return model([dq, mm], [vi("x", TensorProto.FLOAT16, [2, k])], [vi("y", TensorProto.FLOAT16, [2, n])], [w, s],
                 opset=opset)


def test_int4_reference_graph_is_clean():
    assert lint(int4_weight([8, 4], block_axis=0)) == []


def test_rule_int4_blocking_axis():
    findings = lint(int4_weight([2, 8, 4], block_axis=0))
    assert rules(findings) == ["int4-blocking"] and "last or second-to-last" in findings[0].message


def test_rule_int4_blocking_on_activation():
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q4"),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["y"], name="dq4")]
    inits = [numpy_helper.from_array(np.array(0.1, np.float32), "s"),
             helper.make_tensor("z", TensorProto.INT4, [], [0])]
    findings = lint(model(nodes, [fp("x", [4])], [fp("y", [4])], inits, opset=21))
    assert rules(findings) == ["int4-blocking"] and {f.node for f in findings} == {"q4", "dq4"}


def test_rule_int4_even():
    findings = lint(int4_weight([3, 3], block_axis=0, block=3))
    assert "int4-even" in rules(findings)


def plugin_node(**attrs):
    return helper.make_node("PagedAttention", ["q", "kc", "vc", "bt", "cl"], ["o"], name="pa",
                            domain="enginesmith", **attrs)


def paged(node):
    ins = [fp("q", [1, 1, 4, 8]), fp("kc", [4, 16, 2, 8]), fp("vc", [4, 16, 2, 8]),
           vi("bt", TensorProto.INT32, [1, 4]), vi("cl", TensorProto.INT32, [1])]
    return model([node], ins, [fp("o", [1, 1, 4, 8])], opset=17, extra_opsets=[("enginesmith", 1)])


GOOD_PLUGIN = dict(num_heads=4, num_kv_heads=2, head_size=8, block_size=16, write_kv=0)


def test_plugin_reference_node_is_clean():
    assert lint(paged(plugin_node(**GOOD_PLUGIN)), "10.15") == []
    assert lint(paged(plugin_node(**GOOD_PLUGIN, plugin_namespace="enginesmith", plugin_version="1")), "10.3") == []


@pytest.mark.parametrize("attrs, target, match", [
    ({**GOOD_PLUGIN, "head_dim": 8}, "10.15", "'head_dim' is not a field"),
    ({k: v for k, v in GOOD_PLUGIN.items() if k != "num_heads"}, "10.15", "required field 'num_heads'"),
    ({**GOOD_PLUGIN, "scale": 1}, "10.15", "'scale' has the wrong type"),
    ({**GOOD_PLUGIN, "plugin_version": "2"}, "10.15", "plugin_version '2'"),
    (GOOD_PLUGIN, "10.3", "ignores the node's domain"),
    ({**GOOD_PLUGIN, "plugin_namespace": "other"}, "10.15", "namespace 'other'"),
])
def test_rule_plugin(attrs, target, match):
    findings = lint(paged(plugin_node(**attrs)), target)
    assert rules(findings) == ["plugin"], findings
    assert any(match in f.message for f in findings), findings


def test_rule_plugin_unknown_creator_and_weight_tensor():
    unknown = helper.make_node("FlashDecode", ["x"], ["y"], name="fd", domain="enginesmith")
    assert rules(lint(model([unknown], [fp("x", [4])], [fp("y", [4])], extra_opsets=[("enginesmith", 1)]))) == ["plugin"]
    weight = numpy_helper.from_array(np.zeros([8, 16], np.float32), "weight")  # fp32: the creator wants fp16/bf16
    sg = helper.make_node("SparseGemm24", ["x"], ["y"], name="sg", domain="enginesmith", weight=weight,
                          out_features=8, in_features=16)
    findings = lint(model([sg], [fp("x", [2, 16])], [fp("y", [2, 8])], extra_opsets=[("enginesmith", 1)]))
    assert [f.rule for f in findings] == ["plugin"] and "float16 or bfloat16" in findings[0].fix


# ----------------------------------------------------------------------------- the table vs the C++ creators

def _creators_from_sources() -> dict[str, dict]:
    out = {}
    namespace = re.search(r'kPluginNamespace\s*=\s*"([^"]+)"', (REPO / "plugins/common/plugin_utils.h").read_text())
    for cpp in sorted(REPO.glob("plugins/*/*_plugin.cpp")):
        text = cpp.read_text()
        name = re.search(r'kName\s*=\s*"([^"]+)"', text).group(1)
        version = re.search(r'kVersion\s*=\s*"([^"]+)"', text).group(1)
        ctor = re.search(name + r"Creator::" + name + r"Creator\(\)\s*\{(.*?)\n\}", text, re.S).group(1)
        fields = re.findall(r'fields_\.emplace_back\("(\w+)",\s*nullptr,\s*PluginFieldType::(k\w+)', ctor)
        build_fields = {f for f, _ in fields}  # runtime-only (serialized) fields are not ours to set
        required = set(re.findall(r'get_int\("(\w+)",\s*[^,]+,\s*true\)', text)) & build_fields
        required |= set(re.findall(r'missing field \'(\w+)\'', text)) & build_fields
        out[name] = {"version": version, "namespace": namespace.group(1), "fields": fields, "required": required}
    return out


def test_plugin_table_matches_the_creators_in_plugins_sources():
    if not (REPO / "plugins/common/plugin_utils.h").exists():
        pytest.skip("plugins/ sources not in this checkout")
    kinds = {"kINT32": "int32", "kFLOAT32": "float32", "kFLOAT16": "half-tensor"}
    sources = _creators_from_sources()
    table = {c.name: c for c in trt_ops.PLUGIN_CREATORS}
    assert set(sources) == set(table)
    for name, src in sources.items():
        c = table[name]
        assert (c.version, c.namespace) == (src["version"], src["namespace"])
        assert [(f.name, f.kind) for f in c.fields] == [(n, kinds[k]) for n, k in src["fields"]], name
        assert {f.name for f in c.fields if f.required} == src["required"], name


# ----------------------------------------------------------------------------- CLI surface

def test_cli_exit_codes(tmp_path, capsys, tiny_engine):
    assert main([str(tiny_engine("llama"))]) == 0
    bad = tmp_path / "bad.onnx"
    onnx.save(model([helper.make_node("Unique", ["x"], ["y"], name="u")], [fp("x", [4])], [fp("y", [4])]), bad)
    assert main([str(bad), "--json"]) == EXIT_FINDINGS
    assert '"rule": "unsupported-op"' in capsys.readouterr().out
    assert main([str(tmp_path / "missing.onnx")]) == 2
    assert main([str(bad), "--trt-version", "8.6"]) == 2
    with pytest.raises(UserError, match="not a TensorRT version"):
        lint(bad, "ten")


def test_target_parsing():
    assert trt_ops.parse_target("10.15.1") == (10, 15)
    assert trt_ops.parse_target("TensorRT-10.13") == (10, 13)
    assert trt_ops.parse_target("11") == (11, 0)
    assert trt_ops.parse_target("10") == (10, 15)
    assert trt_ops.opset_ceiling((10, 3))[0] == 20 and trt_ops.opset_ceiling((10, 15))[0] == 24
