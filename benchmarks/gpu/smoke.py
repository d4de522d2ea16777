"""A first, short GPU session: does the GQA engine run on ORT CUDA with CUDA graphs, do its tokens match
the CPU reference, and how far is the 1B fp16 decode from the bandwidth bound? (Decides what to fix
before the full benchmark.)

    here:   python benchmarks/gpu/smoke.py prepare        # tiny lowered graphs + CPU reference tokens
    there:  python benchmarks/gpu/smoke.py run --out $OUT/smoke.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

GRAPHS = Path(__file__).parent / "graphs"
PROMPTS = [[5, 6, 7, 8, 9, 5, 6], [11, 12, 13]]


def prepare() -> None:
    import shutil

    from enginesmith.builder.engine import BuildConfig, build, cached_engine
    from enginesmith.runtime.decoding.generate import GenerationConfig
    from enginesmith.runtime.engines.ort_cuda import GqaEngine, fast_generate_ids

    refs = {}
    for dtype in ("fp32", "fp16"):
        src = cached_engine(BuildConfig(model="tiny:llama", dtype=dtype), progress=False)
        low = Path(f"/tmp/es7/tiny_{dtype}_gqa")
        if not low.exists():
            build(BuildConfig(target="ort-cuda", dtype="fp16", capacity=128), low, source=src, progress=False)
        (GRAPHS / f"tiny_{dtype}").mkdir(parents=True, exist_ok=True)
        for suffix in ("", ".data"):
            shutil.copyfile(low / f"model.onnx{suffix}", GRAPHS / f"tiny_{dtype}" / f"model.onnx{suffix}")
        engine = GqaEngine(GRAPHS / f"tiny_{dtype}" / "model.onnx", device="cpu", max_batch=2, capacity=128)
        refs[dtype] = [ids.tolist() for ids, _ in fast_generate_ids(engine, PROMPTS, GenerationConfig(max_new_tokens=40))]
    (GRAPHS / "tiny_ref.json").write_text(json.dumps(refs))


def run(out: Path, tiny_only: bool = False) -> None:
    import onnxruntime as ort
    import torch

    from benchmarks.gpu import skeleton
    from benchmarks.gpu.bench_gpu import bound, ours
    from enginesmith.measure.speed import measure_copy_bandwidth, onnx_weight_bytes
    from enginesmith.runtime.decoding import speculative as sp
    from enginesmith.runtime.decoding.generate import GenerationConfig
    from enginesmith.runtime.engines.ort_cuda import GqaEngine, fast_generate_ids

    result: dict = {"gpu": torch.cuda.get_device_name(0), "ort": ort.__version__,
                    "providers": ort.get_available_providers()}

    def dump():
        out.write_text(json.dumps(result, indent=1, default=str))

    refs = json.loads((GRAPHS / "tiny_ref.json").read_text())
    config = GenerationConfig(max_new_tokens=40)
    for dtype in ("fp16",):  # CUDA GQA is fp16/bf16 only
        for graphs in ("none", "ort", "torch"):
            key = f"tiny_{dtype}_{graphs}"
            try:
                engine = GqaEngine(GRAPHS / f"tiny_{dtype}" / "model.onnx", device="cuda", max_batch=2, capacity=128,
                                   cuda_graph=graphs)
                got = [ids.tolist() for ids, _ in fast_generate_ids(engine, PROMPTS, config)]
                again = [ids.tolist() for ids, _ in fast_generate_ids(engine, PROMPTS, config)]
                same = sum(a == b for a, b in zip(got, refs[dtype]))
                stats = sp.SpeculativeStats()
                spec = list(sp.speculative_tokens(engine, sp.NgramDrafter(), PROMPTS[0], config,
                                                  sp.SpeculativeConfig(k=4), stats))
                result[key] = {"steps_matching_cpu": f"{same}/{len(got)}", "repeatable": got == again,
                               "speculative_identical": spec == [r[0] for r in got],
                               "spec": stats.to_json(), "runs": {str(k): s.runs for k, s in engine._steps.items()},
                               "shared_stream": engine.shared_stream, "mode": engine.graph_mode}
            except Exception as exc:  # noqa: BLE001
                import traceback

                result[key] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2500:]}
            print(key, result[key], flush=True)
            dump()
    if tiny_only:
        return
    bw = measure_copy_bandwidth(size_mib=512, repeats=10, threads=4).get("cuda_gbs")
    result["copy_bandwidth_gbs"] = bw
    path = GRAPHS / "llama1b_fp16.onnx"
    t = time.time()
    skeleton.materialize(path)
    result["materialize_s"] = round(time.time() - t, 1)
    weights = onnx_weight_bytes(path)
    for graphs in (True, False):
        key = f"llama1b_fp16_{'graph' if graphs else 'nograph'}"
        try:
            t = time.time()
            engine = GqaEngine(path, device="cuda", max_batch=16, capacity=512, cuda_graph=graphs)
            r = ours(engine, 1, 128, 128, warmup=2, reps=3)
            r["session_s"] = round(time.time() - t, 1)
            r["bound"] = bound(weights, bw, r["decode_tok_s"], 1, 192, 16, 8, 64)
            if graphs:
                result["llama1b_fp16_batch16"] = ours(engine, 16, 128, 64, warmup=1, reps=2)
            result[key] = r
            del engine
        except Exception as exc:  # noqa: BLE001
            import traceback

            result[key] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2500:]}
        print(key, result[key], flush=True)
        dump()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("verb", choices=["prepare", "run"])
    ap.add_argument("--out", type=Path, default=Path("smoke.json"))
    ap.add_argument("--tiny-only", action="store_true")
    args = ap.parse_args(argv)
    prepare() if args.verb == "prepare" else run(args.out, args.tiny_only)
    return 0


if __name__ == "__main__":
    sys.path.append(str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
