"""The pass pipelines a build runs and what it records of them, pinned: the `step.spec()` list of each
BuildConfig (build.json's "passes", in order, with its params), the settings that name its engine in the
cache (BuildConfig.key without the version), and build.json's kv_layout and calibration records.

The literals were recorded from the builder before its pipelines became typed steps (issue 31); a change
here changes the engines a build writes, or their cache keys: make it on purpose, never in a refactor.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from enginesmith.builder.config import BuildConfig, key_fields
from enginesmith.builder.manifest import calibration_note, cuda_kv_layout, kv_layout
from enginesmith.builder.pipeline import steps
from enginesmith.passes import parse_pipeline
from enginesmith.plugins import ort_ops


def _settings_hash(config: BuildConfig) -> str:
    """The cache key's settings part without the version (BuildConfig.key hashes these + __version__)."""
    return hashlib.sha256(json.dumps(key_fields(config), sort_keys=True).encode()).hexdigest()[:12]


def _same_as_text(pass_steps: list) -> None:
    """The steps equal those their spec text parses to, field by field and in type (no 1 for 1.0, no "4" for 4)."""
    if not pass_steps:
        return
    parsed = parse_pipeline(",".join(s.spec() for s in pass_steps))
    assert parsed == pass_steps
    def types(step):
        return {k: type(v) for k, v in vars(step.params).items()}

    assert [types(s) for s in pass_steps] == [types(s) for s in parsed]


# ort-cpu and trt: (BuildConfig fields, step specs, settings hash)
CPU = [
    pytest.param(dict(),
                 [],
                 "0bf78b60fe45", id="plain fp32"),
    pytest.param(dict(dtype="fp16"),
                 [],
                 "e79cc7403ad5", id="dense fp16"),
    pytest.param(dict(quant="w8a8-naive"),
                 ["quantize_w8a8", "lower_ort"],
                 "1f4cc13fac32", id="w8a8-naive"),
    pytest.param(dict(quant="w8a8-sq"),
                 ["smoothquant:search=true", "quantize_w8a8", "lower_ort"],
                 "ecedf2cfeed4", id="w8a8-sq searched"),
    pytest.param(dict(quant="w8a8-sq", alpha=0.6),
                 ["smoothquant:alpha=0.6", "quantize_w8a8", "lower_ort"],
                 "14d511ba3bc7", id="w8a8-sq alpha"),
    pytest.param(dict(quant="w4a16-rtn"),
                 ["quantize_w4a16", "lower_ort"],
                 "eed3bc5ce931", id="w4a16-rtn"),
    pytest.param(dict(quant="w4a16-rtn", block_size=64, accuracy_level=4),
                 ["quantize_w4a16:block_size=64", "lower_ort:accuracy_level=4"],
                 "9b56ad1b7e62", id="w4a16-rtn block 64 level 4"),
    pytest.param(dict(quant="w4a16-awq", block_size=32),
                 ["awq:block_size=32", "awq_clip:block_size=32", "quantize_w4a16:block_size=32", "lower_ort"],
                 "d7837b0ec06d", id="w4a16-awq"),
    pytest.param(dict(quant="w4a16-gptq"),
                 ["gptq", "lower_ort"],
                 "12c73f5e1c6c", id="w4a16-gptq"),
    pytest.param(dict(quant="w4a16-gptq-asym"),
                 ["gptq:symmetric=false", "lower_ort"],
                 "0b3fea82542e", id="w4a16-gptq-asym"),
    pytest.param(dict(passes="smoothquant:alpha=0.6,quantize_w8a8"),
                 ["smoothquant:alpha=0.6", "quantize_w8a8", "lower_ort"],
                 "4b67fb775737", id="passes text"),
    pytest.param(dict(quant="w4a16-rtn", passes="fuse_matmul"),
                 ["quantize_w4a16", "fuse_matmul", "lower_ort"],
                 "bfc30a3781d2", id="preset and passes"),
    pytest.param(dict(kv_layout="ring"),
                 ["kv_ring"],
                 "225dcc117d4a", id="ring default"),
    pytest.param(dict(kv_layout="ring", kv_sinks=2, kv_window=62),
                 ["kv_ring:sinks=2,window=62"],
                 "a98dddde7244", id="ring sinks window"),
    pytest.param(dict(kv_layout="ring", kv_sinks=0, kv_window=64),
                 ["kv_ring:sinks=0,window=64"],
                 "a9e9b0c9764b", id="ring no sinks"),
    pytest.param(dict(kv_layout="ring", kv_sinks=4, kv_window=60, quant="w4a16-rtn"),
                 ["quantize_w4a16", "kv_ring:window=60", "lower_ort"],
                 "cc540857db99", id="ring w4a16"),
    pytest.param(dict(kv_layout="h2o", kv_budget=64),
                 ["kv_ring:sinks=0,window=64", "kv_h2o"],
                 "9045e80be147", id="h2o"),
    pytest.param(dict(kv_layout="h2o", kv_budget=128, quant="w8a8-naive"),
                 ["quantize_w8a8", "kv_ring:sinks=0,window=128", "kv_h2o", "lower_ort"],
                 "eff2f80111a9", id="h2o w8a8"),
    pytest.param(dict(kv_layout="paged"),
                 ["kv_paged"],
                 "e989ba8e0060", id="paged cpu"),
    pytest.param(dict(kv_layout="paged", page_size=32),
                 ["kv_paged:page_size=32"],
                 "e4df4596af75", id="paged cpu page 32"),
    pytest.param(dict(kv_layout="paged", quant="w4a16-rtn"),
                 ["quantize_w4a16", "kv_paged", "lower_ort"],
                 "5ab3bc718f2f", id="paged w4a16"),
    pytest.param(dict(target="trt"),
                 [],
                 "2895675f8a6a", id="trt plain"),
    pytest.param(dict(target="trt", quant="w8a8-naive"),
                 ["quantize_w8a8"],
                 "13ce8d1aa41d", id="trt w8a8"),
    pytest.param(dict(target="trt", kv_layout="paged", page_size=64),
                 ["kv_paged:page_size=64,lower=trt"],
                 "75c852061de1", id="trt paged"),
    pytest.param(dict(target="trt", kv_layout="ring", kv_sinks=4, kv_window=124),
                 ["kv_ring:window=124"],
                 "f5f2e700f17c", id="trt ring"),
]

