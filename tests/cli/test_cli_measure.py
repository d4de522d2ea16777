"""`enginesmith eval ppl` and `enginesmith bench` through the real CLI, with --json."""

from __future__ import annotations

import json

import pytest

from helpers.cli import cli


def _json(result):
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_eval_ppl_json_matches_pytorch_on_a_tiny_model(tiny_engine, austen):
    r = _json(cli("eval", "ppl", "--engine", str(tiny_engine("qwen2")), "--tokens", "600", "--window", "200",
                  "--compare", "hf", "--json"))
    assert r["tokens"] == 600 and r["windows"] == 3 and r["protocol"] == "harness"  # every token scored
    assert r["relative_diff_vs_hf"] < 1e-4


@pytest.mark.slow
def test_eval_ppl_smollm2_pride_and_prejudice_equals_pytorch(smollm2_engine, austen):
    r = _json(cli("eval", "ppl", "--engine", str(smollm2_engine), "--tokens", "4096", "--window", "1024",
                  "--protocol", "windows", "--compare", "hf", "--json"))  # the protocol of the 20.30 figure
    assert r["tokens"] == 4092 and r["windows"] == 4
    assert r["relative_diff_vs_hf"] < 1e-3  # the issue asks for 0.1 %
    assert 19.5 < r["ppl"] < 21.0  # facts.md: 20.30


def test_bench_json_reports_both_backends(tiny_engine):
    r = _json(cli("bench", "--engine", str(tiny_engine("llama")), "--prompt-tokens", "16", "--new-tokens", "8",
                  "--repeats", "1", "--compare", "hf", "--json"))
    for side in ("enginesmith", "hf"):
        for key in ("prefill_tok_s", "decode_ms_per_token", "decode_tok_s", "peak_rss_mib"):
            assert r[side][key] > 0, (side, key)
    assert r["decode_speedup_vs_hf"] > 0
    bound = r["bound"]  # weights + KV per step over the CPU's measured copy bandwidth
    assert bound["device"] == "cpu" and bound["bandwidth_gbs"] > 0 and bound["weight_bytes"] > 0
    m = json.loads((tiny_engine("llama") / "build.json").read_text())["model"]
    assert bound["kv_bytes_per_step"] == m["layers"] * 2 * m["kv_heads"] * m["head_dim"] * (16 + 8 // 2) * 4  # fp32
    assert bound["fraction_of_bound"] == pytest.approx(r["enginesmith"]["decode_tok_s"] / bound["tok_s_bound"])


@pytest.mark.parametrize("compare, word", [("hf-compile", "CUDA only"), ("hf,torch", "unknown --compare torch")])
def test_bench_compare_bad_input(tiny_engine, compare, word):
    result = cli("bench", "--engine", str(tiny_engine("llama")), "--new-tokens", "4", "--compare", compare)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert word in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("args, word", [
    (["--tokens", "100", "--window", "200"], "--tokens"),
    (["--window", "4096"], "context"),
    (["--text", "/no/such/file.txt", "--window", "256"], "file.txt"),
])
def test_eval_bad_input(tiny_engine, args, word):
    result = cli("eval", "ppl", "--engine", str(tiny_engine("llama")), *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert word in result.stderr.strip().splitlines()[-1]


def test_build_for_cuda_then_bench_its_device_loop(tmp_path):
    """build --for-cuda writes a GQA-lowered engine (what ORT CUDA's decode loop runs); bench times it
    through that loop (here on the CPU EP) and reports the bound; run generates with it."""
    out = tmp_path / "cuda_engine"
    built = cli("build", "--model", "tiny:llama", "--dtype", "fp16", "--for-cuda", "--out", str(out))
    assert built.returncode == 0, built.stderr
    manifest = json.loads((out / "build.json").read_text())
    assert manifest["kv_layout"]["io"] == "gqa-shared-buffer" and "matmul_transb" in " ".join(manifest["passes"])
    r = _json(cli("bench", "--engine", str(out), "--device", "cpu", "--prompt-tokens", "8", "--new-tokens", "6",
                  "--repeats", "1", "--json"))
    assert r["enginesmith"]["backend"] == "GqaEngine" and r["enginesmith"]["decode_tok_s"] > 0
    assert r["bound"]["kv_bytes_per_step"] > 0 and 0 < r["bound"]["fraction_of_bound"]


@pytest.mark.parametrize("extra, word", [
    ([], "--dtype fp32"),
    (["--dtype", "fp16", "--kv", "ring"], "--kv ring"),
    (["--dtype", "fp16", "--quant", "w8a8-sq"], "--quant w8a8-sq"),
])
def test_build_for_cuda_bad_combinations(tmp_path, extra, word):
    result = cli("build", "--model", "tiny:llama", "--for-cuda", "--out", str(tmp_path / "e"), *extra)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert word in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "e").exists()


def test_build_for_cuda_custom_ops_on_without_the_library(tmp_path, monkeypatch):
    """--custom-ops on asks for the ORT ops library: without it, one line that says how to build it."""
    monkeypatch.setenv("ENGINESMITH_ORT_OPS_LIB", str(tmp_path / "missing.so"))
    result = cli("build", "--model", "tiny:llama", "--dtype", "fp16", "--for-cuda", "--custom-ops", "on",
                 "--out", str(tmp_path / "e"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "ops library is not built" in result.stderr and "cmake" in result.stderr
    assert not (tmp_path / "e").exists()


def test_build_custom_attention_needs_the_custom_ops(tmp_path):
    result = cli("build", "--model", "tiny:llama", "--dtype", "fp16", "--for-cuda", "--custom-ops", "off",
                 "--custom-attention", "--out", str(tmp_path / "e"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--custom-attention needs the custom ops" in result.stderr
    assert not (tmp_path / "e").exists()
