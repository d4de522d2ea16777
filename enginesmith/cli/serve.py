"""`enginesmith serve`: an OpenAI-compatible HTTP server over one paged engine (serving/openai_api.py).

    enginesmith serve --engine DIR | --model SPEC [--device auto|cpu|cuda] [--host 127.0.0.1] [--port 8000]
                      [--max-batch N] [--num-pages K] [--max-waiting N] [--api-key KEY] [--model-name NAME]
                      [--devices 0,1 | --replicas N] [--door-workers N] [--engine-core auto|thread|process]
                      [--front-ends N]

    open the engine (runtime.load) ─▶ its PagedModel ─▶ one BatcherLoop (serving/loop.py) ─▶ the ASGI app
    ─▶ uvicorn; one line on stdout once it listens: "enginesmith serve: http://HOST:PORT ..."

With --engine-core process (the default on a GPU: --engine-core auto) the BatcherLoop runs in a
child process that does nothing else (serving/engine_core.py); this process keeps HTTP, chat
templates, tokenization, detokenization and stop strings, and talks to it through
serving/core_client.py. A core that dies stops the server
with one line and exit status 1; the core exits (its requests' pages freed) when this process dies.
With --front-ends N, N processes do that front-end work on one port, over the one core
(serving/front_ends.py): this one, which started the core and supervises, and N - 1 it spawns.

With --devices 0,1 (or --replicas N on one device) this process is a front door instead
(serving/front_door.py): it starts one such server per GPU as a child process (serving/replicas.py;
127.0.0.1, a free port, an internal API key), then routes each request to the replica with the
fewest in flight and passes its answer through. A replica that dies stops the whole server with
exit status 1 (an orchestrator restarts it); SIGTERM drains every replica, then exits 0.

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
import secrets
import sys
from pathlib import Path

from enginesmith.builder.engine import BuildConfig, cached_engine
from enginesmith.cli import bounds
from enginesmith.serving.engine_core import PLACEMENTS, core_placement
from enginesmith.cli.flags import add_model_flags, load_engine
from enginesmith.core.errors import UserError
from enginesmith.serving.replicas import FRONT_DOOR_PID_ENV, ReplicaSet, ReplicaSpec, cuda_visible, watch_front_door

API_KEY_ENV = "ENGINESMITH_API_KEY"
CPU_MAX_BATCH = 16   # rows per step on the CPU (a --for-cuda engine: its --max-batch)
CHUNK = 64           # prompt tokens per row per step (capped by what the engine's attention takes)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
MAX_TIMEOUT_S = 86400.0
MAX_CONNECTIONS = 1 << 20
MAX_BODY_BYTES = 4 << 20  # serving.openai_api.MAX_BODY_BYTES (not imported: it needs starlette; --help works without)
SPARE_FILES = 128         # open files a server process needs besides its connections (engine, logs, pipes)
MAX_FRONT_ENDS = 32       # serving.front_ends.MAX_FRONT_ENDS (not imported: it needs uvicorn; --help works without)


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
    g.add_argument("--api-key", default=None, metavar="KEY", type=bounds.secret,
                   help=f"require `Authorization: Bearer KEY` on /v1/* (default: ${API_KEY_ENV}, which keeps the key "
                        "out of the process list; none: open)")
    g.add_argument("--max-waiting", type=int, default=256, metavar="N",
                   help="requests queued beyond the running batch; more get 429 with Retry-After (default 256)")
    g.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM/Ctrl-C, seconds the requests in flight may take to finish (default 30)")
    h = p.add_argument_group("limits (idle and slow clients cannot lock the server out)")
    h.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="seconds a client may take to send a request's head, from its connection or its first byte "
                        "(nginx's client_header_timeout; default 10); then the connection is closed")
    h.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a client may take to send a request's whole body, e.g. a chunked body that never "
                        "ends or one shorter than its Content-Length (default 30)")
    h.add_argument("--keepalive-timeout", type=float, default=5.0, metavar="S",
                   help="seconds an idle keep-alive connection stays open (default 5)")
    h.add_argument("--max-connections", type=int, default=1000, metavar="N",
                   help="open connections per server process (default 1000); beyond it the oldest connection with "
                        "no request in progress is closed, or, if all have one, the newcomer gets 503 with "
                        "Retry-After (uvicorn's --limit-concurrency)")
    h.add_argument("--max-prompt-bytes", type=int, default=None, metavar="B",
                   help="bytes of prompt text (all chat messages together) a request may send, checked before "
                        "tokenization (default: 16 per position of the engine, at least 32 KiB); the body itself "
                        "is at most 4 MiB")
    g.add_argument("--front-ends", type=int, default=1, metavar="N",
                   help="processes that do the HTTP, SSE, chat template, tokenizer and detokenizer work, on one port, "
                        f"over one engine core process (default 1; at most {MAX_FRONT_ENDS}: each is a Python process "
                        "with its own tokenizer, ~150 MB, and the core sends every one a frame per step). For many "
                        "streams on a fast GPU, where one front end caps the tokens/s. N > 1 puts the engine core in "
                        "a process (--engine-core auto) and is refused with --engine-core thread; several replicas "
                        "have --door-workers instead")
    g.add_argument("--log-level", default="warning", choices=LOG_LEVELS, help="uvicorn's log level (default warning)")
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")
    r = p.add_argument_group("replicas (one engine process each, behind this one front door)")
    r.add_argument("--devices", default=None, metavar="LIST",
                   help="GPU ids for one engine replica each, e.g. 0,1 (needs --device cuda); requests go to the "
                        "replica with the fewest in flight")
    r.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="N engine replicas on the one device (default 1; for tests and CPU hosts; GPUs: --devices)")
    r.add_argument("--door-workers", type=int, default=None, metavar="N",
                   help="processes of the front door that accept requests and relay the answers, on one port "
                        "(default: 2 per replica, at most the CPU count)")
    r.add_argument("--start-timeout", type=float, default=600.0, metavar="S",
                   help="seconds the replicas (or the engine core process) may take to load their engines "
                        "(default 600)")
    s = p.add_argument_group("scheduler")
    s.add_argument("--max-batch", type=int, default=None, metavar="N",
                   help=f"rows per scheduler step (default {CPU_MAX_BATCH} on the CPU; a --for-cuda engine: its "
                        "build's --max-batch, which is also the most it takes)")
    s.add_argument("--num-pages", type=int, default=None, metavar="K",
                   help="KV pages in the pool (default: what 1 GiB holds on the CPU; --gpu-memory-utilization of "
                        "the GPU for a --for-cuda engine)")
    s.add_argument("--engine-core", choices=PLACEMENTS, default="auto",
                   help="where the scheduler and the engine steps run: thread, a thread of the server process; "
                        "process, a child process that does nothing else, so HTTP, tokenization and "
                        "detokenization do not share its GIL; auto (default): process on a GPU, thread on the "
                        "CPU, as measured (docs/results.md, Session 16: on an H200 the process kept 0.87 of the "
                        "offline tok/s at 64 streams, the thread 0.55; on a 2-core CPU the thread was faster)")
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
    for flag in ("--header-timeout", "--body-timeout", "--keepalive-timeout"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if not 0 < value <= MAX_TIMEOUT_S:
            raise UserError(f"{flag} {value} is out of range", f"give {flag} in (0, {MAX_TIMEOUT_S:g}] seconds")
    if not 1 <= args.max_connections <= MAX_CONNECTIONS:
        raise UserError(f"--max-connections {args.max_connections} is out of range",
                        f"give --max-connections in [1, {MAX_CONNECTIONS}]")
    if args.max_prompt_bytes is not None and not 1 <= args.max_prompt_bytes <= MAX_BODY_BYTES:
        raise UserError(f"--max-prompt-bytes {args.max_prompt_bytes} is out of range",
                        f"give --max-prompt-bytes in [1, {MAX_BODY_BYTES}] (a request body is at most that)")
    if not args.drain_timeout >= 0:
        raise UserError(f"--drain-timeout {args.drain_timeout} is negative", "give --drain-timeout >= 0 seconds")
    if args.replicas < 1:
        raise UserError(f"--replicas {args.replicas} is too small", "give --replicas >= 1")
    if args.devices is not None and args.replicas != 1:
        raise UserError("--devices and --replicas were both given", "give --devices 0,1 (one replica per GPU) or "
                        "--replicas N (N on one device), not both")
    if args.door_workers is not None and args.door_workers < 1:
        raise UserError(f"--door-workers {args.door_workers} is too small", "give --door-workers >= 1")
    if args.door_workers is not None and args.devices is None and args.replicas == 1:
        raise UserError("--door-workers sizes the front door of several replicas; one server has none",
                        "add --devices 0,1 or --replicas N, or leave out --door-workers")
    if not 1 <= args.front_ends <= MAX_FRONT_ENDS:
        raise UserError(f"--front-ends {args.front_ends} is out of range", f"give --front-ends in [1, {MAX_FRONT_ENDS}]")
    if args.front_ends > 1 and (args.devices is not None or args.replicas > 1):
        raise UserError("--front-ends sizes one server's front ends; with --devices or --replicas the front door has "
                        "--door-workers", "give --door-workers N instead of --front-ends")
    if args.front_ends > 1 and args.engine_core == "thread":
        raise UserError("--front-ends shares one engine core process between front-end processes; --engine-core "
                        "thread runs the engine inside the one server process", "leave out --engine-core thread "
                        "(auto or process), or --front-ends")
    if not args.start_timeout > 0:
        raise UserError(f"--start-timeout {args.start_timeout} is not positive", "give --start-timeout > 0 seconds")
    missing = [name for name in ("starlette", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"enginesmith serve needs {' and '.join(missing)}, which this Python does not have",
                        "pip install 'enginesmith[serve]' (or: pip install starlette uvicorn)")


def _connection_limits(args, files_per_connection: int = 1):
    """The ConnectionLimits of the flags, with the open-files limit raised (to its hard limit at most) to hold
    --max-connections; a UserError when it cannot be."""
    import resource  # deferred: POSIX only, and only to size the open-files limit

    from enginesmith.serving.conn_guard import ConnectionLimits  # deferred: imports uvicorn (optional)

    need = args.max_connections * files_per_connection + SPARE_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise UserError(f"--max-connections {args.max_connections} needs about {need} open files; this process "
                            f"may open at most {hard} (ulimit -Hn)",
                            f"give --max-connections {max(1, (hard - SPARE_FILES) // files_per_connection)} or less, "
                            "or raise the limit (ulimit -n)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return ConnectionLimits(args.header_timeout, args.body_timeout, args.keepalive_timeout, args.max_connections)


def _check_devices(args, device: str) -> list[int] | None:
    """The GPU ids of --devices (distinct, non-negative, below the GPU count torch sees), or None."""
    if args.devices is None:
        return None
    if device != "cuda":
        raise UserError(f"--devices {args.devices} places engine replicas on GPUs; the device here is {device}",
                        "add --device cuda on a machine with GPUs, or leave out --devices")
    fix = "give distinct GPU ids, e.g. --devices 0,1"
    parts = [part.strip() for part in args.devices.split(",")]
    bad = [part for part in parts if not part.isdigit()]
    if bad:
        raise UserError(f"--devices {args.devices}: {bad[0]!r} is not a GPU id (a non-negative integer)", fix)
    ids = [int(part) for part in parts]
    if len(set(ids)) != len(ids):
        raise UserError(f"--devices {args.devices} names a GPU twice", fix)
    count = _gpu_count()
    if count and max(ids) >= count:
        raise UserError(f"--devices {args.devices} names GPU {max(ids)}, but torch sees {count} GPU(s)",
                        f"give ids from 0 to {count - 1}")
    return ids


def _gpu_count() -> int:
    """The GPUs torch sees (0 without torch or without GPUs: then --devices is not checked against it)."""
    if importlib.util.find_spec("torch") is None:
        return 0
    import torch  # deferred: heavy; only to check --devices

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cmd_serve(args) -> int:
    from enginesmith.runtime.engines.ort_engine import resolve_device  # deferred: onnxruntime (--help works without)
    from enginesmith.serving.loop import BatcherLoop, serving_model  # deferred: with the runtime above

    _check_flags(args)
    device = resolve_device(args.device)
    devices = _check_devices(args, device)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    config = None
    if not args.engine:  # --model (or the default model): a paged engine for this device, built once and cached
        cuda = {"target": "ort-cuda", "dtype": "fp16"} if device == "cuda" else {}
        config = BuildConfig(model=args.model, kv_layout="paged", **cuda)
    if devices is not None or args.replicas > 1:
        return _serve_replicas(args, device, devices, config, api_key)
    watch_front_door()  # a replica of a front door: drain once that is gone
    if core_placement(args.engine_core, device) == "process" or args.front_ends > 1:
        return _serve_core_process(args, device, config, api_key)
    args.batch = args.max_batch  # a --for-cuda paged engine opens with this many rows (default: its build's)
    loaded = load_engine(args, config)
    model, scheduler = serving_model(loaded, args.num_pages, args.max_batch, CPU_MAX_BATCH, args.chunk or CHUNK)
    max_batch = scheduler.max_batch
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


def _serve_core_process(args, device: str, config: BuildConfig | None, api_key: str | None) -> int:
    """serve over an engine core child process (serving/core_client.py): the engine opens there; this
    process reads only the engine's manifest and tokenizer."""
    from enginesmith.serving.core_client import CoreClient  # deferred: imports the runtime
    from enginesmith.serving.engine_core import CoreSpec  # deferred: with the client above
    from enginesmith.serving.front_ends import tokenizer_side  # deferred: imports uvicorn (optional)

    if args.engine and args.model:
        raise UserError("--engine and --model were both given", "pass only one of them")
    path = Path(args.engine).resolve() if args.engine else cached_engine(config)
    spec = CoreSpec(str(path), device, args.threads, args.max_batch, args.num_pages, args.chunk or CHUNK,
                    args.gpu_memory_utilization, CPU_MAX_BATCH)
    # the core verifies the engine's files
    loop = CoreClient.start(spec, args.max_waiting, args.start_timeout, front_ends=args.front_ends)
    try:
        loaded = tokenizer_side(path)
        info = loop.info
        name = args.model_name or loaded.manifest.source.name or loaded.path.name
        print(f"enginesmith serve: engine core pid {loop.pid}", file=sys.stderr, flush=True)
        fronts = f", {args.front_ends} front-end processes" if args.front_ends > 1 else ""
        return _serve(args, loaded, loop, name, api_key,
                      f"model {name!r}, {device}, engine core process (pid {loop.pid}){fronts}, up to "
                      f"{info.max_batch} requests a step, {info.num_pages - 1} KV pages of {info.page_size} tokens"
                      f"{', API key required' if api_key else ''}")
    finally:
        loop.close()