# ort-cuda: (BuildConfig fields, the model's context, its export has no Attention op, ort_ops.available(),
# step specs, settings hash)
C = dict(target="ort-cuda", dtype="fp16")
CUDA = [
    pytest.param(dict(C, custom_ops=False), 512, False, False,
                 ["lower_gqa:capacity=512", "skip_rmsnorm", "matmul_transb"],
                 "90de1f16fa83", id="cuda plain"),
    pytest.param(dict(target="ort-cuda", dtype="bf16", capacity=128, custom_ops=False), 512, False, False,
                 ["lower_gqa:capacity=128", "skip_rmsnorm", "matmul_transb"],
                 "2c02569e9628", id="cuda bf16 capacity"),
    pytest.param(dict(C, capacity=1024, custom_ops=False), 512, False, False,
                 ["lower_gqa:capacity=1024", "skip_rmsnorm", "matmul_transb"],
                 "937909d009fd", id="cuda capacity over context"),
    pytest.param(dict(C, custom_ops=False), 512, True, False,
                 ["fuse_attention", "lower_gqa:capacity=512", "skip_rmsnorm", "matmul_transb"],
                 "90de1f16fa83", id="cuda unfused"),
    pytest.param(dict(C), 512, False, True,
                 ["lower_gqa:capacity=512", "skip_rmsnorm", "matmul_transb", "ort_gemv"],
                 "9ba8f8e253c6", id="cuda ops found"),
    pytest.param(dict(C), 512, False, False,
                 ["lower_gqa:capacity=512", "skip_rmsnorm", "matmul_transb"],
                 "9ba8f8e253c6", id="cuda ops absent"),
    pytest.param(dict(C, custom_ops=True), 2048, False, False,
                 ["lower_gqa:capacity=2048", "skip_rmsnorm", "matmul_transb", "ort_gemv"],
                 "4ee7191bdd1d", id="cuda custom ops"),
    pytest.param(dict(C, custom_ops=False, max_batch=4), 512, False, False,
                 ["lower_gqa:capacity=512", "skip_rmsnorm", "matmul_transb"],
                 "998562418872", id="cuda max_batch"),
    pytest.param(dict(C, custom_attention=True), 512, False, False,
                 ["lower_gqa:capacity=512", "skip_rmsnorm", "matmul_transb", "ort_gemv", "ort_attention"],
                 "4f405619335b", id="cuda custom attention"),
    pytest.param(dict(C, custom_attention=True, kv_dtype="int8"), 512, False, False,
                 ["lower_gqa:capacity=512", "skip_rmsnorm", "matmul_transb", "ort_gemv", "ort_attention",
                  "quantize_kv"],
                 "dd3a4d01a676", id="cuda attention int8"),
    pytest.param(dict(C, custom_attention=True, kv_dtype="fp8"), 512, True, False,
                 ["fuse_attention", "lower_gqa:capacity=512", "skip_rmsnorm", "matmul_transb", "ort_gemv",
                  "ort_attention", "quantize_kv:kv_dtype=fp8"],
                 "b3e79a304a3c", id="cuda attention fp8"),
    pytest.param(dict(C, quant="w4a16-rtn", custom_ops=False), 512, False, False,
                 ["lower_gqa:capacity=512", "skip_rmsnorm", "quantize_w4a16", "lower_ort", "matmul_transb"],
                 "5de8b178a62e", id="cuda w4a16"),
    pytest.param(dict(C, quant="w4a16-rtn", quantize_lm_head=True, block_size=64, custom_ops=True), 512, False, False,
                 ["lower_gqa:capacity=512", "skip_rmsnorm", "untie_lm_head",
                  "quantize_w4a16:block_size=64,include_lm_head=true", "lower_ort", "matmul_transb", "ort_gemv"],
                 "5712d94eb0f1", id="cuda w4a16 lm_head block 64"),
    pytest.param(dict(C, kv_layout="paged"), 512, False, False,
                 ["lower_gqa:capacity=512", "skip_rmsnorm", "matmul_transb", "ort_gemv", "ort_attention", "paged_gqa"],
                 "b96ace1abd7b", id="cuda paged"),
    pytest.param(dict(C, kv_layout="paged", page_size=32, custom_ops=True), 512, False, True,
                 ["lower_gqa:capacity=512", "skip_rmsnorm", "matmul_transb", "ort_gemv", "ort_attention",
                  "paged_gqa:page_size=32"],
                 "e70384cdeecd", id="cuda paged page 32 ops"),
    pytest.param(dict(C, kv_layout="paged", kv_dtype="int8", max_batch=8), 4096, False, False,
                 ["lower_gqa", "skip_rmsnorm", "matmul_transb", "ort_gemv", "ort_attention",
                  "paged_gqa:kv_dtype=int8"],
                 "2c97a77ad357", id="cuda paged int8"),
    pytest.param(dict(C, kv_layout="paged", quant="w4a16-rtn", quantize_lm_head=True), 512, True, False,
                 ["fuse_attention", "lower_gqa:capacity=512", "skip_rmsnorm", "untie_lm_head",
                  "quantize_w4a16:include_lm_head=true", "lower_ort", "matmul_transb", "ort_gemv", "ort_attention",
                  "paged_gqa"],
                 "a2f1645c65de", id="cuda paged w4a16 lm_head unfused"),
]

