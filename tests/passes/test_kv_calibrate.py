"""passes/analysis/kv_calibrate.py: where the KV bounds of quantized KV caches are collected.

The graph calibrated is the lowered one (enginesmith's GEMV and attention ops), whose CPU kernels are
the scalar references: a 1B model's calibration did not finish on a 16-core machine (H200 host, session
16), so ENGINESMITH_KV_CALIB_DEVICE=cuda collects the bounds through the ops' CUDA kernels. Oracle: the
CPU collection of the same graph, windows and tokens (tiny llama, head size 64, fp16).
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers.external import needs_cuda

from enginesmith.core.errors import UserError
from enginesmith.passes.analysis import kv_calibrate
from enginesmith.passes.analysis.calibrate import from_tokens

CAPACITY = 128


@pytest.fixture(scope="module")
def lowered(ort_ops_lib, tmp_path_factory):
    """The graph quantize_kv starts from: tiny llama (head size 64) lowered with enginesmith's attention op."""
    pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    from enginesmith.builder.engine import BuildConfig, build, cached_engine

    mp = pytest.MonkeyPatch()
    mp.setenv("ENGINESMITH_ORT_OPS_LIB", str(ort_ops_lib))
    src = cached_engine(BuildConfig(model="tiny:llama-hd64", dtype="fp16"), progress=False)
    out = build(BuildConfig(target="ort-cuda", dtype="fp16", capacity=CAPACITY, custom_ops=True,
                            custom_attention=True), tmp_path_factory.mktemp("kvcal") / "engine", source=src,
                progress=False)
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    layers = [(n.input[0], *(next(a.i for a in n.attribute if a.name == key) for key in ("num_heads", "kv_num_heads")))
              for n in model.graph.node if n.op_type == "GroupQueryAttention" and n.domain == "com.enginesmith"]
    assert layers
    yield out / "model.onnx", layers, ort_ops_lib
    mp.undo()


def _bounds(lowered, device, cache, monkeypatch):
    path, layers, ops_lib = lowered
    monkeypatch.setenv("ENGINESMITH_CACHE", str(cache))  # a cache of its own: bounds are cached by graph, not device
    monkeypatch.setenv("ENGINESMITH_KV_CALIB_DEVICE", device)
    calib = from_tokens(np.random.default_rng(0).integers(0, 49152, 4096), "random", samples=2, seq_len=96)
    return kv_calibrate.collect(path, layers, calib, 2, CAPACITY, ops_lib, progress=False)


def test_the_device_is_the_cpu_unless_named(monkeypatch):
    monkeypatch.delenv("ENGINESMITH_KV_CALIB_DEVICE", raising=False)
    assert kv_calibrate.calib_device() == "cpu"
    monkeypatch.setenv("ENGINESMITH_KV_CALIB_DEVICE", "gpu")
    with pytest.raises(UserError, match="cpu or cuda"):
        kv_calibrate.calib_device()


def test_cpu_bounds_are_positive_and_cached(lowered, tmp_path, monkeypatch):
    first = _bounds(lowered, "cpu", tmp_path, monkeypatch)
    assert len(first) == len(lowered[1]) and all((b.key > 0).any() and (b.value > 0).any() for b in first)
    assert list((tmp_path / "calib").glob("kv-*.npz"))
    again = _bounds(lowered, "cpu", tmp_path, monkeypatch)
    assert all(np.array_equal(a.key, b.key) and np.array_equal(a.value, b.value) for a, b in zip(first, again))


@pytest.mark.gpu
@needs_cuda
def test_gpu_bounds_match_the_cpu_kernels(lowered, tmp_path, monkeypatch):
    cpu = _bounds(lowered, "cpu", tmp_path / "cpu", monkeypatch)
    cuda = _bounds(lowered, "cuda", tmp_path / "cuda", monkeypatch)
    for a, b in zip(cpu, cuda):  # fp16 activations, accumulated in another order: a few units of rounding
        np.testing.assert_allclose(b.key, a.key, rtol=2e-2, atol=1e-3)
        np.testing.assert_allclose(b.value, a.value, rtol=2e-2, atol=1e-3)
