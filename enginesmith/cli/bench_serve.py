"""`enginesmith bench serve`: load on a running server over HTTP (measure/http_load.py).

Any OpenAI-compatible server (POST /v1/completions, streamed) or Triton's HTTP generate endpoint
(POST /v2/models/<model>/generate_stream): closed loop at each --concurrency, or Poisson arrivals at
--rate with at most that many in flight; output tok/s, req/s, TTFT, ITL and TPOT p50/p99, errors.

The prompts are the workload of `bench --requests` (measure/throughput.workload: paragraphs of --text
FILE, else of the Austen corpus, else synthetic with a notice), made with a tokenizer and sent as text: --tokenizer (an engine directory or a model spec), else the served
model's name when it is a local path, else the embedded default model's (SmolLM2).
--procs K splits each run's streams over K client processes (measure/load_procs.py): one Python
process reads ~25-40k server-sent events/s, less than a fast server sends at high concurrency.
Exit status: 0; 1 when any request failed (the report is printed all the same); 2 bad input or a
server that cannot be used (unreachable, refuses the key, lists no model).
"""

from __future__ import annotations

import json
import math
import sys

from enginesmith.cli.flags import check_png, int_list
from enginesmith.core.errors import UserError

APIS = ("openai", "triton")  # measure.http_load.APIS; not imported here: it imports onnxruntime (--help works without)


def add_parser(subverbs) -> None:
    p = subverbs.add_parser(
        "serve", help="load on a running server (OpenAI-compatible or Triton): tok/s, TTFT, ITL per concurrency",
        description=__doc__.split("\n\n", 1)[1].rsplit("\n\n", 1)[0],
        epilog="Example: enginesmith bench serve --url http://127.0.0.1:8000 --concurrency 1,16,64 --requests 256 "
               "--png serve.png")
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 "
                                                "is dropped for --api openai)")
    p.add_argument("--api", choices=APIS, default="openai",
                   help="openai: POST /v1/completions (default); triton: POST /v2/models/MODEL/generate_stream")
    p.add_argument("--model", metavar="NAME", default=None,
                   help="model name to ask for (default: the first of GET /v1/models, or Triton's first ready model)")
    p.add_argument("--concurrency", default="1,8,32,64", metavar="C[,C...]",
                   help="requests in flight, one run each (default 1,8,32,64)")
    p.add_argument("--requests", type=int, required=True, metavar="N", help="requests per run")
    p.add_argument("--rate", type=float, default=None, metavar="R",
                   help="open loop: Poisson arrivals at R requests/s, at most --concurrency in flight (default: "
                        "closed loop, each client sends its next request when its last one has ended)")
    p.add_argument("--prompt-tokens", type=int, default=None, metavar="P",
                   help="prompt length (default: drawn from the prompts' text, as `bench --requests`)")
    p.add_argument("--new-tokens", type=int, default=None, metavar="T",
                   help="max_tokens of every request (default: drawn from the prompts' text)")
    p.add_argument("--text", default=None, metavar="FILE",
                   help="draw the prompts from this UTF-8 text file's paragraphs (default: the Austen corpus; "
                        "synthetic prompts, with a notice, when it is not installed)")
    p.add_argument("--tokenizer", default=None, metavar="ENGINE_DIR|MODEL",
                   help="tokenizer of the prompts: an engine directory or a model (HF dir, GGUF, tiny:<family>); "
                        "default: the served model's name if it is a local path, else SmolLM2's")
    p.add_argument("--api-key", default=None, metavar="KEY", help="sent as `Authorization: Bearer KEY`")
    p.add_argument("--ignore-eos", action="store_true",
                   help="openai: send \"ignore_eos\": true (a vLLM-style extension; every request then runs to its "
                        "max_tokens); only for servers that accept it")
    p.add_argument("--extra-body", default=None, metavar="JSON",
                   help="a JSON object merged into every request body, e.g. '{\"raw\": true}' for enginesmith's "
                        "Triton model (no chat template); a key set to null is left out of the body")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="seconds for one request, its whole stream included (default 300)")
    p.add_argument("--procs", default="1", metavar="K|auto",
                   help="client processes that share each run's streams (default 1); auto: one per 32 streams, "
                        "at most the CPUs. One Python process reads ~25-40k SSE events/s: give more for a server "
                        "that streams faster (measure/load_procs.py)")
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--png", default=None, metavar="FILE",
                   help="write output tok/s against p50 ITL and p50 TTFT, one point per concurrency (needs matplotlib)")
    p.set_defaults(func=cmd_bench_serve)


