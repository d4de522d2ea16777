"""Folding is exact: the smoothed (or AWQ-scaled) graph computes the original's logits."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from enginesmith.passes import run_pipeline
from enginesmith.passes.machinery.edit import Namer
from enginesmith.passes.quant.fold import fold_scales
from enginesmith.passes.manager.pipeline import save
from enginesmith.passes.analysis.sites import plan
from enginesmith.passes.manager.verify import compare

from quant_helpers import ort_logits


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_smoothquant_fold_is_exact(tiny_onnx, calib, tmp_path, family):
    src = tiny_onnx(family)
    report = run_pipeline(src, tmp_path / "sq.onnx", "smoothquant:alpha=0.5", calibration=calib,
                          progress=False)
    (entry,) = report
    assert entry["exact"] and entry["max_diff"] is not None
    assert entry["max_diff"] <= entry["tolerance"]
    assert entry["counts"]["sites"] == {"llama": 8, "gpt2": 4, "qwen2": 8}[family]
    # the activations the following linears see are smoother: outliers moved into the weights
    assert all(d["act_max_smoothed"] < d["act_max"] for d in entry["details"] if d["kind"] == "norm")
    ids = np.random.default_rng(1).integers(0, 49152, size=(1, 9))
    a, b = ort_logits(src, ids), ort_logits(tmp_path / "sq.onnx", ids)
    assert np.abs(a - b).max() <= 1e-3 * np.abs(a).max()


def test_random_scales_fold_exactly_and_a_wrong_fold_is_caught(tiny_onnx, tmp_path):
    """fold_scales with arbitrary positive scales (incl. GQA v -> o) keeps the logits; scaling the
    producer without the consumers does not, and compare() sees it."""
    src = tiny_onnx("llama")
    model = ir.load(src)
    sites, _ = plan(model, False, True, True)
    rng, namer = np.random.default_rng(0), Namer(model.graph)
    for site in sites:
        fold_scales(model.graph, namer, site, np.exp(rng.normal(0, 1.0, site.channels)))
    save(model, tmp_path / "ok" / "model.onnx")
    good = compare(src, tmp_path / "ok" / "model.onnx")
    assert good.ok and good.max_diff < 1e-4 * good.scale

    model = ir.load(src)
    site = plan(model, False, True, True)[0][0]
    site.consumers = []                                   # "forget" the consumers: not exact
    fold_scales(model.graph, Namer(model.graph), site, np.full(site.channels, 2.0))
    save(model, tmp_path / "bad" / "model.onnx")
    assert not compare(src, tmp_path / "bad" / "model.onnx").ok


def test_awq_fold_is_exact_and_never_worse_than_rtn(tiny_onnx, calib, tmp_path):
    report = run_pipeline(tiny_onnx("llama"), tmp_path / "awq.onnx", "awq:block_size=32,grid=10",
                          calibration=calib, progress=False)
    (entry,) = report
    assert entry["max_diff"] <= entry["tolerance"]
    assert entry["counts"]["sites"] == 8
    assert all(d["error"] <= d["rtn_error"] + 1e-12 for d in entry["details"])
    assert entry["counts"]["scaled"] + entry["counts"]["kept_rtn"] == 8
