"""The model repository writer and the request validation of the Triton model (no server here)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from enginesmith import engine_dir
from enginesmith.deploy.triton import INPUTS, OUTPUTS, config_pbtxt, write_model_repository
from enginesmith.deploy.triton_model import request_settings
from enginesmith.errors import EngineError, UserError


def fake_engine(root: Path, backend: dict | None = None, files: dict[str, bytes] | None = None) -> Path:
    """A minimal engine directory with a valid build.json (enough for verify())."""
    root.mkdir(parents=True)
    for rel, data in (files or {"model.onnx": b"onnx"}).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    engine_dir.write_manifest(root, {"graph": "model.onnx", "model": {"max_positions": 64},
                                     "backend": backend or {"name": "onnxruntime", "version": "1.32.0"}})
    return root


def parse(text: str):
    pytest.importorskip("tritonclient.grpc", reason="pip install tritonclient[grpc]")
    from enginesmith.deploy.triton import parse_config

    return parse_config(text)


def test_config_parses_with_tritons_schema(tmp_path):
    engine = fake_engine(tmp_path / "engine")
    model = write_model_repository(engine, tmp_path / "repo", "smol", workers=2, device="cpu")
    config = parse((model / "config.pbtxt").read_text())
    assert config.name == "smol" and config.backend == "python"
    assert config.model_transaction_policy.decoupled
    assert config.max_batch_size == 0
    assert [i.name for i in config.input] == [t.name for t in INPUTS]
    assert [i.name for i in config.input if not i.optional] == ["text_input"]
    assert [o.name for o in config.output] == [t.name for t in OUTPUTS]
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["ENGINE_DIR"] == str(engine.resolve())
    assert params["WORKERS"] == "2" and params["DEVICE"] == "cpu"
    assert (model / "1" / "model.py").read_text().count("TritonPythonModel") == 1


def test_quotes_in_parameters_survive(tmp_path):
    text = config_pbtxt("m", {"ENGINE_DIR": 'a "quoted" \\ path'})
    params = {k: v.string_value for k, v in parse(text).parameters.items()}
    assert params["ENGINE_DIR"] == 'a "quoted" \\ path'


def test_tensorrt_engine_puts_plan_and_plugins_in_config(tmp_path):
    engine = fake_engine(tmp_path / "engine", backend={
        "name": "tensorrt", "version": "10.15.1", "plan": "model.plan",
        "plugins": [{"file": "plugins/libenginesmith_trt_plugins.so"}]},
        files={"model.onnx": b"onnx", "model.plan": b"plan", "plugins/libenginesmith_trt_plugins.so": b"so"})
    model = write_model_repository(engine, tmp_path / "repo", "trt")
    params = {k: v.string_value for k, v in parse((model / "config.pbtxt").read_text()).parameters.items()}
    assert params["TRT_PLAN"] == str(engine.resolve() / "model.plan")
    assert params["TRT_PLUGINS"] == str(engine.resolve() / "plugins/libenginesmith_trt_plugins.so")


def test_tensorrt_engine_with_missing_plugin_library_is_refused(tmp_path):
    engine = fake_engine(tmp_path / "engine", backend={
        "name": "tensorrt", "version": "10.15.1", "plan": "model.plan",
        "plugins": [{"file": "plugins/libenginesmith_trt_plugins.so"}]},
        files={"model.onnx": b"onnx", "model.plan": b"plan", "plugins/libenginesmith_trt_plugins.so": b"so"})
    (engine / "plugins/libenginesmith_trt_plugins.so").unlink()
    with pytest.raises(EngineError, match="libenginesmith_trt_plugins.so is missing"):
        write_model_repository(engine, tmp_path / "repo", "trt")
    assert not (tmp_path / "repo" / "trt").exists()


def test_copy_engine_links_files_and_uses_relative_path(tmp_path):
    engine = fake_engine(tmp_path / "engine")
    model = write_model_repository(engine, tmp_path / "repo", "m", copy_engine=True)
    params = {k: v.string_value for k, v in parse((model / "config.pbtxt").read_text()).parameters.items()}
    assert params["ENGINE_DIR"] == "1/engine"
    engine_dir.verify(model / "1" / "engine")  # a complete, valid engine directory


def test_write_is_atomic_and_refuses_to_overwrite(tmp_path):
    engine = fake_engine(tmp_path / "engine")
    repo = tmp_path / "repo"
    write_model_repository(engine, repo, "m")
    with pytest.raises(UserError, match="already exists"):
        write_model_repository(engine, repo, "m")
    write_model_repository(engine, repo, "m", force=True, workers=3)
    assert 'string_value: "3"' in (repo / "m" / "config.pbtxt").read_text()
    assert sorted(os.listdir(repo)) == ["m"]  # no temp dirs left


@pytest.mark.parametrize("change, match", [
    (lambda e: (e / "model.onnx").write_bytes(b"changed"), "altered"),
    (lambda e: (e / "build.json").unlink(), "no build.json"),
])
def test_bad_engine_directory_is_refused(tmp_path, change, match):
    engine = fake_engine(tmp_path / "engine")
    change(engine)
    with pytest.raises(EngineError, match=match):
        write_model_repository(engine, tmp_path / "repo", "m")
    assert not (tmp_path / "repo" / "m").exists()


def test_engine_for_unknown_backend_is_refused(tmp_path):
    engine = fake_engine(tmp_path / "engine", backend={"name": "openvino", "version": "1"})
    with pytest.raises(UserError, match="backend 'openvino'"):
        write_model_repository(engine, tmp_path / "repo", "m")


@pytest.mark.parametrize("kwargs, match", [
    ({"model_name": "a/b"}, "invalid model name"),
    ({"device": "tpu"}, "unknown device"),
    ({"workers": 0}, "workers must be"),
    ({"execution_env": "/nonexistent/env"}, "neither a venv"),
])
def test_bad_arguments_are_refused(tmp_path, kwargs, match):
    engine = fake_engine(tmp_path / "engine")
    with pytest.raises(UserError, match=match):
        write_model_repository(engine, tmp_path / "repo", **{"model_name": "m", **kwargs})


# ----------------------------------------------------------------------------- request validation

def req(**values):
    out = {}
    for name, value in values.items():
        if isinstance(value, str):
            out[name] = np.array([value.encode()], dtype=np.object_)
        elif isinstance(value, list):
            out[name] = np.array([v.encode() for v in value], dtype=np.object_)
        else:
            out[name] = np.array([value])
    return out


def test_request_defaults_and_values():
    s = request_settings(req(text_input="hi"), default_max_tokens=7)
    assert (s.prompt, s.raw, s.system, s.max_tokens, s.stop) == ("hi", False, None, 7, ())
    assert s.sampling.greedy
    s = request_settings(req(text_input="hi", max_tokens=np.int32(3), temperature=np.float32(0.5), top_k=np.int32(4),
                             top_p=np.float32(0.9), seed=np.int64(5), stop=["\n", "."], raw=True, system="sys"))
    assert (s.max_tokens, s.sampling.top_k, s.sampling.seed, s.stop, s.raw, s.system) == \
        (3, 4, 5, ("\n", "."), True, "sys")
    assert s.sampling.temperature == pytest.approx(0.5)


@pytest.mark.parametrize("values, match", [
    ({}, "missing input 'text_input'"),
    ({"text_input": ""}, "empty prompt"),
    ({"text_input": "hi", "temperature": -1.0}, "temperature"),
    ({"text_input": "hi", "temperature": float("nan")}, "temperature"),
    ({"text_input": "hi", "top_p": 1.5}, "top_p"),
    ({"text_input": "hi", "top_k": -2}, "top_k"),
    ({"text_input": "hi", "repetition_penalty": 0.0}, "repetition_penalty"),
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens"),
    ({"text_input": "hi", "seed": -1}, "seed"),
    ({"text_input": "hi", "top_k": 2.5}, "not an integer"),
    ({"text_input": "hi", "stop": [""]}, "empty stop string"),
    ({"text_input": "hi", "bogus": 1}, "unknown inputs bogus"),
])
def test_invalid_request_is_a_user_error(values, match):
    with pytest.raises(UserError, match=match) as info:
        request_settings(req(**values))
    assert "fix:" in str(info.value)


def test_non_utf8_and_multi_element_inputs_are_user_errors():
    with pytest.raises(UserError, match="UTF-8"):
        request_settings({"text_input": np.array([b"\xff\xfe"], dtype=np.object_)})
    with pytest.raises(UserError, match="2 elements"):
        request_settings({"text_input": np.array([b"a", b"b"], dtype=np.object_)})


def test_config_parameters_round_trip():
    from enginesmith.deploy.triton import ModelOptions

    options = ModelOptions(engine="/e", device="cpu", threads=2, workers=3, verify_hashes=False, max_tokens=9)
    assert ModelOptions.from_parameters(options.parameters()) == options
    with pytest.raises(UserError, match="WORKERS"):
        ModelOptions.from_parameters({"ENGINE_DIR": "/e", "WORKERS": "many"})
    with pytest.raises(UserError, match="ENGINE_DIR"):
        ModelOptions.from_parameters({})
    json.dumps(options.parameters())  # plain strings only


def test_cli_verb_functions(tmp_path, capsys):
    import argparse

    from enginesmith.deploy import triton

    engine = fake_engine(tmp_path / "engine")
    parser = argparse.ArgumentParser()
    triton.add_arguments(parser)
    args = parser.parse_args(["--engine", str(engine), "--out", str(tmp_path / "repo"), "--name", "m",
                              "--workers", "2", "--no-verify"])
    assert triton.run(args) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "repo" / "m")
    with pytest.raises(UserError, match="already exists"):
        triton.run(args)
