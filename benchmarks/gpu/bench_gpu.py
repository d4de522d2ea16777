"""One GPU session, every decode figure side by side (run on the device machine; see README.md here).

    1. device: name, measured copy bandwidth (torch, read + write bytes)
    2. Llama-3.2-1B-shaped fp16 (random weights), batch 1, prompt 128, 256 greedy tokens:
       enginesmith GqaEngine (GQA on one KV buffer, IOBinding, CUDA graphs, device argmax)
       with and without CUDA graphs; batch 16 throughput; W4A16 (MatMulNBits, block 128)
    3. HF transformers eager and static cache + torch.compile (generate's own auto-compile)
    4. ONNX Runtime GenAI 0.18 (../shared/peers/ortgenai_bench.py: fp16, int4, +CUDA graphs)
    5. SmolLM2-135M fp16 from the embedded GGUF: decode ms/token with and without CUDA graphs,
       the plain ORT CUDA engine (OrtEngine, numpy I/O) for reference; prompt-lookup speculative
       decoding on the input-grounded workload (benchmarks/speculative/bench_ngram.py)
    bandwidth bound: (weight bytes of the graph + KV bytes read at the mean context) / copy bandwidth

Decode tok/s everywhere = batch * (N - 1) / time from token 1 to token N (GenAI's definition).
The 1B graphs travel as skeletons (benchmarks/gpu/skeleton.py) and get random weights there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

RESULTS: dict = {"errors": {}}
OUT: Path | None = None


def save() -> None:
    if OUT is not None:
        OUT.write_text(json.dumps(RESULTS, indent=1, default=str) + "\n")


def section(name):
    def wrap(fn):
        def run(*a, **k):
            t = time.time()
            print(f"== {name}", flush=True)
            try:
                RESULTS[name] = fn(*a, **k)
            except Exception as exc:  # keep going: one failure must not cost the other figures
                RESULTS["errors"][name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
                print(RESULTS["errors"][name], flush=True)
            RESULTS.setdefault("section_seconds", {})[name] = round(time.time() - t, 1)
            print(f"   {name}: {json.dumps(RESULTS.get(name), default=str)[:1500]}", flush=True)
            save()
            return RESULTS.get(name)
        return run
    return wrap


# ----------------------------------------------------------------------------- measurements

def _prompt(vocab: int, batch: int, prompt_len: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, min(vocab - 300, 120000), (batch, prompt_len))


def ours(engine, batch: int, prompt_len: int, new_tokens: int, warmup: int, reps: int, seed: int = 0) -> dict:
    """measure.speed.bench_device_engine (the decode loop `enginesmith run` uses) on random ids."""
    from enginesmith.measure.speed import bench_device_engine

    r = bench_device_engine(engine, _prompt(engine.vocab, batch, prompt_len, seed), new_tokens, warmup, reps)
    return {"batch": batch, "prompt_tokens": prompt_len, "new_tokens": new_tokens, "reps": reps,
            "decode_tok_s": r["decode_tok_s"], "ms_per_step": r["decode_ms_per_token"],
            "decode_tok_s_min": r["decode_tok_s_min"], "decode_tok_s_max": r["decode_tok_s_max"],
            "ttft_ms": 1e3 * r["prefill_s"], "cuda_graph": r["cuda_graph"]}


def hf_generate(model, batch: int, prompt_len: int, new_tokens: int, reps: int, static: bool, seed: int = 0) -> dict:
    """measure.speed.bench_hf_generate (HF generate, eager or static cache + torch.compile)."""
    from enginesmith.measure.speed import bench_hf_generate

    r = bench_hf_generate(model, _prompt(model.config.vocab_size, batch, prompt_len, seed), new_tokens, reps, static)
    return {"batch": batch, "prompt_tokens": prompt_len, "new_tokens": new_tokens, "reps": reps,
            "decode_tok_s": r["decode_tok_s"], "ms_per_step": r["decode_ms_per_token"],
            "ttft_ms": 1e3 * r["prefill_s"], "static_cache": static, "compiled": r["compiled"]}


def bound(weight_bytes: int, bandwidth_gbs: float, tok_s: float, batch: int = 1, context: int = 0,
          layers: int = 0, kv_heads: int = 0, head_dim: int = 0) -> dict:
    from enginesmith.measure.speed import bandwidth_bound

    return bandwidth_bound(weight_bytes, bandwidth_gbs, layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                           context=context, batch=batch, kv_bytes=2, measured_tok_s=tok_s)


# ----------------------------------------------------------------------------- sections

@section("device")
def device_info() -> dict:
    import onnxruntime as ort
    import torch
    import transformers

    from enginesmith.measure.speed import measure_copy_bandwidth

    bw = measure_copy_bandwidth(size_mib=512, repeats=10, threads=4)
    return {"gpu": torch.cuda.get_device_name(0), "copy_bandwidth_gbs": bw.get("cuda_gbs"),
            "onnxruntime": ort.__version__, "providers": ort.get_available_providers(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": sys.version.split()[0]}


@section("genai_build")
def genai_build(script: Path, work: Path) -> dict:
    """Start ORT GenAI's checkpoint + model builds (CPU work) in the background."""
    log = open(work / "genai_build.log", "w")
    proc = subprocess.Popen([sys.executable, str(script), "--size", "1b", "--ep", "cuda", "--work", str(work / "genai"),
                             "--phase", "build"], stdout=log, stderr=subprocess.STDOUT)
    RESULTS["_genai_proc"] = proc
    return {"pid": proc.pid}


