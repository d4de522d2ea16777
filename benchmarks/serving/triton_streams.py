"""Issue 19's CPU figure: N concurrent gRPC streams through Triton, the old one-request-per-worker model
against the batched one (total time). Prints JSON.

    old: a dense engine    -> the python model's WORKERS threads, each one request at a time
    new: the paged engine  -> the python model's one scheduler loop (in-flight batching)

    python benchmarks/serving/triton_streams.py [--model SPEC] [--streams 50] [--max-tokens 32]
        [--prompt "Write a short story about the number {i}."] [--workers 1] [--max-batch 0]
        [--threads 0] [--engine-core auto|thread|process] [--json-out FILE]

Both engines are built (or taken from the cache) from the same model; each is served by a real
tritonserver on 127.0.0.1 (tests/serving/triton_server.py: the nvidia-pytriton wheel's binary, CPU),
one after the other, with the same prompts, greedy. All streams are opened before the clock starts and
send their request at once; total_s runs from then to the last final response. Each server is stopped
by its PID. `same_tokens` counts the requests whose token ids the two models agree on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "serving"))
from triton_server import GrpcStream, TritonServer, model_env  # noqa: E402  (the tests' server runner)

from enginesmith.builder.engine import BuildConfig, cached_engine  # noqa: E402
from enginesmith.serving.triton_repository import write_model_repository  # noqa: E402


DEFAULT_PROMPT = "Write a short story about the number {i}."  # answers run to max_tokens: decode-bound


def run_streams(engine: Path, work: Path, texts: list[str], max_tokens: int, **options) -> dict:
    """Serve `engine` in a fresh tritonserver and send every prompt at once, each on its own stream."""
    write_model_repository(engine, work / "repo", "m", execution_env=model_env(), device="cpu",
                           max_tokens=max_tokens, verify_hashes=False, **options)
    server = TritonServer(work / "repo", work)
    try:
        server.start(["m"])
        warm = GrpcStream(server.grpc_url)
        try:
            warm.infer("m", "Hello")
        finally:
            warm.close()
        streams = [GrpcStream(server.grpc_url) for _ in texts]
        barrier = threading.Barrier(len(texts) + 1)

        def client(i: int) -> dict:
            barrier.wait(120)
            return streams[i].infer("m", texts[i], timeout=1800)

        with ThreadPoolExecutor(max_workers=len(texts)) as pool:
            futures = [pool.submit(client, i) for i in range(len(texts))]
            barrier.wait(120)
            begun = time.perf_counter()
            results = [f.result() for f in futures]
            total = time.perf_counter() - begun
        for stream in streams:
            stream.close()
        how = [line for line in server.log_tail(200_000).splitlines() if "enginesmith: serving" in line]
    finally:
        left = server.stop()
    ok = [r for r in results if "error" not in r]
    tokens = sum(len(r["token_ids"]) for r in ok)
    first = sorted(r["first_s"] for r in ok)
    return {"engine": str(engine), "served_as": how[-1].split("with ", 1)[-1].rstrip('"') if how else None,
            "total_s": round(total, 2), "requests": len(texts), "errors": len(results) - len(ok),
            "tokens": tokens, "tok_s": round(tokens / total, 1),
            "ttft_p50_s": round(statistics.median(first), 3) if first else None,
            "ttft_max_s": round(first[-1], 3) if first else None,
            "left_behind": left, "token_ids": [r.get("token_ids") for r in results]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--streams", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt template; {i} is the request's number")
    ap.add_argument("--workers", type=int, default=1, help="the old model's worker threads")
    ap.add_argument("--max-batch", type=int, default=0, help="the batched model's rows per step (0: its default)")
    ap.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: all cores)")
    ap.add_argument("--engine-core", default="auto", choices=("auto", "thread", "process"),
                    help="where the batched model's scheduler loop runs (enginesmith triton --engine-core)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    dense = cached_engine(BuildConfig(model=args.model), progress=False)
    paged = cached_engine(BuildConfig(model=args.model, kv_layout="paged"), progress=False)
    texts = [args.prompt.format(i=i) for i in range(args.streams)]
    with tempfile.TemporaryDirectory(prefix="triton-streams-") as tmp:
        old = run_streams(dense, Path(tmp) / "old", texts, args.max_tokens, workers=args.workers, threads=args.threads)
        new = run_streams(paged, Path(tmp) / "new", texts, args.max_tokens, max_batch=args.max_batch,
                          threads=args.threads, engine_core=args.engine_core)
    same = sum(a is not None and a == b for a, b in zip(old.pop("token_ids"), new.pop("token_ids")))
    result = {"model": args.model or "SmolLM2-135M-Instruct (default)", "streams": args.streams,
              "max_tokens": args.max_tokens, "prompt": args.prompt, "engine_core": args.engine_core,
              "cpu_cores": os.cpu_count(), "greedy": True,
              "load_average_after": os.getloadavg()[0],
              "old_one_request_per_worker": old, "new_one_scheduler_loop": new,
              "speedup_total_time": round(old["total_s"] / new["total_s"], 2), "same_tokens": same}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return 0 if old["errors"] == new["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
