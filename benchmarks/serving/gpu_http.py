"""Issue 19's GPU figures: `enginesmith bench serve` at concurrency 1, 16 and 64 against `enginesmith serve`
and against a real tritonserver (the nvidia-pytriton wheel's binary) serving the same CUDA paged engine, one
after the other on one GPU. `ours` is `serve` as a user starts it (on a GPU its engine core runs in a process
of its own, --engine-core auto); `core` and `thread` name the engine core's place explicitly
(`serve --engine-core process | thread`); `triton` is Triton's model over an engine core process
(`enginesmith triton`'s default on a GPU), `triton_thread` with its loop in the model's stub. Each server
is started on 127.0.0.1 and stopped by its PID.

    python3 benchmarks/serving/gpu_http.py --engine /tmp/e/fp16 --requests 128 --out-dir $OUT [--servers ours,triton]
    python3 benchmarks/serving/gpu_http.py --engine /tmp/e/fp16 --requests 256 --concurrency 64,128 \
        --servers ours,replicas --devices 0,1 --out-dir $OUT          # the two-GPU figure
    python3 benchmarks/serving/gpu_http.py --engine /tmp/e/fp16 --requests 256 --concurrency 16,64 \
        --servers ours --front-ends 1,2,4 --out-dir $OUT              # serve --front-ends N over one core

--front-ends runs `ours` and `core` once per N (`serve --front-ends N`; results named ours_fe2, ...; N = 1
is `ours` as before).

The client is `bench serve --procs auto` (one process per 32 streams) unless --procs says otherwise.

Triton's model environment needs numpy<2 (tests/serving/triton_server.py says why): on a machine without an
index, set ENGINESMITH_TRITON_WHEELS to a folder holding a numpy<2 wheel.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "serving"))
from triton_server import TritonServer, model_env  # noqa: E402  (the tests' server runner)

READY = re.compile(r"enginesmith serve: (http://127\.0\.0\.1:\d+)")
ES = [sys.executable, "-m", "enginesmith.cli"]


def bench(url: str, engine: str, args, api: str, model: str | None, out: Path) -> dict:
    cmd = [*ES, "bench", "serve", "--url", url, "--api", api, "--concurrency", args.concurrency,
           "--requests", str(args.requests), "--prompt-tokens", str(args.prompt_tokens),
           "--new-tokens", str(args.new_tokens), "--tokenizer", engine, "--procs", args.procs, "--json",
           "--png", str(out.with_suffix(".png"))]
    if model:
        cmd += ["--model", model]
    if api == "openai":  # an OpenAI-server extension: every answer runs to --new-tokens
        cmd += ["--ignore-eos"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    print(run.stderr[-2000:], file=sys.stderr)
    result = json.loads(run.stdout) if run.stdout.strip().startswith("{") else {"error": run.stdout[-2000:]}
    result["exit_status"] = run.returncode
    out.write_text(json.dumps(result, indent=1))
    return result


def ours(args, out_dir: Path, name: str = "ours", extra: tuple[str, ...] = ()) -> dict:
    proc = subprocess.Popen([*ES, "serve", "--engine", args.engine, "--device", "cuda", "--port", "0",
                             "--max-waiting", "1024", *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        url, deadline, seen = None, time.time() + 600, []
        while url is None and time.time() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                raise RuntimeError("enginesmith serve exited:\n" + "".join(seen[-40:]))
            seen.append(line)
            if m := READY.search(line):
                url = m.group(1)
        print("".join(seen), file=sys.stderr)
        threading.Thread(target=lambda: [print(line, end="", file=sys.stderr) for line in proc.stdout],
                         daemon=True).start()  # keep the pipe drained
        return bench(url, args.engine, args, "openai", None, out_dir / f"bench_serve_{name}.json")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def triton(args, out_dir: Path, name: str = "triton", engine_core: str = "auto") -> dict:
    """A real tritonserver on the engine; `engine_core` as `enginesmith triton --engine-core` (auto: the
    scheduler loop in an engine core process on the GPU; thread: in the model's stub)."""
    from enginesmith.serving.triton_repository import write_model_repository

    work = Path(tempfile.mkdtemp(prefix="es_triton_gpu_"))
    write_model_repository(args.engine, work / "repo", "m", execution_env=model_env(), device="cuda",
                           max_tokens=args.new_tokens, verify_hashes=False, max_waiting=1024, engine_core=engine_core)
    server = TritonServer(work / "repo", work)
    out = out_dir / f"bench_serve_{name}.json"
    try:
        server.start(["m"], timeout=600)
        return bench(f"http://{server.http_url}", args.engine, args, "triton", "m", out)
    except Exception as exc:  # noqa: BLE001 - reported, with the server's log
        log = server.log_tail(6000) if server.proc is not None else ""
        result = {"error": f"{type(exc).__name__}: {exc}"[:3000], "server_log_tail": log}
        out.write_text(json.dumps(result, indent=1))
        return result
    finally:
        if server.proc is not None:
            print("triton leftovers:", server.stop(), file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--procs", default="auto",
                    help="bench serve's client processes (default auto: one per 32 streams, so 4 at 128; one "
                         "process reads ~25k events/s and must not cap the figure)")
    ap.add_argument("--servers", default="ours,triton", help="any of ours, core, thread, replicas, triton, triton_thread")
    ap.add_argument("--devices", default="0,1", help="replicas: the GPUs (serve --devices)")
    ap.add_argument("--front-ends", default="1",
                    help="ours, core: one run per N of this list, e.g. 1,2,4 (serve --front-ends N)")
    ap.add_argument("--out-dir", type=Path, required=True)
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    summary = {}
    runs = [(name, n) for name in args.servers.split(",")
            for n in (map(int, args.front_ends.split(",")) if name in ("ours", "core") else [1])]
    for name, fronts in runs:
        if fronts > 1:  # serve --front-ends N: N front-end processes over the one engine core
            extra = ("--front-ends", str(fronts)) + (("--engine-core", "process") if name == "core" else ())
            summary[f"{name}_fe{fronts}"] = table(ours(args, args.out_dir, f"{name}_fe{fronts}", extra))
            continue
        if name == "triton":  # the model over an engine core process (enginesmith triton's default on a GPU)
            result = triton(args, args.out_dir)
        elif name == "triton_thread":  # the model's scheduler loop in its stub (enginesmith triton --engine-core thread)
            result = triton(args, args.out_dir, name, "thread")
        elif name == "replicas":  # one replica per GPU behind serve's front door
            result = ours(args, args.out_dir, "replicas", ("--devices", args.devices))
        elif name == "core":  # the BatcherLoop in an engine core process of its own (serve --engine-core process)
            result = ours(args, args.out_dir, "core", ("--engine-core", "process"))
        elif name == "thread":  # the BatcherLoop in a thread of the server process (serve --engine-core thread)
            result = ours(args, args.out_dir, "thread", ("--engine-core", "thread"))
        else:
            result = ours(args, args.out_dir)
        summary[name] = table(result)
    print(json.dumps(summary, indent=1))


def table(result: dict):
    """The summary rows of one server's bench serve result (or the result itself, an error)."""
    return [{"concurrency": r["concurrency"], "procs": r.get("procs", 1), "tok_s": round(r["tok_s"], 1),
             "req_s": round(r["req_s"], 2),
             "ttft_ms_p50": r["ttft_ms"]["p50"], "itl_ms_p50": r["itl_ms"]["p50"],
             "itl_ms_p99": r["itl_ms"]["p99"], "errors": r["errors"]["by_kind"]}
            for r in result.get("runs", [])] or result


if __name__ == "__main__":
    main()
