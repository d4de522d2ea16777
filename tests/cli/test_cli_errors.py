"""Bad input never ends in a traceback: one line naming the fix, and a non-zero exit code.

Each case runs the real `enginesmith` command in a subprocess (tiny models keep it fast).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest

from helpers.cli import assert_one_line_error, cli


def test_missing_model_path():
    assert_one_line_error(cli("run", "hi", "--model", "/no/such/model"), 2, "does not exist")


def test_unknown_model_name():
    assert_one_line_error(cli("run", "hi", "--model", "tiny:bert"), 2, "unknown random model")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": 100}))
    result = cli("build", "--model", str(tmp_path), "--out", str(tmp_path / "engine"))
    assert_one_line_error(result, 2, "unsupported architecture", "llama", "qwen2", "mistral", "gpt2")
    assert not (tmp_path / "engine").exists()


@pytest.mark.parametrize("flags, word", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-k", "-3"], "top_k"),
    (["--repetition-penalty", "0"], "repetition_penalty"),
    (["--max-tokens", "0"], "max_new_tokens"),
])
def test_invalid_sampling_values(flags, word):
    assert_one_line_error(cli("run", "hi", *flags), 2, word)


def test_prompt_longer_than_context(tiny_engine):
    long_prompt = "word " * 700  # the tiny models have a 512-token context
    result = cli("run", long_prompt, "--engine", str(tiny_engine("llama")), "--raw")
    assert_one_line_error(result, 2, "does not fit the model's context")


@pytest.fixture
def engine_copy(tiny_engine, tmp_path):
    dst = tmp_path / "engine"
    shutil.copytree(tiny_engine("llama"), dst)
    return dst


def test_engine_ok_before_tampering(engine_copy):
    result = cli("run", "hi", "--engine", str(engine_copy), "--max-tokens", "3")
    assert result.returncode == 0, result.stderr


def test_tampered_engine_file(engine_copy):
    data = engine_copy / "model.onnx.data"
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data.write_bytes(bytes(blob))
    assert_one_line_error(cli("run", "hi", "--engine", str(engine_copy)), 3, "altered", "model.onnx.data")


def test_missing_engine_file(engine_copy):
    (engine_copy / "tokenizer" / "tokenizer.json").unlink()
    assert_one_line_error(cli("run", "hi", "--engine", str(engine_copy)), 3, "missing", "tokenizer.json")


def test_incomplete_engine_without_manifest(engine_copy):
    (engine_copy / "build.json").unlink()
    assert_one_line_error(cli("run", "hi", "--engine", str(engine_copy)), 3, "build.json")


def test_engine_built_for_another_backend(engine_copy):
    manifest = json.loads((engine_copy / "build.json").read_text())
    manifest["backend"] = {"name": "tensorrt", "version": "10.15"}
    (engine_copy / "build.json").write_text(json.dumps(manifest))
    assert_one_line_error(cli("run", "hi", "--engine", str(engine_copy)), 3, "TensorRT")


def test_existing_output_needs_force(engine_copy):
    result = cli("build", "--model", "tiny:llama", "--out", str(engine_copy))
    assert_one_line_error(result, 2, "already exists", "--force")


def _default_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.mark.parametrize("sig, code, word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_a_signal_during_build_leaves_nothing(tmp_path, sig, code, word):
    """Ctrl-C and SIGTERM mid-build: the exit status says which, and neither the engine nor a temp dir is left."""
    out = tmp_path / "engine"
    proc = subprocess.Popen([sys.executable, "-m", "enginesmith.cli", "build", "--model", "tiny:gpt2",
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # a test run may inherit SIGINT or SIGTERM ignored (a background job, a CI
                            # runner), and the build rightly keeps an inherited SIG_IGN: undo that here
                            preexec_fn=_default_signals)
    deadline = time.time() + 300
    while not list(tmp_path.glob(".engine.tmp-*")) and time.time() < deadline:  # wait until mid-build
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    time.sleep(1.0)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err
    assert "Traceback" not in err and word in err.strip().splitlines()[-1]
    assert list(tmp_path.iterdir()) == []  # neither the engine nor a temp dir is left