def _serve(args, loaded, loop, name: str, api_key: str | None, summary: str) -> int:
    from enginesmith.serving.http_server import serve  # deferred: imports uvicorn (optional)
    from enginesmith.serving.openai_api import make_app  # deferred: imports starlette (optional)

    fronts = args.front_ends
    app = make_app(loaded, loop, name, api_key, max_prompt_bytes=args.max_prompt_bytes,
                   front_end=0 if fronts > 1 else None)
    limits = _connection_limits(args)
    failed: list[str] = []
    try:
        if fronts > 1:
            cut_off, failed = _serve_front_ends(args, app, loop, name, api_key, summary, limits)
        else:
            cut_off = serve(app, app.state.api, loop, args.host, args.port, args.drain_timeout, summary,
                            log_level=args.log_level, access_log=args.access_log, limits=limits)
    except SystemExit:  # uvicorn's start-up failure (it logged why, e.g. the address is in use)
        raise UserError(f"cannot serve on {args.host}:{args.port} (see the message above)",
                        "choose another --port or --host, or stop what uses it") from None
    failure = getattr(loop, "failure", None)
    if failure:
        print(f"enginesmith serve: stopped: {failure}; its requests ended with an error", file=sys.stderr)
        return 1
    for line in failed:
        print(f"enginesmith serve: {line}", file=sys.stderr)
    if cut_off:
        print(f"enginesmith serve: stopped; {cut_off} cut off requests still running", file=sys.stderr)
    return 1 if cut_off or failed else 0


