"""fuse_matmul on an exported graph: q/k/v and gate/up siblings fused; the pass manager checks the
outputs against the graph before the pass (it is registered exact)."""

from __future__ import annotations

import collections

import enginesmith.passes.fusion.fuse_matmul  # noqa: F401  (registers the pass)
import onnx
import pytest
from enginesmith.passes import run_pipeline
from enginesmith.passes.fusion.fuse_matmul import FuseMatMulParams


def test_siblings_fused_and_outputs_unchanged(tiny_onnx, tmp_path):
    src = tiny_onnx("llama")
    out = tmp_path / "model.onnx"
    before = collections.Counter(n.op_type for n in onnx.load(str(src), load_external_data=False).graph.node)
    report = run_pipeline(src, out, "fuse_matmul", progress=False)  # verified against the input graph
    counts = report[0]["counts"]
    ops = collections.Counter(n.op_type for n in onnx.load(str(out), load_external_data=False).graph.node)
    assert counts["fused_groups"] == 4  # per layer: q|k|v and gate|up
    assert counts["matmuls_fused"] == 10
    assert ops["MatMul"] == before["MatMul"] - 6 and ops["Split"] == before["Split"] + 4


def test_group_size_is_bounded():
    with pytest.raises(ValueError, match="max_group"):
        FuseMatMulParams(max_group=1)


def test_matmul_transb_is_exact_and_reads_the_tied_table(tiny_onnx, tmp_path):
    """matmul_transb: every constant-weight MatMul becomes FusedMatMul(transB=1) on the weight stored
    [N, K]; a tied lm_head (MatMul over Transpose(embedding)) reads the embedding table itself.
    The pass manager compares the outputs with the graph before the pass."""
    import enginesmith.passes.fusion.matmul_transb  # noqa: F401

    src = tiny_onnx("llama")
    out = tmp_path / "model.onnx"
    report = run_pipeline(src, out, "matmul_transb", progress=False)
    counts = report[0]["counts"]
    ops = collections.Counter(n.op_type for n in onnx.load(str(out), load_external_data=False).graph.node)
    assert ops["MatMul"] == 0 and ops["FusedMatMul"] == counts["fused_matmul_transb"] == 2 * 7 + 1
    assert counts["tied_transpose_removed"] == 1 and ops["Transpose"] < 10
    assert [o.name for o in onnx.load(str(out), load_external_data=False).graph.output][0] == "logits"
