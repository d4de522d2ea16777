"""The pass manager: reports, dumps, calibration cache, and bad input that leaves nothing behind."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import pytest

from enginesmith.core.errors import UserError
from enginesmith.passes import from_tokens, run_pipeline
from enginesmith.passes.analysis import calibrate
from enginesmith.passes.analysis.linears import find_linears
from enginesmith.passes.manager.pipeline import save
from enginesmith.passes.machinery.registry import PassResult, Step, register


def _leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_report_and_dump_dir(tiny_onnx, calib, tmp_path):
    dumps = tmp_path / "dumps"
    report = run_pipeline(tiny_onnx("llama"), tmp_path / "out" / "model.onnx",
                          "smoothquant,quantize_w8a8", calibration=calib, dump_dir=dumps, progress=False)
    assert [r["name"] for r in report] == ["smoothquant", "quantize_w8a8"]
    for r in report:
        assert {"params", "exact", "counts", "skipped", "max_diff", "seconds"} <= set(r)
    assert report[0]["params"]["alpha"] == 0.5 and report[1]["max_diff"] is None
    assert sorted(p.name for p in dumps.iterdir()) == ["01-smoothquant", "02-quantize_w8a8"]
    assert (dumps / "01-smoothquant" / "model.onnx.data").is_file()
    assert _leftovers(tmp_path / "out") == ["model.onnx", "model.onnx.data"]   # no temp dirs left


def test_calibration_is_cached_by_graph_and_set(tiny_onnx, calib, monkeypatch):
    path = tiny_onnx("llama")
    names = sorted({lin.x.name for lin in find_linears(ir.load(path))[0]})
    first = calibrate.collect(path, names, calib, rows=16, progress=False)
    assert first[names[0]].rows.shape == (16, first[names[0]].amax.shape[0])
    assert np.all(first[names[0]].amax >= first[names[0]].mean)

    def no_run(*a, **k):
        raise AssertionError("statistics should come from the cache")

    monkeypatch.setattr(calibrate, "_run", no_run)
    again = calibrate.collect(path, names[:3], calib, rows=16, progress=False)
    assert np.array_equal(again[names[0]].amax, first[names[0]].amax)
    other = from_tokens(np.arange(200), "other", samples=2, seq_len=32)
    with pytest.raises(AssertionError):                        # another set is another key
        calibrate.collect(path, names, other, rows=16, progress=False)


def test_too_little_calibration_text():
    with pytest.raises(UserError, match="has 100 tokens") as err:
        from_tokens(np.arange(100), "short.txt", samples=4, seq_len=32)
    assert "fewer" in err.value.fix
    with pytest.raises(UserError):
        from_tokens(np.arange(1000), "x", samples=0, seq_len=32)


def test_graph_without_quantizable_layers(tmp_path, calib):
    x = ir.Value(name="input_ids", shape=ir.Shape([1, 4]), type=ir.TensorType(ir.DataType.FLOAT))
    node = ir.Node("", "Relu", [x], num_outputs=1)
    node.outputs[0].name, node.outputs[0].shape = "y", ir.Shape([1, 4])
    node.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([x], [node.outputs[0]], nodes=[node], opset_imports={"": 23}, name="no_linears")
    src = tmp_path / "src" / "model.onnx"
    save(ir.Model(graph, ir_version=10), src)
    out = tmp_path / "out"
    for spec in ("quantize_w8a8", "quantize_w4a16", "smoothquant,quantize_w8a8"):
        with pytest.raises(UserError, match="no quantizable linear layers"):
            run_pipeline(src, out / "model.onnx", spec, calibration=calib, progress=False)
        assert _leftovers(out) == []                           # nothing half-written
    (sq,) = run_pipeline(src, out / "model.onnx", "smoothquant", calibration=calib, progress=False)
    assert sq["counts"]["sites"] == 0                          # a smoothing pass just reports the skip


def test_calibrated_pass_without_calibration(tiny_onnx, tmp_path):
    with pytest.raises(UserError, match="need calibration"):
        run_pipeline(tiny_onnx("llama"), tmp_path / "m.onnx", "awq,quantize_w4a16", progress=False)
    with pytest.raises(UserError, match="does not exist"):
        run_pipeline(tmp_path / "missing.onnx", tmp_path / "m.onnx", "quantize_w4a16", progress=False)


def test_calibration_need_depends_on_the_parameters(tiny_onnx, tmp_path):
    """sparsify reads activation statistics only for Wanda: magnitude pruning runs without calibration."""
    (report,) = run_pipeline(tiny_onnx("llama"), tmp_path / "magnitude" / "model.onnx",
                             "sparsify:method=magnitude,only_profitable=false", progress=False)
    assert report["counts"]["pruned_24"] == 14
    for spec in ("sparsify:only_profitable=false", "sparsify:method=wanda,only_profitable=false"):
        with pytest.raises(UserError, match="passes sparsify need calibration data") as err:
            run_pipeline(tiny_onnx("llama"), tmp_path / "wanda" / "model.onnx", spec, progress=False)
        assert "calibration set" in err.value.fix


@dataclass(frozen=True)
class NoParams:
    pass


@register("test_break_weights", NoParams, exact=True)
def _break(model, params, ctx):
    """A deliberately wrong 'exact' pass: doubles one weight."""
    for value in model.graph.initializers.values():
        if value.const_value is not None and len(value.const_value.shape) == 2 \
                and value.const_value.shape[0] < 1000:
            value.const_value = ir.Tensor(value.const_value.numpy() * 2, name=value.name)
            break
    return PassResult({"broken": 1})


def test_exact_pass_that_changes_outputs_fails_loudly(tiny_onnx, tmp_path):
    from enginesmith.passes import PassCheckError

    out = tmp_path / "out"
    existing = out / "model.onnx"
    out.mkdir()
    existing.write_text("previous build")
    with pytest.raises(PassCheckError, match="changed the logits"):
        run_pipeline(tiny_onnx("llama"), existing, [Step("test_break_weights", NoParams())], progress=False)
    assert existing.read_text() == "previous build"            # the old output is untouched
    assert _leftovers(out) == ["model.onnx"]
