"""benchmarks/device/summarize.py (verify.sh's summary) on fake inputs: a pytest -v log (finished and cut),
ninja's log, a state folder with steps and figures in the shapes the benchmark scripts write."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("verify_summarize", REPO / "benchmarks/device/summarize.py")
summarize = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summarize)

XDIST_LOG = """\
============================= test session starts ==============================
created: 6/6 workers
6 workers [5 items]

plugins/test_ort_ops.py::test_ok 
[gw0] [ 20%] PASSED plugins/test_ort_ops.py::test_ok 
test_ort_cuda.py::test_param[2] 
test_ort_cuda.py::test_param[1] 
[gw0] [ 40%] PASSED test_ort_cuda.py::test_param[1] 
test_ort_cuda.py::test_err 
[gw1] [ 60%] FAILED test_ort_cuda.py::test_param[2] 
[gw0] [ 80%] ERROR test_ort_cuda.py::test_err 
test_ort_cuda.py::test_skip 
[gw1] [100%] SKIPPED test_ort_cuda.py::test_skip 
=========================== short test summary info ============================
FAILED test_ort_cuda.py::test_param[2] - AssertionError: x is not one
ERROR test_broken.py - ImportError while importing test module
ERROR test_ort_cuda.py::test_err - RuntimeError: fixture broke
SKIPPED [1] test_ort_cuda.py:5: no gpu here
=============== 1 failed, 2 passed, 1 skipped, 2 errors in 9.69s ===============
"""

NINJA_LOG = """\
# ninja log v6
0\t4620\t1732712345000000000\tCMakeFiles/enginesmith_ort_ops.dir/ort_ops/attention.cu.o\tabc
10\t2500\t1732712345000000000\tCMakeFiles/enginesmith_kernels.dir/paged_attention/paged_attention.cu.o\tdef
15\t1015\t1732712345000000000\tCMakeFiles/enginesmith_ort_ops.dir/ort_ops/gemv.cu.o\tghi
4620\t5000\t1732712345000000000\tlibenginesmith_ort_ops.so\tjkl
0\t3000\t1732712399000000000\tCMakeFiles/enginesmith_ort_ops.dir/ort_ops/gemv.cu.o\tghi
"""


def test_pytest_log_finished():
    r = summarize.parse_pytest_log(XDIST_LOG)
    assert r["finished"] and r["seconds"] == 9.69
    assert (r["passed"], r["failed"], r["error"], r["skipped"]) == (2, 1, 2, 1)
    assert r["failed_ids"] == ["test_ort_cuda.py::test_param[2]"]
    assert r["error_ids"] == ["test_broken.py", "test_ort_cuda.py::test_err"]  # a collection error is named too
    assert r["reasons"]["test_ort_cuda.py::test_param[2]"] == "AssertionError: x is not one"
    assert r["unfinished_ids"] == []


def test_pytest_log_cut_at_the_limit():
    cut = "\n".join(XDIST_LOG.splitlines()[:13])  # killed before the summary: counts from the -v lines
    r = summarize.parse_pytest_log(cut)
    assert not r["finished"]
    assert (r["passed"], r["failed"], r["error"]) == (2, 1, 1)
    assert r["unfinished_ids"] == ["test_ort_cuda.py::test_skip"]


def test_ninja_log():
    r = summarize.parse_ninja_log(NINJA_LOG)
    assert r["outputs"] == 4  # gemv.cu.o's later entry replaces its first
    assert r["cpu_s"] == pytest.approx(4.62 + 2.49 + 3.0 + 0.38, abs=0.05)
    assert r["by_target_s"]["enginesmith_ort_ops"] == pytest.approx(7.6, abs=0.05)
    assert r["by_target_s"]["link and other"] == pytest.approx(0.4, abs=0.05)
    assert r["slowest"][0]["output"].endswith("attention.cu.o")


def _state(tmp_path: Path) -> tuple[Path, Path]:
    state, out = tmp_path / "verify", tmp_path / "out"
    (state / "state" / "steps").mkdir(parents=True)
    fig = state / "figures"
    fig.mkdir()
    out.mkdir()
    (state / "gpu.txt").write_text("NVIDIA H200, 143771 MiB, 580.159.04, 9.0\n")

    def step(sid, status="ok", seconds=10, command="cmd"):
        (state / "state" / "steps" / f"{sid}.json").write_text(json.dumps(
            {"id": sid, "phase": sid.split(".")[0], "status": status, "rc": 0 if status == "ok" else 1,
             "seconds": seconds, "limit_s": 100, "log": "", "command": command}))

    step("setup.install", seconds=20)
    step("build.plugins", seconds=55)
    step("tests.pytest", status="failed", seconds=330)
    step("decode.fp16", command="python3 -P -m enginesmith.cli bench --engine /tmp/verify/engines/dense_fp16")
    step("decode.w4a16")
    step("decode.genai")
    step("http.fp16", status="timeout", seconds=300)
    step("kvquant.decode", status="cut", seconds=0)
    (out / "tests.log").write_text(XDIST_LOG)
    (state / "state" / "calls.jsonl").write_text('{"phases": " setup build tests", "seconds": 480}\n'
                                                 '{"phases": " decode", "seconds": 300}\n')
    (fig / "ninja_log_full.txt").write_text(NINJA_LOG)
    bound = {"fraction_of_bound": 0.64, "tok_s_bound": 1712.0}
    (fig / "decode_fp16.json").write_text(json.dumps({"enginesmith": {"decode_tok_s": 1099.0}, "bound": bound}))
    (fig / "decode_w4a16.json").write_text(json.dumps({"enginesmith": {"decode_tok_s": 1696.3}}))
    (fig / "decode_genai.jsonl").write_text(
        json.dumps({"variant": "fp16+cudagraph", "decode_tok_s": 781.0}) + "\n"
        + json.dumps({"variant": "int4+cudagraph", "decode_tok_s": 1046.0}) + "\n")
    shutil.copy(REPO / "benchmarks/serving/results/h100_s11_offline_fp16.json", fig / "serving_fp16.json")
    shutil.copy(REPO / "benchmarks/serving/results/h100_s11_single_fp16.json", fig / "serving_fp16_c1.json")
    shutil.copy(REPO / "benchmarks/serving/results/h100_s11_ortgenai_b32.jsonl", fig / "serving_genai_b32.jsonl")
    (fig / "serving_hf_b64.json").write_text(json.dumps({"tok_s": 619.0}))
    (fig / "http_fp16").mkdir()
    shutil.copy(REPO / "benchmarks/serving/results/h100_s11_bench_serve_ours.json", fig / "http_fp16/bench_serve_ours.json")
    core = json.loads((fig / "http_fp16/bench_serve_ours.json").read_text())
    for run in core["runs"]:  # the engine core process's run: the same shape, other figures
        run["tok_s"] *= 1.25
    (fig / "http_fp16/bench_serve_core.json").write_text(json.dumps(core))
    for run in core["runs"]:  # two front ends over the core
        run["tok_s"] *= 1.1
    (fig / "http_fp16/bench_serve_core_fe2.json").write_text(json.dumps(core))
    (fig / "prefill_attention.json").write_text(json.dumps({"points": [
        {"past": 0, "capacity": 4160, "new": 4096, "enginesmith": {"gpu_us": 300.0},
         "enginesmith_today": {"gpu_us": 9000.0}, "ort_gqa": {"gpu_us": 250.0}, "ours_over_ort_gpu": 1.2}]}))
    (fig / "kvquant_decode.json").write_text(json.dumps({"decode": {"rows": [
        {"context": 32768, "batch": 1, "fp16": {"step_ms": 2.0}, "int8": {"step_ms": 1.6}, "fp8": {"step_ms": 1.7}}]}}))
    asy = json.loads((fig / "serving_fp16.json").read_text())
    for run in asy["runs"]:  # the async steps' run: the same shape, other figures
        run["tok_s"] *= 1.2
    (fig / "serving_fp16_async.json").write_text(json.dumps(asy))
    (fig / "serving_w4a16_mma.json").write_text(json.dumps({"runs": [{"concurrency": 64, "tok_s": 19000.0}]}))
    step("profile.step")
    (fig / "profile_step.json").write_text(json.dumps({"timed": [
        {"batch": 32, "step_ms": 2.6, "gpu_ms": 1.9, "async": {"step_ms": 2.0}, "async_speedup": 1.3},
        {"batch": 64, "step_ms": 3.3, "gpu_ms": 2.4, "async": {"step_ms": 2.5}, "async_speedup": 1.32}]}))
    (fig / "profile_step_waves4.json").write_text(json.dumps({"timed": [
        {"batch": 64, "step_ms": 3.0, "gpu_ms": 2.0, "async": {"step_ms": 2.25}, "async_speedup": 1.33}]}))
    (fig / "twogpu").mkdir()
    for name, tok_s in (("core", 15000.0), ("replicas", 27000.0)):
        (fig / "twogpu" / f"bench_serve_{name}.json").write_text(json.dumps({"runs": [{"concurrency": 128, "tok_s": tok_s}]}))
    (fig / "profile_decode.json").write_text(json.dumps({"modes": [
        {"cuda_graph": True, "ms_per_step": 0.9, "gpu_us_per_step": 700.0, "gaps_us_per_step": 200.0,
         "kernels_per_step": 130.0, "top_kernels": [{"kernel": "gemv_kernel", "us_per_step": 400.0, "per_step": 64}]},
        {"cuda_graph": False, "ms_per_step": 1.2, "gpu_us_per_step_no_pdl": 800.0, "gaps_us_per_step": 400.0,
         "kernels_per_step": 130.0, "top_kernels": []}]}))
    (fig / "accuracy_smollm2.json").write_text(json.dumps({
        "ppl": {"ok": True, "ppl_cuda": 10.02, "ppl_cpu": 10.0, "relative_difference": 0.002, "tolerance": 0.005,
                "tokens": 8192, "protocol": "harness"},
        "greedy": {"ok": False, "identical": 23, "prompts": 24, "new_tokens": 64}}))
    return state, out


def test_summary_names_the_card_and_keeps_every_figure(tmp_path):
    state, out = _state(tmp_path)
    r = summarize.summarize(state, out)
    md = (out / "summary.md").read_text()
    assert json.loads((out / "summary.json").read_text())["card"].startswith("NVIDIA H200")
    assert md.count("NVIDIA H200") >= 5  # every table names the card
    assert r["device_seconds"] == 780 and "480 s for setup build tests" in md
    assert r["phases"]["decode"]["seconds"] == 30
    assert r["phases"]["tests"]["not_ok"] == 1
    assert r["tests"]["failed_ids"] == ["test_ort_cuda.py::test_param[2]"]
    assert r["compile"]["full"]["wall_s"] == 55 and r["compile"]["full"]["cpu_s"] > 10
    fig = {f["figure"]: f for f in r["figures"]}
    fp16 = fig["decode batch 1 fp16 + ops (prompt 128, 256 new)"]
    assert fp16["ours"] == 1099.0 and fp16["peer_value"] == 781.0 and fp16["ratio"] == pytest.approx(1.407, abs=1e-3)
    assert fp16["command"].startswith("python3 -P -m enginesmith.cli bench")
    assert "64.0 % of the 1712" in fp16["note"]
    assert fig["decode batch 1 W4A16 / fp16 (ours)"]["ratio"] == pytest.approx(1.544, abs=2e-3)
    assert fig["decode batch 1 smollm2 + ops (prompt 128, 256 new)"]["status"] == "not run"
    assert fig["offline fp16 concurrency 64 (bench --requests)"]["ours"] == pytest.approx(13317.3, abs=0.1)
    assert fig["offline fp16 concurrency 64 (bench --requests)"]["ratio"] == pytest.approx(28.58, abs=0.01)
    http = fig["serve over HTTP fp16 (engine core thread) concurrency 64"]
    assert http["status"] == "timeout" and http["peer"] == "offline fp16 at 64"
    core = fig["serve over HTTP fp16 (engine core process) concurrency 64"]
    assert core["ours"] == pytest.approx(1.25 * http["ours"], abs=0.1) and core["peer"] == "offline fp16 at 64"
    assert fig["serve over HTTP w4a16 (engine core process) concurrency 64"]["ours"] is None  # not run: still a row
    fe2 = fig["serve over HTTP fp16 (engine core process, 2 front ends) concurrency 64"]
    assert fe2["ours"] == pytest.approx(1.1 * core["ours"], abs=0.1)
    assert "serve over HTTP w4a16 (engine core process, 2 front ends) concurrency 64" not in fig  # not asked for
    assert fig["ORT GenAI fp16 batch 32 (prompt 512, 256 new; decode tok/s)"]["ours"] == pytest.approx(14602.5, 0.01)
    assert fig["offline fp16 at 64 vs HF generate batch 64 (static cache)"]["ratio"] == pytest.approx(21.5, abs=0.1)
    kv = fig["KV int8 decode step, paged, context 32768, batch 1"]
    assert kv["status"] == "cut" and kv["ratio"] == 1.25
    assert "cut before the end" not in md and "1 failed" in md
    a64 = fig["offline fp16 concurrency 64, async steps vs sync"]  # session 18's names: the async run the extra one
    assert a64["ratio"] == pytest.approx(1.2, abs=1e-3) and a64["status"] == "not run"
    (state / "figures" / "serving_fp16_async.json").rename(state / "figures" / "serving_fp16_sync.json")
    fig = {f["figure"]: f for f in summarize.summarize(state, out)["figures"]}  # since: the sync run the extra one
    assert fig["offline fp16 concurrency 64, async steps vs sync"]["ratio"] == pytest.approx(1 / 1.2, abs=1e-3)
    step64 = fig["paged decode step at batch 64, async scheduling (sync beside)"]
    assert step64["ours"] == 2.5 and step64["ratio"] == 1.32 and step64["status"] == "ok"
    w64 = fig["paged decode step at batch 64, async, key splits for 4 waves (ES_PAGED_SPLIT_WAVES=4)"]
    assert w64["ours"] == 2.25 and w64["peer_value"] == 2.5 and w64["ratio"] == 0.9
    assert fig["serve --devices 0,1 (two GPUs) concurrency 128"]["ratio"] == 1.8
    b32 = fig["paged decode step at batch 32 (async) vs ORT GenAI's at batch 32"]
    assert b32["ours"] == 2.0 and b32["peer_value"] == pytest.approx(2.19, abs=0.01)
    b1 = fig["batch-1 decode step fp16, graphs on: kernel us (PDL on, overlapping) vs wall us"]
    assert b1["ours"] == 700.0 and b1["peer_value"] == 900.0 and "130.0 kernels" in b1["note"]
    assert fig["batch-1 decode step fp16, graphs off: kernel us (PDL off) vs wall us"]["ours"] == 800.0
    mma = fig["offline w4a16 concurrency 64, int4 on tensor cores (ES_Q4_MMA=1) vs fp16"]
    assert mma["ours"] == 19000.0 and mma["ratio"] == pytest.approx(19000.0 / 13317.3, abs=1e-3)
    assert "0.200 %" in fig["SmolLM2 perplexity, GPU vs CPU engine"]["note"]
    assert fig["SmolLM2 greedy tokens, tensor-core prompt path vs older kernel: prompts identical"]["ours"] == 23


def test_summary_of_an_empty_machine(tmp_path):
    """Nothing ran (or the state folder is new): the summary still comes out, every figure 'not run'."""
    state = tmp_path / "verify"
    state.mkdir()
    r = summarize.summarize(state, tmp_path / "out")
    assert r["card"] == "unknown card" and r["tests"] is None
    assert r["figures"] and {f["status"] for f in r["figures"]} == {"not run"}


def test_verify_sh_parses():
    subprocess.run(["bash", "-n", str(REPO / "benchmarks/device/verify.sh")], check=True)


def test_json_after_printed_lines(tmp_path):
    """A CLI's stdout may carry a notice before its JSON: the last one-line object is taken."""
    f = tmp_path / "decode_fp16.json"
    f.write_text('Building the engine once\n{"enginesmith": {"decode_tok_s": 5.0}}\n\n')
    assert summarize._load(f) == {"enginesmith": {"decode_tok_s": 5.0}}
    f.write_text("Traceback (most recent call last):\n  boom\n")
    assert summarize._load(f) is None
    g = tmp_path / "x.jsonl"
    g.write_text('{"a": 1}\nnot json\n{"a": 2\n{"a": 3}\n')
    assert summarize._load(g) == [{"a": 1}, {"a": 3}]
