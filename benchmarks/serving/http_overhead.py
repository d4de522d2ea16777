"""Issue 19's yardstick: how many output tokens/s the HTTP stack of `enginesmith serve` can carry when the
engine costs nothing (or a fixed, GIL-free time per step), and how much server CPU each token costs.

    this process (the server)                                   a child process (the client)
    FakePagedModel.run: sleep --step-ms (GIL released,           enginesmith bench serve --concurrency C
        as a CUDA sync is), one token id per pick                    --ignore-eos, P prompt / T output tokens
    BatcherLoop (enginesmith/serving/loop.py) ── make_app (openai_api) ── uvicorn on 127.0.0.1 ◀══ HTTP/1.1 SSE ══╝

Everything but the model is the real server: the ContinuousBatcher and its block manager, the loop thread,
EventRelay, TextStream over the tiny engine's tokenizer (a real `tokenizers` BPE over words), SSE chunks,
uvicorn. The fake's tokens are words of the tokenizer's vocabulary, a different sequence per request.

Per concurrency it reports the client's output tok/s, the ideal (min(C, max batch) rows / step time, when
--step-ms > 0), and the server's CPU time per output token: the whole process, the batcher loop thread and
the event loop thread (from /proc/self/task/*/stat). The client's CPU time is reported too: on a small
machine the client competes with the server for cores.

    python3 benchmarks/serving/http_overhead.py --step-ms 3.3 --concurrency 64,128
    python3 benchmarks/serving/http_overhead.py --step-ms 0 --concurrency 64 --py-spy /tmp/prof.txt
    python3 benchmarks/serving/http_overhead.py --step-ms 0 --concurrency 64 --procs 2   # the client in 2 processes

--py-spy FILE samples this process with py-spy (if installed) while the client runs and writes the top
functions by own time (leaf frames) to FILE; --yappi FILE does the same with yappi's CPU clock
(deterministic, slower: it shows call counts).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import uvicorn

from enginesmith.builder.engine import BuildConfig, cached_engine
from enginesmith.runtime.decoding.batching import SchedulerConfig
from enginesmith.runtime.load import open_engine
from enginesmith.serving.loop import BatcherLoop
from enginesmith.serving.openai_api import make_app

FIRST_WORD = 300     # ids below are the tiny tokenizer's specials and bytes; above, whole words
TICK = os.sysconf("SC_CLK_TCK")


class FakePagedModel:
    """A PagedModel (runtime/decoding/batching.py) without a model: `run` sleeps `step_s` and returns one word id
    per pick, a function of (the request's seed, the token's index)."""

    max_chunk = None
    async_steps = True  # as the CUDA engine it stands for: the scheduler prepares step n+1 during step n

    def __init__(self, vocab: int, step_s: float, num_pages: int = 1 << 14, page_size: int = 16,
                 max_positions: int = 8192):
        self.vocab, self.step_s = vocab, step_s
        self.num_pages, self.page_size, self.max_positions = num_pages, page_size, max_positions
        self.steps = 0

    def copy_pages(self, copies) -> None:
        pass

    def run(self, ids, step, picks) -> list[int]:
        self.steps += 1
        if self.step_s:
            time.sleep(self.step_s)
        span = self.vocab - FIRST_WORD
        return [FIRST_WORD + (p.seed * 1_000_003 + p.index * 7919) % span for p in picks]


def thread_cpu_s(native_id: int) -> float:
    """User + system CPU seconds of one thread of this process (0 once it is gone)."""
    try:
        fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14 and 15 of stat)


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def bench(url: str, engine: Path, c: int, args) -> dict:
    cmd = [sys.executable, "-m", "enginesmith.cli", "bench", "serve", "--url", url, "--concurrency", str(c),
           "--requests", str(args.requests or 8 * c), "--prompt-tokens", str(args.prompt_tokens),
           "--new-tokens", str(args.new_tokens), "--tokenizer", str(engine), "--ignore-eos", "--procs", args.procs,
           "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if not run.stdout.strip().startswith("{"):
        raise RuntimeError(f"bench serve failed ({run.returncode}):\n{run.stderr[-3000:]}")
    return json.loads(run.stdout)["runs"][0]


class Profiler:
    """py-spy (sampling, a child process) or yappi (in process, CPU clock) around the client's runs."""

    def __init__(self, args):
        self.kind = "py-spy" if args.py_spy else "yappi" if args.yappi else None
        self.out = Path(args.py_spy or args.yappi) if self.kind else None
        self.proc = None

    def start(self) -> None:
        if self.kind == "py-spy":
            exe = shutil.which("py-spy")
            if exe is None:
                raise SystemExit("py-spy is not installed (pip install py-spy)")
            self.raw = self.out.with_suffix(".raw")
            self.proc = subprocess.Popen([exe, "record", "--pid", str(os.getpid()), "--format", "raw", "--rate", "250",
                                          "--threads", "--gil", "--nonblocking", "--output", str(self.raw)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(1.0)
        elif self.kind == "yappi":
            import yappi  # deferred: an optional profiler

            yappi.set_clock_type("cpu")
            yappi.start(builtins=True, profile_threads=True)

    def stop(self) -> None:
        if self.kind == "py-spy":
            self.proc.send_signal(2)
            self.proc.wait(timeout=60)
            self.out.write_text(top_leaves(self.raw.read_text().splitlines()))  # the raw stacks stay beside it
        elif self.kind == "yappi":
            import yappi  # deferred: an optional profiler

            yappi.stop()
            stats = sorted(yappi.get_func_stats(), key=lambda s: s.tsub, reverse=True)[:60]
            total = sum(s.tsub for s in yappi.get_func_stats())
            lines = [f"yappi CPU clock: {total:.2f} s own time in all; top own time (tsub), total (ttot), calls"]
            lines += [f"{s.tsub:8.3f} {100 * s.tsub / total:5.1f}% {s.ttot:8.3f} {s.ncall:9d}  {s.full_name}"
                      for s in stats]
            self.out.write_text("\n".join(lines) + "\n")
        if self.kind:
            print(f"wrote {self.out}", file=sys.stderr)


def top_leaves(raw: list[str], top: int = 40) -> str:
    """py-spy raw (collapsed stacks, `frame;frame;... count`): samples by thread, then by function (line
    numbers dropped) as own time (the leaf frame) and as total time (anywhere in the stack)."""
    own, inclusive, threads, total = collections.Counter(), collections.Counter(), collections.Counter(), 0
    for line in raw:
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        thread, *frames = stack.split(";")
        names = [f.rsplit(":", 1)[0] + ")" if f.endswith(")") and ":" in f else f for f in frames] or [thread]
        n = int(count)
        total += n
        threads[thread.split(": ")[-1]] += n
        own[names[-1]] += n
        for name in set(names):
            inclusive[name] += n
    lines = [f"py-spy: {total} samples (only the thread holding the GIL: --gil); by thread:"]
    lines += [f"{100 * n / total:6.1f}%  {name}" for name, n in threads.most_common(8)]
    for title, counts in (("own samples by function", own), ("total samples by function", inclusive)):
        lines += ["", f"{title}:"] + [f"{100 * n / total:6.1f}%  {name}" for name, n in counts.most_common(top)]
    return "\n".join(lines) + "\n"


def drive(server: uvicorn.Server, loop: BatcherLoop, model: FakePagedModel, engine: Path, args,
          results: list) -> None:
    try:
        while not server.started:
            time.sleep(0.05)
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        url = f"http://{host}:{port}"
        event_loop_thread = threading.main_thread().native_id
        profiler = Profiler(args)
        profiler.start()
        batcher_thread = loop._thread.native_id
        for c in [int(x) for x in args.concurrency.split(",")]:
            rows = min(c, args.max_batch)
            stats0, steps0 = loop.stats(), model.steps
            cpu0, client0 = time.process_time(), children_cpu_s()
            batcher0, event0 = thread_cpu_s(batcher_thread), thread_cpu_s(event_loop_thread)
            wall0 = time.perf_counter()
            run = bench(url, engine, c, args)
            wall = time.perf_counter() - wall0  # the client's start-up included
            stats, steps = loop.stats(), model.steps - steps0
            tokens = stats.generated_tokens - stats0.generated_tokens
            served = stats.requests_finished - stats0.requests_finished
            cpu = time.process_time() - cpu0
            row = {"concurrency": c, "procs": run["procs"], "rows": rows, "step_ms": args.step_ms,
                   "tok_s": run["tok_s"],
                   "ideal_tok_s": rows / (args.step_ms / 1000) if args.step_ms else None,
                   "errors": run["errors"]["total"], "itl_p50_ms": run["itl_ms"]["p50"],
                   "ttft_p50_ms": run["ttft_ms"]["p50"], "server_tokens": tokens, "steps": steps,
                   "tokens_per_step": tokens / max(steps, 1),
                   "server_prompt_tokens_mean": (stats.prompt_tokens - stats0.prompt_tokens) / max(served, 1),
                   "server_cpu_us_per_token": 1e6 * cpu / max(tokens, 1),
                   "batcher_thread_us_per_token": 1e6 * (thread_cpu_s(batcher_thread) - batcher0) / max(tokens, 1),
                   "event_loop_us_per_token": 1e6 * (thread_cpu_s(event_loop_thread) - event0) / max(tokens, 1),
                   "server_cpu_share": cpu / run["seconds"], "client_cpu_s": children_cpu_s() - client0,
                   "wall_s": wall}
            results.append(row)
            ideal = f" (ideal {row['ideal_tok_s']:.0f})" if row["ideal_tok_s"] else ""
            print(f"C={c:4d} rows {rows:3d} client procs {row['procs']}: {row['tok_s']:8.0f} tok/s{ideal}; server CPU "
                  f"{row['server_cpu_us_per_token']:.1f} us/token (batcher thread "
                  f"{row['batcher_thread_us_per_token']:.1f}, event loop {row['event_loop_us_per_token']:.1f}); "
                  f"{row['tokens_per_step']:.1f} tokens/step; "
                  f"ITL p50 {row['itl_p50_ms']:.2f} ms; server busy {row['server_cpu_share']:.2f} cores; client CPU "
                  f"{row['client_cpu_s']:.1f} s (start-up included); errors {row['errors']}", flush=True)
        profiler.stop()
    finally:
        server.should_exit = True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step-ms", type=float, default=0.0, help="GPU-like time per step, GIL released (default 0)")
    p.add_argument("--concurrency", default="64,128", help="client concurrencies, one run each (default 64,128)")
    p.add_argument("--requests", type=int, default=None, help="requests per run (default 8 x concurrency)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--max-batch", type=int, default=128, help="rows per scheduler step (default 128)")
    p.add_argument("--chunk", type=int, default=64, help="prompt tokens per row per step (serve's default 64)")
    p.add_argument("--loop", default="auto", choices=("auto", "asyncio", "uvloop"), help="uvicorn's event loop")
    p.add_argument("--http", default="auto", choices=("auto", "h11", "httptools"), help="uvicorn's HTTP parser")
    p.add_argument("--switch-interval", type=float, default=None, metavar="S",
                   help="sys.setswitchinterval for this process (default: the interpreter's, 0.005 s)")
    p.add_argument("--sync-steps", action="store_true",
                   help="schedule each step after the last one's tokens (default: async, one step in flight)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for one client run")
    p.add_argument("--procs", default="1", metavar="K|auto", help="the client's processes (bench serve --procs)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the rows as JSON")
    p.add_argument("--py-spy", default=None, metavar="FILE", help="profile with py-spy; top functions to FILE")
    p.add_argument("--yappi", default=None, metavar="FILE", help="profile with yappi; top functions to FILE")
    args = p.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)

    engine = cached_engine(BuildConfig(model="tiny:llama", kv_layout="paged"), progress=False)
    loaded = open_engine(engine, device="cpu", threads=1)
    tokenizer = loaded.tokenizer
    model = FakePagedModel(loaded.manifest.model.vocab or len(tokenizer), args.step_ms / 1000)
    scheduler = SchedulerConfig(max_batch=args.max_batch, max_tokens=max(256, args.max_batch + args.chunk),
                                chunk=args.chunk, async_steps=not args.sync_steps)
    loop = BatcherLoop(model, scheduler, max_waiting=4096,
                       decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    app = make_app(loaded, loop, "fake")
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False, lifespan="on",
                            loop=args.loop, http=args.http)
    server = uvicorn.Server(config)
    results: list[dict] = []
    driver = threading.Thread(target=drive, args=(server, loop, model, engine, args, results), daemon=True)
    driver.start()
    print(f"http_overhead: fake engine, step {args.step_ms:g} ms ({'sync' if args.sync_steps else 'async'} steps), "
          f"max batch {args.max_batch}, prompt "
          f"{args.prompt_tokens} / output {args.new_tokens} tokens, uvicorn loop={args.loop} http={args.http}, "
          f"{os.cpu_count()} CPUs", flush=True)
    try:
        server.run()
    finally:
        loop.close()
    driver.join(timeout=5)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "cpus": os.cpu_count(), "runs": results}, indent=1))
    return 0 if results and not any(r["errors"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