LLAMA_VARIANTS = ("fp16", "fp16ops", "fp16opsnonorm", "fp16opsnoattn", "w4a16", "w4a16lm", "w4a16lmops",
                  "w4a16lmopsnonorm", "w4a16lmopsnoattn")
ABLATIONS = ("nonorm", "noattn")  # *ops variants without one of the ops' fusions: CUDA graphs only


@section("llama1b")
def llama1b(graphs: Path, bandwidth: float | None, new_tokens: int, reps: int,
            variants: tuple[str, ...] = LLAMA_VARIANTS, quick: bool = False) -> dict:
    from enginesmith.measure.speed import onnx_weight_bytes
    from enginesmith.runtime.engines.ort_cuda import GqaEngine

    out = {}
    for name in variants:
        path = graphs / f"llama1b_{name}.onnx"
        if not path.exists():
            out[name] = {"error": f"{path} not carried or made"}
            continue
        weights = onnx_weight_bytes(path)
        out[name] = {"weight_bytes": weights}
        modes = ("torch", "ort", "none") if name == "fp16" else ("torch", "torch_nopdl", "none") \
            if name.endswith("ops") else ("torch",) if name.endswith(ABLATIONS) else ("torch", "none")
        modes = modes[:1] if quick else modes
        for mode in modes:
            t = time.time()
            if mode == "torch_nopdl":  # the ops' programmatic dependent launches off (read at session creation)
                os.environ["ES_ORT_OPS_PDL"] = "0"
            engine = GqaEngine(path, device="cuda", max_batch=16, capacity=512, cuda_graph=mode.split("_")[0])
            os.environ.pop("ES_ORT_OPS_PDL", None)
            key = {"torch": "cuda_graph", "torch_nopdl": "cuda_graph_nopdl", "ort": "cuda_graph_ort_capture",
                   "none": "no_cuda_graph"}[mode]
            r = ours(engine, 1, 128, new_tokens, warmup=2, reps=reps)
            r["session_s"] = round(time.time() - t, 1)
            r["graph_mode"] = engine.graph_mode
            if bandwidth:
                r["bound"] = bound(weights, bandwidth, r["decode_tok_s"], 1, 128 + new_tokens // 2, 16, 8, 64)
            out[name][key] = r
            if mode == "torch" and not quick and not name.endswith(ABLATIONS):
                b16 = ours(engine, 16, 128, 128, warmup=1, reps=max(2, reps // 2))
                if bandwidth:
                    b16["bound"] = bound(weights, bandwidth, b16["decode_tok_s"], 16, 128 + 64, 16, 8, 64)
                out[name]["batch16"] = b16
            del engine
            _free()
            print(f"   {name} {key}: {r['decode_tok_s']:.1f} tok/s", flush=True)
            save()
    return out


@section("llama1b_after_genai")
def llama1b_again(graphs: Path, bandwidth: float | None, new_tokens: int, reps: int) -> dict:
    """Ours again, right after GenAI, batch 1 with CUDA graphs: the peer comparison brackets GenAI's
    run by ours before and after it (the machines drift by a few percent within a session)."""
    from enginesmith.measure.speed import onnx_weight_bytes
    from enginesmith.runtime.engines.ort_cuda import GqaEngine

    out = {}
    for name in ("fp16", "fp16ops", "w4a16lm", "w4a16lmops"):
        path = graphs / f"llama1b_{name}.onnx"
        if path.exists():
            engine = GqaEngine(path, device="cuda", max_batch=1, capacity=512, cuda_graph="torch")
            r = ours(engine, 1, 128, new_tokens, warmup=2, reps=reps)
            if bandwidth:
                r["bound"] = bound(onnx_weight_bytes(path), bandwidth, r["decode_tok_s"], 1, 128 + new_tokens // 2,
                                   16, 8, 64)
            out[name] = r
            del engine
            _free()
    return out


@section("hf")
def hf(new_tokens: int, reps: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from enginesmith.measure.speed import torch_weight_bytes
    from enginesmith.models.tiny import config_for

    config = config_for("random:llama-3.2-1b")
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float16).eval()
    out = {"weight_bytes": torch_weight_bytes(model)}
    out["eager"] = hf_generate(model, 1, 128, min(new_tokens, 64), reps=3, static=False)
    save()
    print(f"   eager {out['eager']['decode_tok_s']:.1f} tok/s", flush=True)
    out["static_compile"] = hf_generate(model, 1, 128, new_tokens, reps=reps, static=True)
    del model
    _free()
    return out


@section("genai")
def genai(script: Path, work: Path) -> dict:
    proc = RESULTS.pop("_genai_proc", None)
    if proc is not None:
        proc.wait()
    jsonl = work / "genai.jsonl"
    log = work / "genai_bench.log"
    with open(log, "w") as f:
        subprocess.run([sys.executable, str(script), "--size", "1b", "--ep", "cuda", "--work", str(work / "genai"),
                        "--phase", "bench", "--cuda-graph", "both", "--reps", "3", "--warmup", "1",
                        "--json-out", str(jsonl)], stdout=f, stderr=subprocess.STDOUT, timeout=400)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    return {r["variant"]: {k: r[k] for k in ("decode_tok_s", "ms_per_tok", "ttft_ms", "generated", "og_version",
                                             "ort_version", "model_mb")} for r in rows} or \
        {"error": log.read_text()[-3000:]}


@section("prepare")
def prepare(graphs: Path, work: Path, smol: bool, llama: bool = True) -> dict:
    """CPU work, overlapping the GenAI builds: random weights for the 1B skeletons, the SmolLM2
    fp16 engine (export from the GGUF) and its GQA lowering."""
    from benchmarks.gpu import skeleton
    from enginesmith.builder.engine import BuildConfig, build
    from enginesmith.plugins import ort_ops

    out = {}
    for name in ("fp16", "w4a16", "w4a16lm"):
        path = graphs / f"llama1b_{name}.onnx"
        if llama and path.exists():
            t = time.time()
            out[f"llama1b_{name}_bytes"] = skeleton.materialize(path)
            out[f"llama1b_{name}_s"] = round(time.time() - t, 1)
            if name != "w4a16" and ort_ops.available():
                out[f"llama1b_{name}ops"] = with_ops(path)
                out[f"llama1b_{name}opsnonorm"] = with_ops(path, norm=False)
                out[f"llama1b_{name}opsnoattn"] = with_ops(path, attention=False)
    if smol:  # a lowered engine carried in (built where the lowering was checked) is used as is
        src = work / "smollm2_fp16"
        t = time.time()
        for low, ops in ((work / "smollm2_fp16_gqa", False), (work / "smollm2_fp16_gqa_ops", True)):
            if ops and not ort_ops.available():
                continue
            if not (low / "build.json").exists():
                if not (src / "build.json").exists():
                    build(BuildConfig(dtype="fp16"), src, force=True, progress=False)
                build(BuildConfig(target="ort-cuda", dtype="fp16", capacity=2048, custom_ops=ops,
                                  custom_attention=ops), low, source=src, force=True, progress=False)
        out["smollm2_build_s"] = round(time.time() - t, 1)
    return out


def with_ops(path: Path, norm: bool = True, attention: bool = True) -> dict:
    """<name>ops.onnx beside `path`: the ort_gemv and ort_attention passes (enginesmith's GEMV and
    attention ops) on its graph; <name>opsnonorm.onnx without folding the norms, <name>opsnoattn.onnx
    without the attention op. Applied directly, not through run_pipeline: the CPU check of a 1B graph
    with the ops' reference kernels would take minutes; tests/plugins/test_ort_ops.py and
    test_ort_attention.py check the passes and the kernels."""
    import onnx_ir as ir

    from enginesmith.passes.lower.ort_attention import ort_attention
    from enginesmith.passes.lower.ort_gemv import OrtGemvParams, ort_gemv

    t = time.time()
    dst = path.with_name(path.stem + ("ops" if norm and attention else "opsnonorm" if attention else "opsnoattn")
                         + ".onnx")
    model = ir.load(str(path))
    counts = ort_gemv(model, OrtGemvParams(norm=norm)).counts
    if attention:
        counts.update(ort_attention(model).counts)
    ir.save(model, str(dst), external_data=dst.name + ".data")
    return {"counts": counts, "s": round(time.time() - t, 1)}


@section("smollm2")
def smollm2(work: Path, bandwidth: float | None) -> dict:
    from enginesmith.measure.speed import bench_engine, onnx_weight_bytes
    from enginesmith.runtime.engines.ort_cuda import GqaEngine
    from enginesmith.runtime.engines.ort_engine import OrtEngine

    src = work / "smollm2_fp16"
    out = {}
    for low, suffix in ((work / "smollm2_fp16_gqa", ""), (work / "smollm2_fp16_gqa_ops", "_ops")):
        if not (low / "model.onnx").exists():
            continue
        weights = onnx_weight_bytes(low / "model.onnx")
        for mode in ("torch", "ort", "none"):
            engine = GqaEngine(low / "model.onnx", device="cuda", max_batch=1, capacity=1024, cuda_graph=mode)
            r = ours(engine, 1, 128, 256, warmup=2, reps=5)
            r["graph_mode"] = engine.graph_mode
            if bandwidth:
                r["bound"] = bound(weights, bandwidth, r["decode_tok_s"], 1, 256, 30, 3, 64)
            key = {"torch": "cuda_graph", "ort": "cuda_graph_ort_capture", "none": "no_cuda_graph"}[mode]
            out[key + suffix] = r
            del engine
            _free()
    if (src / "model.onnx").exists():
        plain = OrtEngine(src / "model.onnx", device="cuda")
        out["plain_ort_cuda_numpy_io"] = bench_engine(plain, prompt_tokens=128, new_tokens=64, warmup=1, repeats=3)
        del plain
    _free()
    return out


@section("smollm2_ngram")
def smollm2_ngram(work: Path) -> dict:
    from benchmarks.speculative import bench_ngram

    out = {}
    for name in ("smollm2_fp16_gqa", "smollm2_fp16_gqa_ops"):
        if not (work / name / "model.onnx").exists():
            continue
        path = work / f"ngram_gpu_{name}.json"
        bench_ngram.main(["--device", "cuda", "--engine", str(work / name), "--out", str(path)])
        result = json.loads(path.read_text())
        out[name] = {k: v for k, v in result.items() if k != "rows"} | {"rows": [
            {k: r[k] for k in ("prompt", "new_tokens", "identical", "speedup", "acceptance_rate",
                               "tokens_per_target_call")}
            for r in result["rows"]]}
    return out


def _wait_genai_build() -> None:
    proc = RESULTS.get("_genai_proc")
    if proc is not None and proc.poll() is None:
        print("   waiting for the GenAI builds (no timing while they use the CPU)", flush=True)
        proc.wait()


def _free() -> None:
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graphs", type=Path, default=Path(__file__).parent / "graphs")
    ap.add_argument("--genai-script", type=Path, default=None, help="a copy of ../shared/peers/ortgenai_bench.py")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu_bench"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", default="", help="comma list of sections (default: all)")
    ap.add_argument("--quick", action="store_true", help="llama1b: batch 1 with CUDA graphs only")
    ap.add_argument("--llama-variants", default=",".join(LLAMA_VARIANTS), help="comma list of llama1b graphs")
    ap.add_argument("--no-prepare", action="store_true",
                    help="use the graphs and engines an earlier run prepared (A/B runs of two ops builds)")
    args = ap.parse_args(argv)
    OUT = args.out
    args.work.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, args.only.split(",")))
    want = (lambda s: not only or s in only)
    device_info()
    bw = (RESULTS.get("device") or {}).get("copy_bandwidth_gbs")
    if want("genai") and args.genai_script:
        genai_build(args.genai_script, args.work)
    if not args.no_prepare:
        prepare(args.graphs, args.work, want("smollm2") or want("smollm2_ngram"), want("llama1b"))
    _wait_genai_build()
    if want("llama1b"):
        llama1b(args.graphs, bw, args.new_tokens, args.reps, tuple(args.llama_variants.split(",")), args.quick)
    _wait_genai_build()
    if want("hf"):
        hf(args.new_tokens, args.reps)
    if want("genai") and args.genai_script:
        genai(args.genai_script, args.work)
        if want("llama1b"):
            llama1b_again(args.graphs, bw, args.new_tokens, args.reps)
    if want("smollm2"):
        smollm2(args.work, bw)
    if want("smollm2_ngram"):
        smollm2_ngram(args.work)
    RESULTS.pop("_genai_proc", None)
    save()
    return 0


if __name__ == "__main__":
    sys.path.append(str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
