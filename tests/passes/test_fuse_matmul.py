"""fuse_matmul on an exported graph: q/k/v and gate/up siblings fused; the pass manager checks the
outputs against the graph before the pass (it is registered exact)."""

from __future__ import annotations

import collections

import enginesmith.passes.fuse_matmul  # noqa: F401  (registers the pass)
import onnx
import pytest
from enginesmith.passes import run_pipeline
from enginesmith.passes.fuse_matmul import FuseMatMulParams


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
