"""Load on a running server over HTTP (`enginesmith bench serve`): an OpenAI-compatible server's
/v1/completions, or Triton's generate_stream endpoint, both streamed as server-sent events (SSE).

Legend: N requests, C concurrency (most requests in flight), R arrival rate (requests/s),
P prompt tokens, T output tokens asked for (max_tokens).

    throughput.workload (Austen prompts and lengths) ── decoded to text ── N Prompts (text, P, T)
        │
    run_load(target, prompts, C, R)         C httpx.AsyncClients of one HTTP/1.1 keep-alive connection each
        │   closed loop (no R): C clients, each sends its next request when its last one has ended
        │   open loop: request i arrives at a Poisson time (gaps ~ Exp(mean 1/R), seeded); at most C
        │              in flight: an arrival that finds C in flight waits (reported as wait, not TTFT)
        │   per request: POST, read the SSE stream to its end ─▶ TTFT, chunk gaps, tokens, or one error
        ▼
    {output tok/s, req/s, TTFT / ITL / TPOT / latency p50 p99, errors by kind} per C ── format_load, plot_load

One process reads ~25-40k SSE events/s (one core). measure/load_procs.py (`bench serve --procs K`) deals
the same requests over K worker processes that each run `load` from one shared start, and merges their
outcomes into the same `report`.

The requests:
    openai  POST {url}/v1/completions {"model", "prompt": text, "max_tokens": T, "temperature": 0,
            "stream": true, "stream_options": {"include_usage": true}}; events `data: {json}` until
            `data: [DONE]`. "ignore_eos": true (a vLLM-style extension) only when asked for.
    triton  POST {url}/v2/models/{model}/generate_stream {"text_input": text, "max_tokens": T}
            (the inputs of serving/triton_repository.py, which are Triton's generate-extension names);
            events `data: {"text_output": ..., "token_ids": [...] on the last}` until the stream ends.
    Both: --extra-body keys are merged into every body (say {"raw": true} for our Triton model, which
    otherwise wraps the text in the chat template, or {"stream": true} for TensorRT-LLM's ensemble);
    a key given as null is left out (say {"stream_options": null} for a server that refuses it).

Timing (time.perf_counter on the client):
    TTFT     from sending the request to the first event that carries text (an empty first chunk,
             such as a role-only chunk, does not count).
    ITL      the gaps between consecutive text-carrying events, one per gap, as vLLM's benchmark
             counts them: a server that packs k tokens into one event shows fewer, longer gaps.
    TPOT     per request, (last text event - first text event) / (tokens - 1): the same time spread
             over the tokens, so packing does not hide in it.
    latency  from sending to the end of the stream; wait (open loop) from arrival to sending.
    seconds  from the first send to the last stream's end; tok/s = output tokens of the requests
             that succeeded / seconds, req/s = succeeded requests / seconds.
    in flight  the most requests open at once, from each request's [sent, ended] (every process's).

Output tokens of a request, the first source that is there (`tokens_counted_by` says which):
    usage      the server's usage.completion_tokens (OpenAI: asked for with stream_options);
    token_ids  the length of Triton's token_ids output (our model sends it on the last response);
    tokenizer  the benchmark's tokenizer over the concatenated text (a server's detokenizer may
               merge or split a few tokens at the edges, so this can be off by one or two);
    chunks     the number of text-carrying events (one token per event, the common case).

Errors never stop a run; each failed request counts once under one kind, and the first message
of each kind is kept: http_<status> (the answer was not 200), timeout (no complete answer within
the timeout), connect (no connection), transport (the connection broke mid-stream), stream (an
error event or data that is not JSON), incomplete (an OpenAI stream that ended without [DONE]).
A failed request's tokens do not count in tok/s.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, Mapping, Sequence

import httpx
import numpy as np
from tqdm import tqdm

from enginesmith.core import engine_dir, progress
from enginesmith.core.errors import UserError
from enginesmith.measure.throughput import BenchRequest, percentiles, require_matplotlib
from enginesmith.models import load as model_load
from enginesmith.models.corpus import tokenize
from enginesmith.runtime.text.tokenizer import Tokenizer

APIS = ("openai", "triton")
DEFAULT_TIMEOUT = 300.0       # seconds for one request, stream included
WARMUP_TOKENS = 4             # warm-up requests ask for this many tokens
PROBE_TIMEOUT = 10.0          # seconds for the start-up checks (model list, health)
ERROR_TEXT = 300              # characters kept of an error body
MAX_LINE = 1 << 20            # bytes of one SSE line: a server that streams an endless line is an error, not RAM


@dataclass(frozen=True)
class Prompt:
    text: str
    prompt_tokens: int        # P, by the benchmark's tokenizer (the server may count a few differently)
    max_tokens: int           # T


@dataclass(frozen=True)
class Target:
    """Where and how to send: the server's base URL (no trailing /v1), its API and model name."""

    url: str
    api: str                  # "openai" | "triton"
    model: str
    api_key: str | None = None
    ignore_eos: bool = False
    extra_body: Mapping = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise UserError(f"unknown API {self.api!r}", f"use one of: {', '.join(APIS)}")

    def endpoint(self) -> str:
        if self.api == "openai":
            return f"{self.url}/v1/completions"
        return f"{self.url}/v2/models/{self.model}/generate_stream"

    def headers(self) -> dict[str, str]:
        headers = {"Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def body(self, text: str, max_tokens: int) -> dict:
        if self.api == "openai":
            body = {"model": self.model, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            if self.ignore_eos:
                body["ignore_eos"] = True
        else:
            body = {"text_input": text, "max_tokens": max_tokens}
        return {k: v for k, v in {**body, **self.extra_body}.items() if v is not None}  # null in extra: leave out


@dataclass
class Outcome:
    """One request as the client saw it (perf_counter seconds)."""

    arrival: float                     # when it was due (open loop) or sent (closed loop)
    sent: float = 0.0
    ended: float = 0.0
    chunk_times: list[float] = field(default_factory=list)   # text-carrying events
    text: list[str] = field(default_factory=list)
    usage_tokens: int | None = None    # usage.completion_tokens
    token_ids: int | None = None       # len(token_ids) of Triton's last response
    done: bool = False                 # [DONE] seen (OpenAI) or the stream ended cleanly (Triton)
    error_kind: str | None = None
    error: str | None = None

    def fail(self, kind: str, message: str) -> None:
        if self.error_kind is None:
            self.error_kind, self.error = kind, message[:ERROR_TEXT]

    def tokens(self, tokenizer=None) -> tuple[int, str]:
        """(output tokens, how they were counted): module doc, "Output tokens"."""
        if self.usage_tokens is not None:
            return self.usage_tokens, "usage"
        if self.token_ids is not None:
            return self.token_ids, "token_ids"
        if tokenizer is not None:
            return len(tokenize(tokenizer, "".join(self.text))), "tokenizer"
        return len(self.chunk_times), "chunks"


class _StreamError(Exception):
    """An error event, or data that is not what the API sends."""


# ----------------------------------------------------------------------------- one request

async def _sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The data of each server-sent event (several `data:` lines of one event joined by newlines);
    comments (`:` keep-alives) and the event/id/retry fields are not needed here."""
    data: list[str] = []
    async for line in _bounded_lines(response):
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        yield "\n".join(data)


async def _bounded_lines(response: httpx.Response, limit: int = MAX_LINE) -> AsyncIterator[str]:
    """The response's lines (ended by \\n, \\r\\n or \\r, as SSE allows), each at most `limit` bytes: a
    _StreamError for a longer one, so an endless line costs at most `limit` bytes of memory."""
    buf = bytearray()
    async for chunk in response.aiter_bytes():
        buf += chunk
        start = 0
        while True:
            ends = [k for k in (buf.find(b"\n", start), buf.find(b"\r", start)) if k >= 0]
            if not ends:
                break
            end = min(ends)
            if buf[end:end + 1] == b"\r" and end + 1 == len(buf):
                break  # a \r at the end of the chunk: its \n may come next
            step = 2 if buf[end:end + 2] == b"\r\n" else 1
            yield buf[start:end].decode("utf-8", "replace")
            start = end + step
        del buf[:start]
        if len(buf) > limit:
            raise _StreamError(f"a line of the stream is over {limit} bytes")
    if buf:
        yield buf.rstrip(b"\r").decode("utf-8", "replace")


def _read_event(api: str, data: str, out: Outcome, now: float) -> None:
    """Record one event's text, token counts and end marker on `out`."""
    if api == "openai" and data.strip() == "[DONE]":
        out.done = True
        return
    try:
        event = json.loads(data)
    except ValueError:
        raise _StreamError(f"an event that is not JSON: {data[:80]!r}") from None
    if not isinstance(event, dict):
        raise _StreamError(f"an event that is not a JSON object: {data[:80]!r}")
    if event.get("error"):
        error = event["error"]
        raise _StreamError(str(error.get("message", error) if isinstance(error, dict) else error))
    if api == "openai":  # completions: choices[0].text; chat completions: choices[0].delta.content
        choices = event.get("choices")
        first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        delta = first.get("delta")
        text = first.get("text") or (delta.get("content") if isinstance(delta, dict) else None) or ""
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            out.usage_tokens = usage["completion_tokens"]
    else:
        text = event.get("text_output") or ""
        if isinstance(event.get("token_ids"), list):
            out.token_ids = len(event["token_ids"])
    if not isinstance(text, str):
        raise _StreamError(f"an event whose text is a {type(text).__name__}")
    if text:
        out.chunk_times.append(now)
        out.text.append(text)


async def _send(client: httpx.AsyncClient, target: Target, text: str, max_tokens: int, out: Outcome) -> None:
    out.sent = time.perf_counter()
    async with client.stream("POST", target.endpoint(), json=target.body(text, max_tokens),
                             headers=target.headers()) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode("utf-8", "replace").strip()
            out.fail(f"http_{response.status_code}", f"HTTP {response.status_code}: {body}")
            return
        async for data in _sse_data(response):  # read to the end: the connection is then kept alive
            _read_event(target.api, data, out, time.perf_counter())
    if target.api == "triton":
        out.done = True  # a decoupled model's stream ends after its last response
    if not out.done:
        out.fail("incomplete", "the stream ended without data: [DONE]")


async def request(client: httpx.AsyncClient, target: Target, text: str, max_tokens: int, timeout: float,
                  arrival: float | None = None) -> Outcome:
    """Send one request and read its stream; never raises for what the server or network does."""
    out = Outcome(arrival=time.perf_counter() if arrival is None else arrival)
    try:
        await asyncio.wait_for(_send(client, target, text, max_tokens, out), timeout)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        out.fail("timeout", f"no complete answer within {timeout:g} s")
    except httpx.ConnectError as exc:
        out.fail("connect", f"cannot connect to {target.url}: {exc}")
    except httpx.HTTPError as exc:  # the connection broke, a bad chunked encoding, ...
        out.fail("transport", f"{type(exc).__name__}: {exc}")
    except _StreamError as exc:
        out.fail("stream", str(exc))
    out.ended = time.perf_counter()
    return out


# ----------------------------------------------------------------------------- one run

def arrival_times(n: int, rate: float, seed: int = 0) -> np.ndarray:
    """[N] seconds after the start at which the open loop's requests arrive: a Poisson process of
    `rate` per second (gaps ~ Exponential, mean 1/rate), seeded, the first request at 0."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.cumsum(gaps) - gaps[0]


async def _drive(clients: asyncio.Queue, target: Target, prompts: Sequence[Prompt], concurrency: int,
                 due: np.ndarray | None, start: float, timeout: float,
                 on_done: Callable[[], object] | None = None) -> list[Outcome]:
    """Every prompt sent once, at most `concurrency` in flight; the outcomes in prompt order. `due`:
    seconds after `start` at which each prompt arrives (open loop), or None (closed loop)."""
    outcomes: list[Outcome | None] = [None] * len(prompts)

    async def one(i: int, arrival: float) -> None:
        p = prompts[i]
        client = clients.get_nowait()  # never empty: at most `concurrency` requests are in flight
        try:
            outcomes[i] = await request(client, target, p.text, p.max_tokens, timeout, arrival)
        finally:
            clients.put_nowait(client)
        if on_done is not None:
            on_done()

    if due is None:  # closed loop: C clients share one queue
        queue = iter(range(len(prompts)))

        async def client_loop() -> None:
            for i in queue:
                await one(i, time.perf_counter())

        await asyncio.gather(*(client_loop() for _ in range(min(concurrency, len(prompts)))))
    else:
        slots = asyncio.Semaphore(concurrency)

        async def arrive(i: int) -> None:
            await asyncio.sleep(max(0.0, start + due[i] - time.perf_counter()))
            arrival = time.perf_counter()
            async with slots:
                await one(i, arrival)

        await asyncio.gather(*(arrive(i) for i in range(len(prompts))))
    return outcomes  # type: ignore[return-value]


def _client(timeout: float) -> httpx.AsyncClient:
    """One HTTP/1.1 keep-alive connection; no pool wait limit (the run's own bound keeps requests
    from queueing for it). A client per request in flight, not one pool of C connections: httpx's
    pool scans all its connections on every read (O(C) per SSE event: at C = 64 that was most of the
    load generator's time)."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout, pool=None))


def check_rate(rate: float | None, timeout: float = DEFAULT_TIMEOUT) -> None:
    """A UserError for a rate that is not positive, or so low that the mean gap between arrivals (1/R)
    exceeds one request's timeout: such a run would send next to nothing for minutes or years."""
    if rate is None:
        return
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise UserError(f"invalid rate={rate!r}", "give a rate > 0 requests/s")
    if 1.0 / rate > timeout:
        raise UserError(f"--rate {rate:g} sends one request every {1.0 / rate:.3g} s on average, longer than the "
                        f"{timeout:g} s a request may take", f"give --rate >= {1.0 / timeout:.3g} (1/--timeout), "
                        "or leave --rate out for a closed loop")


def check_run(prompts: Sequence[Prompt], concurrency: int, rate: float | None,
              timeout: float = DEFAULT_TIMEOUT) -> None:
    """A UserError for a run that cannot be: no prompts, C < 1, R <= 0 or below 1/timeout."""
    if not isinstance(concurrency, int) or concurrency < 1:
        raise UserError(f"invalid concurrency={concurrency!r}", "give a concurrency >= 1")
    check_rate(rate, timeout)
    if not prompts:
        raise UserError("no requests to send", "give at least one request")


async def load(target: Target, prompts: Sequence[Prompt], concurrency: int, due: np.ndarray | None = None, *,
               timeout: float = DEFAULT_TIMEOUT, warmup: int, on_done: Callable[[], object] | None = None,
               start_at: Callable[[], float] = time.perf_counter) -> tuple[list[Outcome], list[Outcome], float]:
    """One process's load: `warmup` requests of WARMUP_TOKENS tokens sent at once on fresh clients,
    then `start_at()` names the start (perf_counter seconds, now or soon: waited for), then `_drive`.
    (warm-up outcomes, outcomes in prompt order, start)."""
    async with contextlib.AsyncExitStack() as stack:
        pool = [await stack.enter_async_context(_client(timeout)) for _ in range(max(concurrency, warmup))]
        warm = await asyncio.gather(*(request(pool[k], target, p.text, min(p.max_tokens, WARMUP_TOKENS), timeout)
                                      for k, p in enumerate(prompts[:warmup])))
        clients: asyncio.Queue = asyncio.Queue()
        for client in pool[:concurrency]:
            clients.put_nowait(client)
        start = start_at()
        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        outcomes = await _drive(clients, target, prompts, concurrency, due, start, timeout, on_done)
    return list(warm), outcomes, start


async def run_load(target: Target, prompts: Sequence[Prompt], concurrency: int, rate: float | None = None, *,
                   seed: int = 0, timeout: float = DEFAULT_TIMEOUT, tokenizer=None, warmup: int | None = None,
                   progress: bool = False) -> dict:
    """Send `prompts` with at most `concurrency` in flight, closed loop or (with `rate`) Poisson
    arrivals, after `warmup` untimed requests of WARMUP_TOKENS tokens sent at once (default:
    min(C, N)); the module doc's figures as a JSON-able dict. In this process: measure/load_procs.py
    splits the same run over several."""
    check_run(prompts, concurrency, rate, timeout)
    warmup = min(concurrency, len(prompts)) if warmup is None else warmup
    due = None if rate is None else arrival_times(len(prompts), rate, seed)
    bar = progress_bar(len(prompts), concurrency, progress)
    warm, outcomes, start = await load(target, prompts, concurrency, due, timeout=timeout, warmup=warmup,
                                       on_done=bar.update)
    bar.close()
    return report(concurrency, rate, prompts, warm, outcomes, start, tokenizer)


def progress_bar(total: int, concurrency: int, enabled: bool) -> tqdm:
    return progress.bar(total=total, desc=f"concurrency {concurrency}", unit="req", leave=False, disable=not enabled)


def report(concurrency: int, rate: float | None, prompts: Sequence[Prompt], warm: Sequence[Outcome],
           outcomes: Sequence[Outcome], start: float, tokenizer=None, procs: int = 1) -> dict:
    """One run's JSON-able figures: its settings, the warm-up, and `summarize` over the outcomes
    (in prompt order), timed from `start` to the last stream's end."""
    seconds = max(o.ended for o in outcomes) - start
    return {"concurrency": concurrency, "rate": rate, "procs": procs, "warmup_requests": len(warm),
            "warmup_errors": sum(o.error_kind is not None for o in warm),
            **summarize(outcomes, prompts, seconds, tokenizer)}


def max_in_flight(outcomes: Sequence[Outcome]) -> int:
    """The most requests open at once, from each request's [sent, ended] (an end before a start at
    the same instant: a closed loop's client reuses its slot)."""
    edges = sorted([(o.sent, 1) for o in outcomes] + [(o.ended, -1) for o in outcomes])
    return max(itertools.accumulate(step for _, step in edges), default=0)


def summarize(outcomes: Sequence[Outcome], prompts: Sequence[Prompt], seconds: float, tokenizer=None) -> dict:
    """Counts, rates and p50/p99 figures (milliseconds) of one run's outcomes."""
    ok = [(o, p) for o, p in zip(outcomes, prompts) if o.error_kind is None]
    counted = [o.tokens(tokenizer) for o, _ in ok]
    tokens = sum(n for n, _ in counted)
    by: dict[str, int] = {}
    for _, how in counted:
        by[how] = by.get(how, 0) + 1
    kinds: dict[str, int] = {}
    examples: dict[str, str] = {}
    for o in outcomes:
        if o.error_kind is not None:
            kinds[o.error_kind] = kinds.get(o.error_kind, 0) + 1
            examples.setdefault(o.error_kind, o.error or "")
    ttft = [o.chunk_times[0] - o.sent for o, _ in ok if o.chunk_times]
    itl = [b - a for o, _ in ok for a, b in zip(o.chunk_times, o.chunk_times[1:])]
    tpot = [(o.chunk_times[-1] - o.chunk_times[0]) / (n - 1) for (o, _), (n, _) in zip(ok, counted)
            if o.chunk_times and n > 1]
    arrivals = sorted(o.arrival for o in outcomes)
    return {
        "requests": len(outcomes), "completed": len(ok), "max_in_flight": max_in_flight(outcomes),
        "errors": {"total": len(outcomes) - len(ok), "by_kind": kinds, "examples": examples},
        "seconds": seconds, "output_tokens": tokens, "prompt_tokens": sum(p.prompt_tokens for _, p in ok),
        "tok_s": tokens / seconds, "req_s": len(ok) / seconds,
        "ttft_ms": percentiles(ttft), "itl_ms": percentiles(itl), "tpot_ms": percentiles(tpot),
        "latency_ms": percentiles([o.ended - o.sent for o, _ in ok]),
        "wait_ms": percentiles([o.sent - o.arrival for o in outcomes]),
        "arrival_rate": (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) if arrivals[-1] > arrivals[0] else None,
        "chunks": sum(len(o.chunk_times) for o, _ in ok), "tokens_counted_by": by,
    }


# ----------------------------------------------------------------------------- the server, the prompts

def base_url(url: str, api: str) -> str:
    """The server's root: http(s)://host:port[/prefix], without a trailing / (and, for openai,
    without the /v1 that OpenAI clients take as their base URL)."""
    if not url.startswith(("http://", "https://")):
        raise UserError(f"--url {url!r} is not an http:// or https:// URL", "e.g. --url http://127.0.0.1:8000")
    url = url.rstrip("/")
    return url[:-3] if api == "openai" and url.endswith("/v1") else url


def served_model(url: str, api: str, model: str | None = None, api_key: str | None = None,
                 timeout: float = PROBE_TIMEOUT) -> str:
    """Check that the server answers and return the model to ask for: `model`, else the first of
    GET /v1/models (openai) or the first READY model of Triton's repository index. A UserError when
    the server cannot be reached, refuses the key, or names no model."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(timeout=timeout, headers=headers) as client:
            if api == "openai":
                r = client.get(f"{url}/v1/models")
            else:
                r = client.get(f"{url}/v2/health/ready") if model else client.post(f"{url}/v2/repository/index",
                                                                                   json={"ready": True})
    except httpx.HTTPError as exc:
        raise UserError(f"cannot reach {url}: {type(exc).__name__}: {exc}",
                        "start the server, or check --url (host, port, http/https)") from None
    if r.status_code in (401, 403):
        raise UserError(f"{url} refused the request (HTTP {r.status_code})",
                        "give the server's key with --api-key" if not api_key else "check --api-key")
    if model:
        return model
    where = f"{url}/v1/models" if api == "openai" else f"{url}/v2/repository/index"
    try:
        listed = r.json() if r.status_code == 200 else None
    except (ValueError, RecursionError):  # not JSON, or absurdly nested
        listed = None
    if api == "openai":
        items = listed.get("data") if isinstance(listed, dict) else None
        names = [m["id"] for m in items if isinstance(m, dict) and isinstance(m.get("id"), str)] \
            if isinstance(items, list) else []
    else:
        names = [m["name"] for m in listed or [] if isinstance(m, dict) and isinstance(m.get("name"), str)
                 and m.get("state", "READY") == "READY"] if isinstance(listed, list) else []
    if not names:
        raise UserError(f"{where} names no model (HTTP {r.status_code}: {r.text[:80]!r})", "give --model NAME")
    return names[0]


def load_tokenizer(spec: str | None, served: str | None = None) -> tuple[object, str]:
    """(the tokenizer that makes the Austen prompts, what it is). `spec`: an engine directory (its
    tokenizer/), or a model spec as --model takes it (an HF checkpoint directory, a GGUF file,
    tiny:<family>). Without one: the served model's name when it names such a local path, else the
    embedded default model's (SmolLM2) tokenizer."""
    if spec is not None:
        return _tokenizer_of(spec)
    if served and not served.startswith("tiny:") and Path(served).expanduser().exists():
        try:
            return _tokenizer_of(served)
        except UserError:  # a path that is no model: the default below
            pass
    try:
        return _tokenizer_of(None)
    except UserError as exc:
        raise UserError(f"no tokenizer for the prompts: {exc.what}",
                        "give --tokenizer ENGINE_DIR or a model (HF checkpoint directory, GGUF file)") from None


def _tokenizer_of(spec: str | None) -> tuple[object, str]:
    if spec is not None and (Path(spec).expanduser() / engine_dir.MANIFEST).is_file():
        return Tokenizer(Path(spec).expanduser() / "tokenizer"), f"engine {spec}"
    source = model_load.resolve(spec)
    return model_load.load_tokenizer(source), f"{source.kind} {source.name}"


def prompts_from(requests: Sequence[BenchRequest], tokenizer) -> list[Prompt]:
    """The workload's token ids as text (the APIs take text; special tokens left out)."""
    return [Prompt(tokenizer.decode(list(r.prompt), skip_special_tokens=True), len(r.prompt), r.new_tokens)
            for r in requests]


# ----------------------------------------------------------------------------- report, plot

def format_load(result: dict) -> str:
    """One block per concurrency under a header naming the server, the model and the workload."""
    w = result["workload"]
    arrivals = f", Poisson arrivals at {result['rate']:g} req/s" if result["rate"] else ", closed loop"
    lines = [f"{result['model']} at {result['url']} ({result['api']}): {w['requests']} requests of {w['text']}, "
             f"prompt {w['prompt_tokens_mean']:.0f} tokens (mean; {w['prompt_tokens_range'][0]}.."
             f"{w['prompt_tokens_range'][1]}), output up to {w['new_tokens_mean']:.0f} (mean; "
             f"{w['new_tokens_range'][0]}..{w['new_tokens_range'][1]}), seed {w['seed']}{arrivals}"]
    for r in result["runs"]:
        e = r["errors"]
        errors = ", ".join(f"{k} {n}" for k, n in sorted(e["by_kind"].items())) or "none"
        counted = ", ".join(f"{k} {n}" for k, n in sorted(r["tokens_counted_by"].items()))
        procs = f" ({r['procs']} client processes)" if r["procs"] > 1 else ""
        lines += [
            f"\nconcurrency {r['concurrency']}: {r['completed']} of {r['requests']} requests, {r['output_tokens']} "
            f"output tokens in {r['seconds']:.2f} s; most in flight {r['max_in_flight']}{procs}; errors: {errors}",
            f"  throughput  {r['tok_s']:.1f} output tok/s, {r['req_s']:.2f} req/s (tokens counted by {counted or '-'})",
            f"  TTFT ms     p50 {_ms(r['ttft_ms']['p50'])}  p99 {_ms(r['ttft_ms']['p99'])}",
            f"  ITL ms      p50 {_ms(r['itl_ms']['p50'])}  p99 {_ms(r['itl_ms']['p99'])}  (between chunks; TPOT p50 "
            f"{_ms(r['tpot_ms']['p50'])}  p99 {_ms(r['tpot_ms']['p99'])})",
            f"  latency ms  p50 {_ms(r['latency_ms']['p50'])}  p99 {_ms(r['latency_ms']['p99'])}"]
        if r["rate"]:
            lines.append(f"  arrivals    {_rate(r['arrival_rate'])} req/s; wait for a slot ms p50 "
                         f"{_ms(r['wait_ms']['p50'])}  p99 {_ms(r['wait_ms']['p99'])}")
        lines += [f"  first {kind}: {text}" for kind, text in sorted(e["examples"].items())]
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def plot_load(result: dict, path: str) -> str:
    """PNG of output tok/s against p50 ITL (left) and p50 TTFT (right), one point per concurrency."""
    require_matplotlib()
    import matplotlib  # deferred: an optional extra (enginesmith[plot])

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"] if r["completed"]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for ax, key, label in ((axes[0], "itl_ms", "inter-token latency p50 (ms)"),
                           (axes[1], "ttft_ms", "time to first token p50 (ms)")):
        points = [(r[key]["p50"], r["tok_s"], r["concurrency"]) for r in runs if r[key]["p50"] is not None]
        ax.plot([x for x, _, _ in points], [y for _, y, _ in points], "o-")
        for x, y, c in points:
            ax.annotate(f"C={c}", (x, y), textcoords="offset points", xytext=(4, 6), fontsize=8)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("output tokens/s")
    w = result["workload"]
    arrivals = f", Poisson {result['rate']:g} req/s" if result["rate"] else ", closed loop"
    fig.suptitle(f"{result['model']} at {result['url']} ({result['api']}): {w['requests']} requests, prompt "
                 f"{w['prompt_tokens']}, output {w['new_tokens']}{arrivals}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
