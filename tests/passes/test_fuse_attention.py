"""fuse_attention: every unfused attention the exporters write becomes one ONNX Attention per layer,
the GQA repeat is folded, and the logits do not change (fp32 tolerance); fused graphs pass through.

Unfused inputs: TorchScript exports (dynamo=False, SDPA decomposed by the exporter), TorchScript
exports of eager attention, and dynamo exports at opset 18 (SDPA decomposed by torchlib).
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from enginesmith.passes.fusion.fuse_attention import fuse_attention

from helpers.tiny_families import FAMILIES
GQA = {"llama": True, "qwen2": True, "mistral": True, "gpt2": False}
ATOL = 1e-4


def export_torchscript(model, path: Path, opset: int = 18) -> Path:
    """The TorchScript exporter's graph of KVCacheIO(model): unfused attention."""
    import torch

    from enginesmith.core.io_names import input_names, output_names
    from enginesmith.export.kv_io import KVCacheIO, KVShape
    from enginesmith.export.to_onnx import example_inputs

    shape = KVShape.of(model.config)
    names_in, names_out = input_names(shape.layers), output_names(shape.layers)
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "total"},
            "position_ids": {0: "batch", 1: "sequence"}, "logits": {0: "batch", 1: "sequence"}}
    axes.update({n: {0: "batch", 2: "past"} for n in names_in[3:]})
    axes.update({n: {0: "batch", 2: "total"} for n in names_out[1:]})
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(KVCacheIO(model).eval(), example_inputs(shape, torch.float32), str(path),
                          dynamo=False, opset_version=opset, input_names=names_in,
                          output_names=names_out, dynamic_axes=axes, external_data=True)
    return path


def _model(family: str, eager: bool = False):
    from enginesmith.models.load import load

    model = load(f"tiny:{family}").model
    if eager:
        model.set_attn_implementation("eager")
    return model


@pytest.fixture(scope="module")
def unfused(tmp_path_factory):
    """unfused(family, variant) -> Path: variant "ts" (TorchScript), "eager", "dynamo18"."""
    made: dict = {}

    def get(family: str, variant: str = "ts") -> Path:
        if (family, variant) not in made:
            out = tmp_path_factory.mktemp(f"{family}-{variant}") / "model.onnx"
            if variant == "dynamo18":
                from enginesmith.export.to_onnx import export

                made[family, variant] = export(_model(family), out, opset=18)
            else:
                made[family, variant] = export_torchscript(_model(family, eager=variant == "eager"), out)
        return made[family, variant]

    return get


def fuse_file(src: Path, dst: Path):
    model = ir.load(src)
    result = fuse_attention(model)
    ir.save(model, dst, external_data=dst.name + ".data")
    return result, Counter(n.op_type for n in model.graph), model


def logits_run(path: Path, prompts: list[list[int]], decode: int = 2) -> list[np.ndarray]:
    """Logits of a left-padded batched prefill and `decode` steps (ORT CPU, graph as written).
    Padded positions are set to 0 so that only real tokens are compared."""
    import onnxruntime as ort

    from enginesmith.runtime.decoding.generate import left_pad, positions

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in sess.get_inputs()}
    outputs = [o.name for o in sess.get_outputs()]
    ids, mask = left_pad(prompts, 0)
    feeds = {n: np.zeros((len(prompts), int(inputs[n].shape[1]), 0, int(inputs[n].shape[3])), np.float32)
             for n in inputs if n.startswith("past_key_values.")}
    rng = np.random.default_rng(1)
    result = []
    for step in range(decode + 1):
        feeds.update(input_ids=ids, attention_mask=mask, position_ids=positions(mask, ids.shape[1]))
        out = dict(zip(outputs, sess.run(outputs, feeds)))
        real = mask[:, -ids.shape[1]:].astype(bool)
        result.append(np.where(real[..., None], out["logits"], 0.0))
        feeds.update({p: out[p.replace("past_key_values.", "present.")] for p in feeds if p.startswith("past_")})
        ids = rng.integers(0, 49152, (len(prompts), 1))
        mask = np.concatenate([mask, np.ones((len(prompts), 1), np.int64)], axis=1)
    return result


PROMPTS = [[5, 17, 300, 4000, 12, 9, 77], [42, 8, 1000]]