@pytest.mark.parametrize("fields, specs, settings", CPU)
def test_cpu_and_trt_pipelines_are_pinned(fields, specs, settings):
    config = BuildConfig(**fields)
    pass_steps = steps(config)
    assert [s.spec() for s in pass_steps] == specs
    assert _settings_hash(config) == settings
    _same_as_text(pass_steps)


@pytest.mark.parametrize("fields, max_positions, unfused, ops_built, specs, settings", CUDA)
def test_cuda_pipelines_are_pinned(fields, max_positions, unfused, ops_built, specs, settings, monkeypatch):
    monkeypatch.setattr(ort_ops, "available", lambda: ops_built)  # custom_ops None: the ops when built
    config = BuildConfig(**fields)
    pass_steps = steps(config, max_positions, unfused)
    assert [s.spec() for s in pass_steps] == specs
    assert _settings_hash(config) == settings
    _same_as_text(pass_steps)


@pytest.mark.parametrize("fields", [dict(kv_layout="ring", kv_sinks=2, kv_window=62), dict(kv_layout="h2o"),
                                    dict(kv_layout="paged"), dict(target="trt", kv_layout="paged"),
                                    dict(C, custom_ops=True, custom_attention=True, kv_dtype="int8", capacity=64),
                                    dict(C, quant="w4a16-rtn", quantize_lm_head=True, kv_layout="paged")])
