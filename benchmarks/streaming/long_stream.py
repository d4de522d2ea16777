"""Long-stream perplexity (StreamingLLM's comparison) on continuous Austen text, for the report.

    python benchmarks/streaming/long_stream.py --tokens 20480 --device cuda --out DIR \
        [--policies dense,window,ring,recompute] [--sinks 4 --kv-window 1020] [--stride 1] [--text FILE]
    python benchmarks/streaming/long_stream.py --merge DIR      # table, long_stream.json, long_stream.png

The functions are those of `enginesmith eval ppl --kv dense,window,ring,recompute --plot PNG`
(measure.streaming), with engines from the same build cache; here every policy's per-token nll is
saved as soon as it is done (DIR/<policy>.npz + .json), so the comparison can run in pieces (the
device runs one command for at most 10 minutes) and be merged. Recompute runs exactly (stride 1)
with a last-token-logits copy of the dense graph, so no [B, W, V] logits leave the device.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

from enginesmith.measure import streaming
from enginesmith.models import corpus  # noqa: E402


def run(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda":
        common.strict_fp32_cuda()
    capacity = args.sinks + args.kv_window
    dense = common.open_engine(args.model, args.device)
    text = corpus.load_text(args.text, novel=args.novel)
    ids = corpus.tokenize(dense.tokenizer, text, args.tokens)
    if len(ids) < args.tokens:
        raise SystemExit(f"the text has only {len(ids)} tokens")
    for policy in args.policies.split(","):
        started = time.time()
        if policy == "dense":
            result = streaming.run_cached("dense", dense.engine, ids, chunk=args.chunk)
        elif policy == "recompute":
            from enginesmith.runtime.engines.ort_engine import OrtEngine

            last = streaming.last_token_graph(dense.path / "model.onnx", out / "last_token.onnx")
            result = streaming.run_recompute(dense.engine, ids, capacity, args.stride, args.batch,
                                             last_engine=OrtEngine(last, device=args.device))
            for f in (out / "last_token.onnx", out / "last_token.onnx.data"):
                f.unlink(missing_ok=True)
        else:
            sinks, window = (args.sinks, args.kv_window) if policy == "ring" else (0, capacity)
            engine = common.open_engine(args.model, args.device, "ring", sinks, window).engine
            result = streaming.run_cached(policy, engine, ids)
        rss = [(p, np.nan if m is None else m) for p, m in result.rss_mib]
        np.savez(out / f"{policy}.npz", nll=result.nll, cache=np.array(result.cache_mib, dtype=float).reshape(-1, 2),
                 rss=np.array(rss, dtype=float).reshape(-1, 2))
        meta = {"policy": policy, "settings": result.settings, "seconds": result.seconds,
                "ms_per_step": result.ms_per_step, "device": common.device_name(args.device),
                "text": args.text or f"austen:{args.novel}", "tokens": int(len(ids)), "model": args.model or "SmolLM2-135M-Instruct"}
        (out / f"{policy}.json").write_text(json.dumps(meta, indent=1))
        summary = streaming.summary(result)
        print(f"{policy}: ppl {summary['ppl']:.3f}, {summary['ms_per_step']:.2f} ms/step, "
              f"{time.time() - started:.0f} s", flush=True)


def merge(folder: Path) -> None:
    runs, metas = [], []
    for policy in streaming.POLICIES:
        if not (folder / f"{policy}.npz").is_file():
            continue
        data = np.load(folder / f"{policy}.npz")
        meta = json.loads((folder / f"{policy}.json").read_text())
        runs.append(streaming.StreamRun(policy, data["nll"], meta["seconds"], meta["ms_per_step"], meta["settings"],
                                        [tuple(r) for r in data["cache"]], [tuple(r) for r in data["rss"]]))
        metas.append(meta)
    summaries = [streaming.summary(r) for r in runs]
    by = {s["policy"]: s for s in summaries}
    checks = {}
    if "ring" in by and "recompute" in by:
        checks["ring_ppl_over_recompute"] = round(by["ring"]["ppl"] / by["recompute"]["ppl"], 4)
        checks["recompute_ms_over_ring_ms_per_token"] = round(by["recompute"]["ms_per_step"] / by["ring"]["ms_per_step"], 1)
    if "ring" in by:
        checks["ring_cache_mib_constant"] = bool(by["ring"]["cache_mib_first"] == by["ring"]["cache_mib_last"])
    if "window" in by and "ring" in by:
        checks["window_over_ring_ppl"] = round(by["window"]["ppl"] / by["ring"]["ppl"], 2)
    text = metas[0]["text"]
    table = streaming.format_table(summaries, f"{text}, {metas[0]['tokens']} tokens, {metas[0]['model']}, "
                                              f"{metas[0]['device']}")
    print(table)
    print(json.dumps(checks))
    (folder / "long_stream.json").write_text(json.dumps({"runs": summaries, "checks": checks, "meta": metas}, indent=1))
    (folder / "long_stream.txt").write_text(table + "\n" + json.dumps(checks) + "\n")
    streaming.plot(runs, str(folder / "long_stream.png"), bin_tokens=512,
                   title=f"{metas[0]['model']}: {text}, {metas[0]['tokens']} tokens (cache 4+1020 / 0+1024 / 1024)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tokens", type=int, default=20480)
    p.add_argument("--text", default=None)
    p.add_argument("--novel", default="prideprejudice")
    p.add_argument("--policies", default="dense,window,ring,recompute")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--kv-window", type=int, default=1020)
    p.add_argument("--stride", type=int, default=1)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--out", default="benchmarks/streaming/results")
    p.add_argument("--merge", metavar="DIR", default=None)
    args = p.parse_args()
    if args.merge:
        merge(Path(args.merge))
    else:
        run(args)


if __name__ == "__main__":
    main()