def _serve_front_ends(args, app, loop, name: str, api_key: str | None, summary: str, limits):
    """_serve's server with --front-ends N > 1 (serving/front_ends.py): (cut off, other failures)."""
    from enginesmith.serving.front_ends import FrontEndSpec, serve_front_ends  # deferred: imports uvicorn

    spec = FrontEndSpec(str(app.state.api.loaded.path), name, api_key, args.max_prompt_bytes, args.max_waiting,
                        args.front_ends, args.drain_timeout, args.log_level, args.access_log, limits)
    return serve_front_ends(app, loop, spec, args.host, args.port, summary)


def _serve_replicas(args, device: str, devices: list[int] | None, config: BuildConfig | None,
                    api_key: str | None) -> int:
    """The front door over one `enginesmith serve` child per GPU (or --replicas on one device); the
    engine is built here once (--model), then each child opens it with the same scheduler flags."""
    from enginesmith.serving.front_door import serve_front_door  # deferred: imports uvicorn

    if args.engine and args.model:
        raise UserError("--engine and --model were both given", "pass only one of them")
    engine = Path(args.engine).resolve() if args.engine else cached_engine(config)
    internal_key = secrets.token_urlsafe(32)  # only the front door reaches the replicas; never on a command line
    base = {**os.environ, API_KEY_ENV: internal_key, FRONT_DOOR_PID_ENV: str(os.getpid())}
    # each front-door worker holds a client's connection and one to a replica per request
    limits = _connection_limits(args, files_per_connection=2)
    count = len(devices) if devices is not None else args.replicas
    workers = args.door_workers or max(1, min(2 * count, os.cpu_count() or 1))
    argv = _replica_argv(args, engine, device, replica_connections=workers * args.max_connections + 64)
    if devices is not None:
        specs = [ReplicaSpec(f"GPU {d}", argv, {**base, "CUDA_VISIBLE_DEVICES": visible})
                 for d, visible in zip(devices, cuda_visible(devices))]
    else:
        specs = [ReplicaSpec(f"{device} #{i}", argv, base) for i in range(args.replicas)]
    replicas = ReplicaSet.start(specs, args.start_timeout)
    try:
        for r in replicas:
            print(f"enginesmith serve: replica {r.index} ({r.label}, pid {r.pid}) at {r.url}", file=sys.stderr,
                  flush=True)
        summary = (f"{len(replicas)} engine replicas ({', '.join(r.label for r in replicas)}) behind one front door "
                   f"of {workers} process{'es' if workers > 1 else ''}{', API key required' if api_key else ''}")
        try:
            failed = serve_front_door(replicas, workers, api_key, internal_key, args.host, args.port,
                                      args.drain_timeout, summary, log_level=args.log_level,
                                      access_log=args.access_log, limits=limits)
        except SystemExit:  # uvicorn's start-up failure (it logged why, e.g. the address is in use)
            raise UserError(f"cannot serve on {args.host}:{args.port} (see the message above)",
                            "choose another --port or --host, or stop what uses it") from None
    finally:
        replicas.kill()  # whatever is still running, on every way out (each stopped by its PID)
    return 1 if failed else 0


def _replica_argv(args, engine: Path, device: str, replica_connections: int) -> list[str]:
    """The child's `enginesmith serve` command line: this one's engine, scheduler and prompt flags, on
    127.0.0.1:0, with room for every connection the front door's workers may open to it."""
    argv = [sys.executable, "-m", "enginesmith.cli", "serve", "--engine", str(engine), "--device", device,
            "--host", "127.0.0.1", "--port", "0", "--max-waiting", str(args.max_waiting),
            "--max-connections", str(min(replica_connections, MAX_CONNECTIONS)),
            "--drain-timeout", repr(args.drain_timeout), "--log-level", args.log_level,
            "--engine-core", args.engine_core,
            "--gpu-memory-utilization", repr(args.gpu_memory_utilization)]
    for flag, value in (("--threads", args.threads), ("--model-name", args.model_name),
                        ("--max-batch", args.max_batch), ("--num-pages", args.num_pages), ("--chunk", args.chunk),
                        ("--max-prompt-bytes", args.max_prompt_bytes)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + (["--access-log"] if args.access_log else [])