def test_the_builders_own_steps_are_built_typed_not_parsed(fields, monkeypatch):
    """No text between the BuildConfig and its steps (only --passes and the presets' table are text)."""
    from enginesmith.passes.manager import steps as step_text

    def no_text(*args):
        raise AssertionError(f"a step parameter went through text: {args}")

    monkeypatch.setattr(step_text, "_convert", no_text)
    assert steps(BuildConfig(**fields), 512)


def test_a_cuda_pipeline_needs_a_capacity():
    with pytest.raises(ValueError, match="KV capacity"):
        steps(BuildConfig(target="ort-cuda", dtype="fp16", custom_ops=False))


# build.json of an ort-cpu or trt build of a model of 2048 positions: (BuildConfig fields, kv_layout, calibration)
KV = [
    (dict(),
     {"type": "dense", "capacity": 2048},
     None),
    (dict(dtype="fp16"),
     {"type": "dense", "capacity": 2048},
     None),
    (dict(quant="w8a8-naive"),
     {"type": "dense", "capacity": 2048},
     {"text": "austen:emma", "samples": 32}),
    (dict(quant="w8a8-sq"),
     {"type": "dense", "capacity": 2048},
     {"text": "austen:emma", "samples": 32}),
    (dict(quant="w8a8-sq", alpha=0.6),
     {"type": "dense", "capacity": 2048},
     {"text": "austen:emma", "samples": 32}),
    (dict(quant="w4a16-rtn"),
     {"type": "dense", "capacity": 2048},
     None),
    (dict(quant="w4a16-rtn", block_size=64, accuracy_level=4),
     {"type": "dense", "capacity": 2048},
     None),
    (dict(quant="w4a16-awq", block_size=32),
     {"type": "dense", "capacity": 2048},
     {"text": "austen:emma", "samples": 32}),
    (dict(quant="w4a16-gptq"),
     {"type": "dense", "capacity": 2048},
     {"text": "austen:emma", "samples": 32}),
    (dict(quant="w4a16-gptq-asym"),
     {"type": "dense", "capacity": 2048},
     {"text": "austen:emma", "samples": 32}),
    (dict(passes="smoothquant:alpha=0.6,quantize_w8a8"),
     {"type": "dense", "capacity": 2048},
     {"text": "austen:emma", "samples": 32}),
    (dict(quant="w4a16-rtn", passes="fuse_matmul"),
     {"type": "dense", "capacity": 2048},
     None),
    (dict(kv_layout="ring"),
     {"type": "ring", "sinks": 4, "window": 1020, "capacity": 1024},
     None),
    (dict(kv_layout="ring", kv_sinks=2, kv_window=62),
     {"type": "ring", "sinks": 2, "window": 62, "capacity": 64},
     None),
    (dict(kv_layout="ring", kv_sinks=0, kv_window=64),
     {"type": "ring", "sinks": 0, "window": 64, "capacity": 64},
     None),
    (dict(kv_layout="ring", kv_sinks=4, kv_window=60, quant="w4a16-rtn"),
     {"type": "ring", "sinks": 4, "window": 60, "capacity": 64},
     None),
    (dict(kv_layout="h2o", kv_budget=64),
     {"type": "ring", "policy": "h2o", "sinks": 0, "window": 64, "capacity": 64},
     None),
    (dict(kv_layout="h2o", kv_budget=128, quant="w8a8-naive"),
     {"type": "ring", "policy": "h2o", "sinks": 0, "window": 128, "capacity": 128},
     {"text": "austen:emma", "samples": 32}),
    (dict(kv_layout="paged"),
     {"type": "paged", "page_size": 16, "capacity": 2048},
     None),
    (dict(kv_layout="paged", page_size=32),
     {"type": "paged", "page_size": 32, "capacity": 2048},
     None),
    (dict(kv_layout="paged", quant="w4a16-rtn"),
     {"type": "paged", "page_size": 16, "capacity": 2048},
     None),
    (dict(target="trt"),
     {"type": "dense", "capacity": 2048},
     None),
    (dict(target="trt", quant="w8a8-naive"),
     {"type": "dense", "capacity": 2048},
     {"text": "austen:emma", "samples": 32}),
    (dict(target="trt", kv_layout="paged", page_size=64),
     {"type": "paged", "page_size": 64, "capacity": 2048},
     None),
    (dict(target="trt", kv_layout="ring", kv_sinks=4, kv_window=124),
     {"type": "ring", "sinks": 4, "window": 124, "capacity": 128},
     None),
]

