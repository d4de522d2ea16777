"""Gemma 2/3 engines through com.enginesmith.GroupQueryAttention (issue 21): soft-capping, sliding
windows and head size 256 in a whole model.

tiny:gemma2 (every layer soft-capped at 50, layer 0 sliding with a window of 8) and tiny:gemma3
(layer 0 sliding, 8) have head size 256 and 2 query heads per KV head. Each is lowered for CUDA with
and without the custom ops (--custom-ops on --custom-attention); the engine with them must give the
logits of the one without (ORT's own com.microsoft.GroupQueryAttention, the oracle), teacher-forced on
a prompt and decode steps that cross the window.
CPU (here and in CI): the ops' CPU kernels on ORT CPU. GPU (marked gpu): the CUDA kernels, in the
CUDA-graph engine, against the CPU graph without the ops.
(tiny:mistral-sw has head size 16, which the op does not take: ort_attention leaves it to ORT's op.)
"""

from __future__ import annotations

import json

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from test_ort_ops import _teacher_forced_logits, gpu  # noqa: E402

FAMILIES = {  # per layer: (softcap, local_window_size) the op must carry
    "gemma2": [(50.0, 8), (50.0, None)],
    "gemma3": [(None, 8), (None, None)],
}


@pytest.fixture(scope="module")
def engines(ops_lib, tmp_path_factory):
    from enginesmith.builder.engine import BuildConfig, build, cached_engine

    out = {}
    for name in FAMILIES:
        src = cached_engine(BuildConfig(model=f"tiny:{name}", dtype="fp16"), progress=False)
        for ops in (False, True):
            out[name, ops] = build(BuildConfig(target="ort-cuda", dtype="fp16", capacity=64, custom_ops=ops,
                                               custom_attention=ops), tmp_path_factory.mktemp(name) / "engine",
                                               source=src, progress=False)
    return out


def _tokens(seed: int, prompt_len: int = 13, follow: int = 12):
    """A prompt longer than the window of 8 and decode steps past it."""
    rng = np.random.default_rng(seed)
    return rng.integers(3, 200, prompt_len).tolist(), rng.integers(3, 200, follow).tolist()


@pytest.mark.parametrize("name", FAMILIES)
def test_every_layer_takes_the_op_with_its_softcap_and_window(engines, name):
    manifest = json.loads((engines[name, True] / "build.json").read_text())
    assert manifest["pass_counts"]["ort_attention"] == {"attention": 2}
    nodes = [n for n in onnx.load(str(engines[name, True] / "model.onnx"), load_external_data=False).graph.node
             if n.op_type == "GroupQueryAttention"]
    assert [n.domain for n in nodes] == ["com.enginesmith"] * 2
    got = []
    for n in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        got.append((attrs.get("softcap"), attrs.get("local_window_size")))
    assert got == FAMILIES[name]


@pytest.mark.parametrize("name", FAMILIES)
def test_cpu_engine_with_the_op_matches_ort_gqa(engines, name):
    prompt, follow = _tokens(1)
    want = _teacher_forced_logits(engines[name, False], "cpu", prompt, follow)
    got = _teacher_forced_logits(engines[name, True], "cpu", prompt, follow)
    assert got.shape == want.shape == (len(prompt) + len(follow), want.shape[-1])
    scale = float(np.abs(want).max())
    assert np.abs(got - want).max() <= 1e-2 * scale, (float(np.abs(got - want).max()), scale)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("prompt_len", [7, 21])  # within the window / past it in the prefill
def test_cuda_engine_with_the_op_matches_the_cpu_graph(engines, name, prompt_len):
    """The CUDA kernels (head size 256, softcap, window; decode through CUDA graphs) against the CPU
    graph without the ops, teacher-forced on the same tokens."""
    prompt, follow = _tokens(prompt_len, prompt_len, 30)
    want = _teacher_forced_logits(engines[name, False], "cpu", prompt, follow)
    got = _teacher_forced_logits(engines[name, True], "cuda", prompt, follow)
    assert got.shape == want.shape
    scale = float(np.abs(want).max())
    assert np.abs(got - want).max() <= 2e-2 * scale, (float(np.abs(got - want).max()), scale)
