"""The TensorRT backend's checks that need no TensorRT (profiles, manifests, presets, missing TensorRT),
and the builder/runner tests that do, which skip here: TensorRT cannot be installed on these machines."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from enginesmith.core import engine_dir
from enginesmith.core import manifest as manifest_schema
from enginesmith.builder import jetson, trt_lint, trt_plan
from enginesmith.builder.trt_plan import TrtBuildConfig, profile_shapes
from enginesmith.core import tensorrt as trt_check
from enginesmith.core.errors import EngineError, UserError
from enginesmith.runtime.engines import trt_engine
from enginesmith.runtime.engines.trt_engine import check_manifest

HAS_TRT = importlib.util.find_spec("tensorrt") is not None
needs_trt = pytest.mark.skipif(not HAS_TRT, reason="TensorRT cannot be installed here")

INPUTS = {"input_ids": (-1, -1), "attention_mask": (-1, -1), "position_ids": (-1, -1),
          "past_key_values.0.key": (-1, 3, -1, 64), "past_key_values.0.value": (-1, 3, -1, 64)}


def trt_manifest_dict(**backend) -> dict:
    record = {"sha256": "0" * 64, "size": 1}
    return {"format_version": manifest_schema.FORMAT_VERSION, "graph": "model.onnx", "model": {"max_positions": 8192},
            "files": {"model.onnx": record, "model.plan": record, "plugins/libp.so": record},
            "backend": {"name": "tensorrt", "version": "10.15.1", "sm": "9.0", "device": "NVIDIA H100",
                        "plan": "model.plan", "plugins": [{"file": "plugins/libp.so"}],
                        "max_batch": 1, "max_input": 8, "max_positions": 64, **backend}}


def trt_manifest(**backend):
    return manifest_schema.parse(trt_manifest_dict(**backend))


def test_profiles_cover_prefill_and_decode():
    c = TrtBuildConfig(max_batch=4, max_input=256, max_positions=1024, opt_batch=2, opt_input=64, opt_positions=128)
    prefill, decode = profile_shapes(INPUTS, c)
    assert prefill.shapes["input_ids"] == ((1, 1), (2, 64), (4, 256))
    assert prefill.shapes["attention_mask"] == ((1, 1), (2, 64), (4, 1024))
    assert prefill.shapes["past_key_values.0.key"] == ((1, 3, 0, 64), (2, 3, 0, 64), (4, 3, 1023, 64))
    assert decode.shapes["input_ids"] == ((1, 1), (2, 1), (4, 1))
    assert decode.shapes["past_key_values.0.value"][1] == (2, 3, 127, 64)
    for p in (prefill, decode):  # min <= opt <= max everywhere
        for lo, opt, hi in p.shapes.values():
            assert all(a <= b <= c_ for a, b, c_ in zip(lo, opt, hi))


def test_profiles_for_a_fixed_capacity_cache_keep_it_fixed():
    inputs = dict(INPUTS, **{"past_key_values.0.key": (-1, 3, 2048, 64), "attention_mask": (-1, 2048)})
    prefill, decode = profile_shapes(inputs, TrtBuildConfig(max_positions=2048))
    assert {s[2] for s in prefill.shapes["past_key_values.0.key"]} == {2048}
    assert {s[1] for s in decode.shapes["attention_mask"]} == {2048}


def test_profiles_refuse_unknown_dynamic_inputs():
    with pytest.raises(UserError, match="cache_position"):
        profile_shapes(dict(INPUTS, cache_position=(-1,)), TrtBuildConfig())


@pytest.mark.parametrize("kwargs, match", [
    ({"max_batch": 0}, "max_batch"),
    ({"opt_input": 4096, "max_input": 1024}, "out of order"),
    ({"max_input": 8192, "max_positions": 4096}, "out of order"),
    ({"optimization_level": 7}, "optimization_level"),
    ({"hardware_compatibility": "any"}, "hardware_compatibility"),
])
def test_build_config_is_validated(kwargs, match):
    with pytest.raises(UserError, match=match):
        TrtBuildConfig(**kwargs)


def test_manifest_for_another_backend_is_refused():
    m = trt_manifest_dict()
    m["backend"] = {"name": "onnxruntime", "version": "1.32.0"}
    with pytest.raises(EngineError, match="built for backend 'onnxruntime'"):
        check_manifest(manifest_schema.parse(m), "9.0", "10.15.1")


def test_manifest_for_another_sm_is_refused():
    with pytest.raises(EngineError, match=r"built for SM 9.0 .*this GPU is SM 8.7") as info:
        check_manifest(trt_manifest(), "8.7", "10.15.1")
    assert "rebuild the engine on this GPU" in str(info.value)
    check_manifest(trt_manifest(hardware_compatibility="ampere_plus"), "8.6", "10.15.1")  # allowed


def test_manifest_for_another_tensorrt_or_no_gpu_is_refused():
    with pytest.raises(EngineError, match="TensorRT 10.15.1, this is TensorRT 10.13.0"):
        check_manifest(trt_manifest(), "9.0", "10.13.0")
    with pytest.raises(EngineError, match="needs a CUDA GPU"):
        check_manifest(trt_manifest(), None, None)


def test_manifest_with_unlisted_plugin_library_is_refused():
    m = trt_manifest_dict()
    del m["files"]["plugins/libp.so"]
    with pytest.raises(EngineError, match="backend file 'plugins/libp.so' is not listed"):
        manifest_schema.parse(m)


def _trt_engine_dir(root: Path, sm: str = "9.0") -> Path:
    root.mkdir()
    (root / "model.onnx").write_bytes(b"onnx")
    (root / "model.plan").write_bytes(b"plan")
    (root / "plugins").mkdir()
    (root / "plugins" / "libp.so").write_bytes(b"so")
    engine_dir.write_manifest(root, {"graph": "model.onnx", "model": {"max_positions": 64},
                                     "backend": {"name": "tensorrt", "version": "10.15.1", "sm": sm,
                                                 "plan": "model.plan", "plugins": [{"file": "plugins/libp.so"}],
                                                 "max_batch": 1, "max_input": 8, "max_positions": 64}})
    return root


def test_open_without_gpu_or_tensorrt_says_so(tmp_path):
    engine = _trt_engine_dir(tmp_path / "e")
    with pytest.raises(UserError, match="CUDA GPU|TensorRT is not installed|SM"):
        trt_engine.open_trt_engine(engine)


@pytest.mark.skipif(HAS_TRT, reason="TensorRT is installed: this checks the message when it is not")
def test_missing_tensorrt_is_a_clear_user_error(tmp_path):
    with pytest.raises(UserError, match="TensorRT is not installed") as info:
        trt_check.require_tensorrt()
    assert "--backend ort" in str(info.value)
    with pytest.raises(UserError, match="TensorRT is not installed"):
        trt_plan.build_plan(tmp_path / "model.onnx", tmp_path / "out", TrtBuildConfig())


def test_missing_plugin_library_is_refused_before_tensorrt(tmp_path, monkeypatch):
    """Missing plugin library (the engine's copy, or a path Triton passes): EngineError, no TensorRT needed."""
    engine = _trt_engine_dir(tmp_path / "e")
    monkeypatch.setattr(trt_engine, "current_sm", lambda: "9.0")
    with pytest.raises(EngineError, match=r"plugin library .*gone.so is missing"):
        trt_engine.open_trt_engine(engine, plugin_libraries=[str(tmp_path / "gone.so")])
    (engine / "plugins" / "libp.so").unlink()
    with pytest.raises(EngineError, match=r"plugin library .*libp.so is missing"):
        trt_engine.open_trt_engine(engine)


def test_engine_for_another_sm_is_refused_at_open(tmp_path, monkeypatch):
    engine = _trt_engine_dir(tmp_path / "e", sm="8.7")
    monkeypatch.setattr(trt_engine, "current_sm", lambda: "9.0")
    with pytest.raises(EngineError, match="built for SM 8.7"):
        trt_engine.open_trt_engine(engine)


# ----------------------------------------------------------------------------- Jetson presets

def test_jetson_presets():
    orin, thor = jetson.preset("orin"), jetson.preset("Jetson-Thor")
    assert (orin.sm, orin.cuda_arch, orin.tensorrt) == ("8.7", "87", "10.3")
    assert (thor.sm, thor.cuda_arch, thor.tensorrt) == ("11.0", "110", "10.13")
    for p in (orin, thor):
        assert p.build.strip_weights and p.build.optimization_level <= 2 and p.build.max_aux_streams == 0
        assert p.opset <= 22
    assert thor.with_tensorrt("11.4").opset == 24 and orin.with_tensorrt("10.14").opset == 22
    with pytest.raises(UserError, match="unknown Jetson preset"):
        jetson.preset("nano-2gb")


def test_jetson_preset_graphs_pass_trt_lint_for_their_tensorrt(tmp_path):
    """What each preset exports (opset 22, decomposed attention) parses on the JetPack's TensorRT."""
    from enginesmith.export.to_onnx import export
    from enginesmith.models.tiny import build

    for name, p in jetson.PRESETS.items():
        out = export(build("tiny:llama"), tmp_path / name / "model.onnx", dtype=p.dtype, opset=p.opset)
        assert trt_lint.lint(out, p.lint_target()) == [], name


def test_jetson_detect_and_device_check(tmp_path):
    model = tmp_path / "model"
    model.write_bytes(b"NVIDIA Jetson AGX Thor Developer Kit\x00")
    assert jetson.detect(model).name == "thor"
    model.write_bytes(b"NVIDIA Jetson AGX Orin Developer Kit\x00")
    assert jetson.detect(model).name == "orin"
    assert jetson.detect(tmp_path / "missing") is None
    jetson.check_device(jetson.preset("thor"), "10.1")
    with pytest.raises(UserError, match="SM 8.7, this GPU is SM 9.0"):
        jetson.check_device(jetson.preset("orin"), "9.0")


# ----------------------------------------------------------------------------- `build --backend trt` glue

def test_trt_config_merges_preset_and_flags(tmp_path):
    from enginesmith.builder.trt import trt_config

    c = trt_config()
    assert (c.max_batch, c.strip_weights) == (8, False)
    c = trt_config("orin", max_positions=1024, weight_streaming=True)
    assert (c.max_batch, c.max_positions, c.opt_positions, c.strip_weights, c.weight_streaming) == \
        (1, 1024, 512, True, True)
    c = trt_config(max_batch=1, max_input=16)  # opt values follow smaller maxima down
    assert (c.opt_batch, c.opt_input) == (1, 16)
    lib = tmp_path / "libp.so"
    lib.write_bytes(b"")
    assert trt_config(plugins=[str(lib)]).plugin_libraries == (str(lib.resolve()),)
    with pytest.raises(UserError, match="plugin library .* does not exist"):
        trt_config(plugins=[str(tmp_path / "missing.so")])
    with pytest.raises(UserError, match="unknown Jetson preset"):
        trt_config("xavier")


@pytest.mark.skipif(HAS_TRT, reason="TensorRT is installed: this checks the message when it is not")
def test_build_backend_trt_fails_fast_without_tensorrt(tmp_path):
    from enginesmith.builder.trt import build_tensorrt, check_ready

    for call in (lambda: check_ready("thor"), lambda: build_tensorrt(tmp_path, TrtBuildConfig())):
        with pytest.raises(UserError, match="TensorRT is not installed"):
            call()


# ----------------------------------------------------------------------------- need TensorRT

@needs_trt
def test_build_and_run_tiny_llama_matches_onnxruntime(tiny_engine, tmp_path):
    """Build a plan for the tiny Llama engine and compare greedy tokens with ONNX Runtime."""
    from enginesmith.runtime.decoding.generate import GenerationConfig, generate
    from enginesmith.runtime.load import open_engine

    src = tiny_engine("llama")
    out = tmp_path / "trt"
    import shutil
    shutil.copytree(src, out)
    manifest = dict(engine_dir.read_manifest(out).raw)
    manifest["backend"] = trt_plan.build_plan(out / "model.onnx", out, TrtBuildConfig(max_batch=2, max_input=64,
                                                                                         max_positions=256))
    manifest.pop("files")
    engine_dir.write_manifest(out, manifest)
    trt_loaded = trt_engine.open_trt_engine(out)
    ort_loaded = open_engine(src, device="cpu")
    config = GenerationConfig(max_new_tokens=16)
    prompt = [[1, 2, 3, 4, 5]]
    want = generate(ort_loaded.engine, ort_loaded.tokenizer, prompt, config)[0].token_ids
    got = generate(trt_loaded.engine, trt_loaded.tokenizer, prompt, config)[0].token_ids
    assert got == want