@pytest.mark.parametrize("fields, record, calibration", KV)
def test_build_records_are_pinned(fields, record, calibration):
    config = BuildConfig(**fields)
    assert kv_layout(config, 2048) == record
    assert list(kv_layout(config, 2048)) == list(record)  # build.json keeps the order
    assert calibration_note(config, steps(config)) == calibration


# build.json of an ort-cuda lowering: (BuildConfig fields, the model's context, kv_layout)
CUDA_KV = [
    (dict(C, custom_ops=False), 512,
     {"type": "dense", "io": "gqa-shared-buffer", "capacity": 512}),
    (dict(target="ort-cuda", dtype="bf16", capacity=128, custom_ops=False), 512,
     {"type": "dense", "io": "gqa-shared-buffer", "capacity": 128}),
    (dict(C, capacity=1024, custom_ops=False), 512,
     {"type": "dense", "io": "gqa-shared-buffer", "capacity": 1024}),
    (dict(C, custom_ops=False), 512,
     {"type": "dense", "io": "gqa-shared-buffer", "capacity": 512}),
    (dict(C), 512,
     {"type": "dense", "io": "gqa-shared-buffer", "capacity": 512}),
    (dict(C), 512,
     {"type": "dense", "io": "gqa-shared-buffer", "capacity": 512}),
    (dict(C, custom_ops=True), 2048,
     {"type": "dense", "io": "gqa-shared-buffer", "capacity": 2048}),
    (dict(C, custom_ops=False, max_batch=4), 512,
     {"type": "dense", "io": "gqa-shared-buffer", "capacity": 512, "max_batch": 4}),
    (dict(C, custom_attention=True), 512,
     {"type": "dense", "io": "gqa-shared-buffer", "capacity": 512}),
    (dict(C, custom_attention=True, kv_dtype="int8"), 512,
     {"type": "dense", "io": "gqa-shared-buffer", "capacity": 512, "kv_dtype": "int8"}),
    (dict(C, custom_attention=True, kv_dtype="fp8"), 512,
     {"type": "dense", "io": "gqa-shared-buffer", "capacity": 512, "kv_dtype": "fp8"}),
    (dict(C, quant="w4a16-rtn", custom_ops=False), 512,
     {"type": "dense", "io": "gqa-shared-buffer", "capacity": 512}),
    (dict(C, quant="w4a16-rtn", quantize_lm_head=True, block_size=64, custom_ops=True), 512,
     {"type": "dense", "io": "gqa-shared-buffer", "capacity": 512}),
    (dict(C, kv_layout="paged"), 512,
     {"type": "paged", "io": "paged-gqa", "page_size": 16, "capacity": 512, "max_batch": 64}),
    (dict(C, kv_layout="paged", page_size=32, custom_ops=True), 512,
     {"type": "paged", "io": "paged-gqa", "page_size": 32, "capacity": 512, "max_batch": 64}),
    (dict(C, kv_layout="paged", kv_dtype="int8", max_batch=8), 4096,
     {"type": "paged", "io": "paged-gqa", "page_size": 16, "capacity": 4096, "max_batch": 8, "kv_dtype": "int8"}),
    (dict(C, kv_layout="paged", quant="w4a16-rtn", quantize_lm_head=True), 512,
     {"type": "paged", "io": "paged-gqa", "page_size": 16, "capacity": 512, "max_batch": 64}),
]

@pytest.mark.parametrize("fields, max_positions, record", CUDA_KV)
def test_lowered_records_are_pinned(fields, max_positions, record):
    config = BuildConfig(**fields)
    ours = cuda_kv_layout(config, config.capacity or max_positions)
    assert ours == record and list(ours) == list(record)