def assert_same_logits(a: Path, b: Path) -> float:
    worst = max(float(np.abs(x - y).max()) for x, y in zip(logits_run(a, PROMPTS), logits_run(b, PROMPTS)))
    assert worst <= ATOL, worst
    return worst


@pytest.mark.parametrize("family", FAMILIES)
def test_torchscript_export_fuses_every_layer(family, unfused, tmp_path):
    src = unfused(family, "ts")
    result, ops, model = fuse_file(src, tmp_path / "fused.onnx")
    layers = 2
    assert result.counts["attention_fused"] == layers and result.counts["not_fused"] == 0
    assert result.counts["gqa_folded"] == (layers if GQA[family] else 0)
    assert ops["Attention"] == layers and ops["Softmax"] == 0 and ops["IsNaN"] == 0
    assert model.opset_imports[""] == 23
    if GQA[family]:
        assert ops["Expand"] < Counter(n.op_type for n in ir.load(src).graph)["Expand"]
        for node in model.graph:
            if node.op_type == "Attention":  # K/V are the cache itself (Hkv heads), not a repeat
                assert node.inputs[1].name.startswith("present.") and node.inputs[2].name.startswith("present.")
    assert_same_logits(src, tmp_path / "fused.onnx")


@pytest.mark.parametrize("family,variant", [("llama", "eager"), ("gpt2", "eager"), ("llama", "dynamo18"),
                                            ("mistral", "dynamo18")])
def test_other_unfused_variants(family, variant, unfused, tmp_path):
    src = unfused(family, variant)
    result, ops, _ = fuse_file(src, tmp_path / "fused.onnx")
    assert result.counts["attention_fused"] == 2 and ops["Attention"] == 2 and ops["Softmax"] == 0
    assert_same_logits(src, tmp_path / "fused.onnx")


def test_fused_graph_passes_through_unchanged(tiny_engine, tmp_path):
    src = tiny_engine("llama") / "model.onnx"
    before = [(n.op_type, n.name) for n in ir.load(src).graph]
    result, ops, model = fuse_file(src, tmp_path / "same.onnx")
    assert result.counts == {"attention_fused": 0, "gqa_folded": 0, "already_fused": 2, "not_fused": 0}
    assert [(n.op_type, n.name) for n in model.graph] == before


def test_fusing_twice_changes_nothing(unfused, tmp_path):
    fuse_file(unfused("qwen2", "ts"), tmp_path / "once.onnx")
    result, _, model = fuse_file(tmp_path / "once.onnx", tmp_path / "twice.onnx")
    assert result.counts["attention_fused"] == 0 and result.counts["already_fused"] == 2
    assert [n.name for n in model.graph] == [n.name for n in ir.load(tmp_path / "once.onnx").graph]


def test_a_leaked_intermediate_is_not_fused(unfused, tmp_path):
    """Attention weights that are also a graph output (output_attentions) must stay unfused."""
    model = ir.load(unfused("llama", "ts"))
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    model.graph.outputs.append(softmax.outputs[0])
    result = fuse_attention(model)
    assert result.counts["attention_fused"] == 1 and result.counts["not_fused"] == 1
    assert "graph output" in result.skipped[0].reason


def test_runs_in_the_pass_pipeline(unfused, tmp_path):
    from enginesmith.passes import run_pipeline

    report = run_pipeline(unfused("llama", "ts"), tmp_path / "out.onnx", "fuse_attention", progress=False)
    assert report[0]["exact"] and report[0]["counts"]["attention_fused"] == 2
    assert report[0]["max_diff"] is not None and report[0]["max_diff"] <= report[0]["tolerance"]


@pytest.mark.slow
def test_smollm2_torchscript_export_fuses_all_30_layers(smollm2, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2-ts")
    src = export_torchscript(smollm2.model, out / "model.onnx")
    result, ops, _ = fuse_file(src, out / "fused.onnx")
    assert result.counts["attention_fused"] == 30 and result.counts["gqa_folded"] == 30
    assert ops["Attention"] == 30 and ops["Softmax"] == 0
    worst = assert_same_logits(src, out / "fused.onnx")
    print(f"SmolLM2 TorchScript: 30/30 layers fused, max |logits diff| {worst:.2e}")