def _extra_body(text: str | None) -> dict:
    fix = "give a JSON object, e.g. --extra-body '{\"raw\": true}'"
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UserError(f"--extra-body is not JSON ({exc})", fix) from None
    if not isinstance(value, dict):
        raise UserError(f"--extra-body is a JSON {type(value).__name__}, not an object", fix)
    return value


def _procs(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise UserError(f"--procs {text!r} is not a positive number or auto", "give --procs 2, say, or --procs auto")
    return int(text)


def _check(args) -> tuple[list[int], dict, int | str]:
    """The concurrencies, the extra body and --procs; every flag checked before the server is asked anything."""
    concurrencies = int_list(args.concurrency, "--concurrency")
    for flag, value in (("--requests", args.requests), ("--prompt-tokens", args.prompt_tokens),
                        ("--new-tokens", args.new_tokens)):
        if value is not None and value < 1:
            raise UserError(f"{flag} {value} is not a positive number", f"give {flag} >= 1")
    for flag, value in (("--rate", args.rate), ("--timeout", args.timeout)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UserError(f"{flag} {value} is not a positive number", f"give {flag} > 0")
    if args.ignore_eos and args.api != "openai":
        raise UserError("--ignore-eos is an OpenAI-server extension",
                        "leave it out for --api triton, or put the model's own input in --extra-body")
    if args.png:
        check_png(args.png)
    return concurrencies, _extra_body(args.extra_body), _procs(args.procs)


def cmd_bench_serve(args) -> int:
    from enginesmith.measure import http_load, load_procs, throughput  # deferred: imports onnxruntime (optional)

    concurrencies, extra, procs = _check(args)
    http_load.check_rate(args.rate, args.timeout)
    url = http_load.base_url(args.url, args.api)
    model = http_load.served_model(url, args.api, args.model, args.api_key)
    tokenizer, described = http_load.load_tokenizer(args.tokenizer, model)
    source, books, text = throughput.workload_source(tokenizer, len(tokenizer), args.text)
    if text == throughput.SYNTHETIC:
        print(throughput.NO_CORPUS_NOTICE, file=sys.stderr)
    requests = throughput.workload(source, args.requests, args.seed, args.prompt_tokens, args.new_tokens, books=books)
    prompts = http_load.prompts_from(requests, tokenizer)
    print(f"[bench serve] {model} at {url} ({args.api}); prompts made with the tokenizer of {described}",
          file=sys.stderr)
    target = http_load.Target(url, args.api, model, args.api_key, args.ignore_eos, extra)
    runs = load_procs.sweep(target, prompts, concurrencies, args.rate, procs=procs, seed=args.seed,
                            timeout=args.timeout, tokenizer=tokenizer, progress=True)
    result = {"url": url, "api": args.api, "model": model, "tokenizer": described, "rate": args.rate, "procs": procs,
              "timeout_s": args.timeout, "ignore_eos": args.ignore_eos, "extra_body": extra,
              "workload": throughput.describe_workload(requests, args.seed, args.prompt_tokens, args.new_tokens, text),
              "runs": runs}
    print(json.dumps(result) if args.json else http_load.format_load(result))
    if args.png:
        print(f"wrote {http_load.plot_load(result, args.png)}", file=sys.stderr)
    failed = sum(r["errors"]["total"] for r in runs)
    if failed:
        kinds: dict[str, int] = {}
        for r in runs:
            for kind, n in r["errors"]["by_kind"].items():
                kinds[kind] = kinds.get(kind, 0) + n
        print(f"warning: {failed} of {sum(r['requests'] for r in runs)} requests failed "
              f"({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}); the figures count only the others",
              file=sys.stderr)
    return 1 if failed else 0
