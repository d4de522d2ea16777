"""`enginesmith serve`: an OpenAI-compatible HTTP server over one paged engine (serving/openai_api.py).

    enginesmith serve --engine DIR | --model SPEC [--device auto|cpu|cuda] [--host 127.0.0.1] [--port 8000]
                      [--max-batch N] [--num-pages K] [--max-waiting N] [--api-key KEY] [--model-name NAME]

    open the engine (runtime.load) ─▶ its PagedModel ─▶ one BatcherLoop (serving/loop.py) ─▶ the ASGI app
    ─▶ uvicorn; one line on stdout once it listens: "enginesmith serve: http://HOST:PORT ..."

Every request of every client runs through the one scheduler loop (continuous batching). The
engine must have paged KV: `enginesmith build --kv paged` (CPU) or `--for-cuda --kv paged` (GPU);
--model builds (and caches) the right one.

Stopping: the first SIGTERM or Ctrl-C drains: /health and new requests get 503, the requests in
flight run to their end, for at most --drain-timeout seconds, then the process exits 0; a second
signal cuts them off at once. Requests cut off (a timeout, a second signal) make the exit status 1.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from enginesmith.build.engine import BuildConfig
from enginesmith.cli.flags import add_model_flags, load_engine
from enginesmith.core.errors import UserError

API_KEY_ENV = "ENGINESMITH_API_KEY"
CPU_MAX_BATCH = 16   # rows per step on the CPU (a --for-cuda engine: its --max-batch)
CHUNK = 64           # prompt tokens per row per step (capped by what the engine's attention takes)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_parser(verbs) -> None:
    p = verbs.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)",
        description="Serve an engine over the OpenAI API: POST /v1/completions and /v1/chat/completions (streamed "
                    "as server-sent events with stream: true), GET /v1/models, /health and /metrics (Prometheus). "
                    "Every request shares one continuous-batching scheduler.",
        epilog="Example: enginesmith build --model tiny:llama --kv paged --out eng && enginesmith serve --engine eng "
               "--port 8000; then: curl localhost:8000/v1/completions -d '{\"model\": \"tiny:llama\", \"prompt\": "
               "\"Hello\", \"max_tokens\": 8}'")
    add_model_flags(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000,
                   help="TCP port (default 8000; 0: a free one, named in the ready line)")
    g.add_argument("--model-name", default=None, metavar="NAME",
                   help="the `model` clients send (default: the engine's source model, e.g. tiny:llama)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require `Authorization: Bearer KEY` on /v1/* (default: ${API_KEY_ENV}, which keeps the key "
                        "out of the process list; none: open)")
    g.add_argument("--max-waiting", type=int, default=256, metavar="N",
                   help="requests queued beyond the running batch; more get 429 with Retry-After (default 256)")
    g.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM/Ctrl-C, seconds the requests in flight may take to finish (default 30)")
    g.add_argument("--log-level", default="warning", choices=LOG_LEVELS, help="uvicorn's log level (default warning)")
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")
    g.add_argument("--devices", default=None, metavar="LIST",
                   help="GPU ids for one engine replica each, e.g. 0,1 (needs --device cuda)")
    s = p.add_argument_group("scheduler")
    s.add_argument("--max-batch", type=int, default=None, metavar="N",
                   help=f"rows per scheduler step (default {CPU_MAX_BATCH} on the CPU; a --for-cuda engine: its "
                        "build's --max-batch, which is also the most it takes)")
    s.add_argument("--num-pages", type=int, default=None, metavar="K",
                   help="KV pages in the pool (default: what 1 GiB holds on the CPU; --gpu-memory-utilization of "
                        "the GPU for a --for-cuda engine)")
    s.add_argument("--chunk", type=int, default=None,
                   help=f"prompt tokens per row per step (default {CHUNK}, at most what the engine's attention takes)")
    p.set_defaults(func=cmd_serve)


def _check_flags(args) -> None:
    """Every flag checked before any model is loaded."""
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port} is not a TCP port", "give --port in [0, 65535] (0: any free port)")
    for flag, value, low in (("--max-batch", args.max_batch, 1), ("--num-pages", args.num_pages, 2),
                             ("--chunk", args.chunk, 1), ("--max-waiting", args.max_waiting, 1)):
        if value is not None and value < low:
            raise UserError(f"{flag} {value} is too small", f"give {flag} >= {low}")
    if not args.drain_timeout >= 0:
        raise UserError(f"--drain-timeout {args.drain_timeout} is negative", "give --drain-timeout >= 0 seconds")
    missing = [name for name in ("starlette", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"enginesmith serve needs {' and '.join(missing)}, which this Python does not have",
                        "pip install 'enginesmith[serve]' (or: pip install starlette uvicorn)")


def _check_devices(args, device: str) -> None:
    if args.devices is None:
        return
    if device != "cuda":
        raise UserError(f"--devices {args.devices} places engine replicas on GPUs; the device here is {device}",
                        "add --device cuda on a machine with GPUs, or leave out --devices")
    raise UserError("--devices (one engine replica per GPU behind one server) is not available yet",
                    "run one `enginesmith serve` per GPU, each with CUDA_VISIBLE_DEVICES=<id> and its own --port")


def cmd_serve(args) -> int:
    from enginesmith.runtime.load import paged_model  # deferred: imports onnxruntime (optional; --help works without)
    from enginesmith.runtime.ort_engine import resolve_device  # deferred: imports onnxruntime
    from enginesmith.runtime.batching import SchedulerConfig  # deferred: with the runtime above
    from enginesmith.serving.loop import BatcherLoop  # deferred: with the runtime above

    _check_flags(args)
    device = resolve_device(args.device)
    _check_devices(args, device)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    config = None
    if not args.engine:  # --model (or the default model): a paged engine for this device, built once and cached
        cuda = {"target": "ort-cuda", "dtype": "fp16"} if device == "cuda" else {}
        config = BuildConfig(model=args.model, kv_layout="paged", **cuda)
    args.batch = args.max_batch  # a --for-cuda paged engine opens with this many rows (default: its build's)
    loaded = load_engine(args, config)
    try:
        model = paged_model(loaded, args.num_pages)
    except UserError:
        raise UserError(f"{loaded.path} has no paged KV cache; enginesmith serve runs every request through one "
                        "continuous batcher over KV pages",
                        "build the engine with `enginesmith build --kv paged` (CPU) or `enginesmith build --for-cuda "
                        "--kv paged` (GPU), or give --model to build one") from None
    max_batch = args.max_batch or getattr(model, "max_batch", None) or CPU_MAX_BATCH
    chunk = args.chunk or CHUNK
    scheduler = SchedulerConfig(max_batch=max_batch, max_tokens=max(256, max_batch + chunk), chunk=chunk)
    tokenizer = loaded.tokenizer
    loop = BatcherLoop(model, scheduler, max_waiting=args.max_waiting,
                       decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    name = args.model_name or loaded.manifest.source.name or loaded.path.name
    try:
        return _serve(args, loaded, loop, name, api_key,
                      f"model {name!r}, {device}, up to {max_batch} requests a step, {model.num_pages - 1} KV pages "
                      f"of {model.page_size} tokens{', API key required' if api_key else ''}")
    finally:
        loop.close()


def _serve(args, loaded, loop, name: str, api_key: str | None, summary: str) -> int:
    from enginesmith.serving.http_server import serve  # deferred: imports uvicorn (optional)
    from enginesmith.serving.openai_api import make_app  # deferred: imports starlette (optional)

    app = make_app(loaded, loop, name, api_key)
    try:
        cut_off = serve(app, app.state.api, loop, args.host, args.port, args.drain_timeout, summary,
                        log_level=args.log_level, access_log=args.access_log)
    except SystemExit:  # uvicorn's start-up failure (it logged why, e.g. the address is in use)
        raise UserError(f"cannot serve on {args.host}:{args.port} (see the message above)",
                        "choose another --port or --host, or stop what uses it") from None
    if cut_off:
        print(f"enginesmith serve: stopped; {cut_off} cut off requests still running", file=sys.stderr)
        return 1
    return 0
