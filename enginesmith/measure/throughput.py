"""Offline serving throughput: N requests through the ContinuousBatcher, at most C in flight.

Legend: N requests, C concurrency (requests in flight), P prompt tokens, T output tokens of a request.

    workload(tokenizer, N, seed) ── N BenchRequests (prompt ids, T) drawn from the Austen corpus
        │
    run_offline(model, requests, C)            a closed loop, timed after a warm-up:
        │   add C requests ── step() ── each finished request lets the next one in ── ... ── all done
        │   per step: rows, width, context tokens, seconds, pages; per token: when it came back
        ▼
    {tok/s, TTFT, ITL, pages, preemptions, bound} ── sweep over several C ── format_sweep / plot

The workload: a prompt is a run of 1..8 consecutive paragraphs of one of the six novels (real ids
from the engine's own tokenizer), cut to `max_prompt` tokens; its output length T is the token count
of the paragraph after the run, clipped to 1..`max_new`. So P and T follow the lengths of real prose
(many short lines of dialogue, a few long paragraphs). With `prompt_tokens` the prompt is the text
from a random paragraph on, cut to exactly P tokens; with `new_tokens` every T is that number. No
stop tokens: every request runs to its T, so runs of different C do the same work.

The bound: a decode-only step (width 1) must read the weights once and every row's K/V, so
bytes = weight_bytes + context_tokens * kv_bytes_per_token; fraction = bytes / step seconds / the
copy bandwidth of the model's device (speed.measure_copy_bandwidth). Reported over the decode steps
at the highest batch the run reached (a figure like "decode steps at batch 64 at >= 75 % of the bound").
Step seconds are the scheduler's whole step (host scheduling included). On a CPU a tiny model's
weights sit in cache, so its fraction can pass 100 %; the figure means something for weights far
larger than the last-level cache.

Rows per step: the concurrency, at most the model's `max_batch` (the CUDA paged engine's largest
CUDA-graph bucket); prefill chunks of CHUNK tokens, at most the model's `max_chunk`. Prefix caching
is off: overlapping Austen prompts must not skip work.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from enginesmith.core.errors import UserError
from enginesmith.core.progress import bar as progress_bar
from enginesmith.measure import speed
from enginesmith.models.corpus import austen_text, data_dir, load_text, novels, tokenize
from enginesmith.runtime.decoding.batching import ContinuousBatcher, PagedModel, SchedulerConfig, StepOutput

RUN_PARAGRAPHS = 8            # a drawn prompt is a run of 1..RUN_PARAGRAPHS paragraphs
MAX_PROMPT, MAX_NEW = 1024, 512  # default clips of the drawn lengths
CHUNK = 128                   # prefill tokens per row per step (a step pads every row to its widest)
STEP_TOKENS = 2048            # new tokens per step, all rows together (at least one per row)
WARMUP_NEW_TOKENS = 4


@dataclass(frozen=True)
class BenchRequest:
    prompt: tuple[int, ...]   # [P] token ids
    new_tokens: int           # T: the request runs to exactly this many output tokens


# ----------------------------------------------------------------------------- the workload

def split_paragraphs(text: str) -> tuple[str, ...]:
    """The paragraphs of a text (between blank lines, line breaks inside kept)."""
    return tuple(p.strip() for p in re.split(r"\n[ \t]*\n", text) if p.strip())


@functools.lru_cache(maxsize=1)
def paragraphs() -> tuple[tuple[str, ...], ...]:
    """Each novel's paragraphs, novels sorted."""
    return tuple(split_paragraphs(austen_text(name)) for name in novels())


def workload(source, n: int, seed: int = 0, prompt_tokens: int | None = None, new_tokens: int | None = None,
             max_prompt: int = MAX_PROMPT, max_new: int = MAX_NEW,
             books: Sequence[Sequence[str]] | None = None) -> list[BenchRequest]:
    """N requests, deterministic from the seed (module doc). `source` is the engine's tokenizer (prompts
    from `books`, paragraphs of texts: default the Austen novels), or an int vocab size: synthetic
    prompts of seeded random ids (no corpus installed; random ids cost the same compute), their
    lengths fixed or drawn as SYNTHETIC_* says."""
    for name, value in (("requests", n), ("prompt_tokens", prompt_tokens), ("new_tokens", new_tokens),
                        ("max_prompt", max_prompt), ("max_new", max_new)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise UserError(f"invalid {name}={value!r}", f"give {name} >= 1")
    rng = np.random.default_rng(seed)
    if isinstance(source, int):
        return _synthetic(source, n, rng, prompt_tokens, new_tokens, max_prompt, max_new)
    books = books or paragraphs()
    share = np.array([len(b) for b in books], float)
    share /= share.sum()  # a paragraph of any novel is as likely a start as any other
    out = []
    for _ in range(n):
        book = books[rng.choice(len(books), p=share)]
        start = int(rng.integers(0, len(book)))
        if prompt_tokens is None:
            end = start + int(rng.integers(1, RUN_PARAGRAPHS + 1))
            prompt = tokenize(source, _text(book, start, end), max_prompt)
        else:
            end, prompt = _exact_prompt(source, book, start, prompt_tokens)
        t = new_tokens or int(np.clip(len(tokenize(source, "\n\n" + book[end % len(book)])), 1, max_new))
        out.append(BenchRequest(tuple(int(x) for x in prompt), t))
    return out


SYNTHETIC_PROMPT = (150, 0.9)   # synthetic lengths: exp(normal(log median, sigma)), clipped (prose-like spread)
SYNTHETIC_NEW = (60, 0.8)


def _synthetic(vocab: int, n: int, rng, prompt_tokens: int | None, new_tokens: int | None, max_prompt: int,
               max_new: int) -> list[BenchRequest]:
    def lengths(fixed: int | None, median_sigma: tuple[float, float], high: int) -> list[int]:
        if fixed is not None:
            return [fixed] * n
        median, sigma = median_sigma
        return [int(x) for x in np.clip(np.round(np.exp(rng.normal(np.log(median), sigma, n))), 1, high)]

    ps, ts = lengths(prompt_tokens, SYNTHETIC_PROMPT, max_prompt), lengths(new_tokens, SYNTHETIC_NEW, max_new)
    return [BenchRequest(tuple(int(t) for t in rng.integers(0, vocab, p)), t) for p, t in zip(ps, ts)]


def workload_source(tokenizer, vocab: int, text_file: str | None = None) -> tuple[object, tuple | None, str]:
    """(what `workload` takes, its books, what the prompts are): the paragraphs of `text_file` (--text),
    else the Austen corpus, else, when it is not installed, synthetic prompts (the vocab size; the caller
    prints a notice)."""
    if text_file is not None:
        return tokenizer, (split_paragraphs(load_text(text_file)),), f"text of {Path(text_file).name}"
    try:
        data_dir()
    except UserError:
        return vocab, None, SYNTHETIC
    return tokenizer, None, "austen"


SYNTHETIC = "synthetic prompts (random token ids)"
NO_CORPUS_NOTICE = ("notice: the Jane Austen corpus is not installed, so the prompts are synthetic (random token ids, "
                    "lengths spread like prose); give --text FILE for prompts of real text, or install the corpus: "
                    "apt-get install r-cran-janeaustenr")


def _text(book: Sequence[str], start: int, end: int) -> str:
    """Paragraphs start..end-1 of a novel read as a ring (a run past the last paragraph goes on at the first)."""
    return "\n\n".join(book[i % len(book)] for i in range(start, end))


def _exact_prompt(tokenizer, book: Sequence[str], start: int, tokens: int) -> tuple[int, np.ndarray]:
    """(the paragraph after the prompt, exactly `tokens` ids of the text from paragraph `start` on)."""
    end, chars = start, 0
    while True:
        while chars < 5 * tokens:  # English BPE averages about 4 characters a token
            chars += len(book[end % len(book)]) + 2
            end += 1
        ids = tokenize(tokenizer, _text(book, start, end), tokens)
        if len(ids) == tokens:
            return end, ids
        chars = 2 * chars + 1  # too few tokens: take twice the text


def clips(max_positions: int | None, chunk: int, prompt_tokens: int | None = None,
          new_tokens: int | None = None) -> tuple[int, int]:
    """(max_prompt, max_new) so that every request fits a model of `max_positions` (the batcher keeps
    chunk - 1 positions free for a step's padding), honouring fixed lengths; a UserError when they
    cannot fit."""
    room = None if max_positions is None else max_positions - (chunk - 1)
    if room is not None and (prompt_tokens or 1) + (new_tokens or 1) > room:
        raise UserError(f"a request of {prompt_tokens or 1} + {new_tokens or 1} tokens, plus {chunk - 1} positions "
                        f"for a prefill chunk's padding, exceeds the engine's {max_positions} positions",
                        "use fewer --prompt-tokens/--new-tokens or a smaller --chunk")
    if room is None:
        return prompt_tokens or MAX_PROMPT, new_tokens or MAX_NEW
    max_new = new_tokens or min(MAX_NEW, room - prompt_tokens if prompt_tokens else max(1, room // 4))
    return prompt_tokens or min(MAX_PROMPT, room - max_new), max_new


# ----------------------------------------------------------------------------- one closed-loop run

def scheduler_config(concurrency: int, max_batch_rows: int | None = None, chunk: int = CHUNK,
                     model_rows: int | None = None) -> SchedulerConfig:
    """Rows per step: the concurrency (or `max_batch_rows`), at most the model's `max_batch` (the
    CUDA paged engine's largest batch bucket); a step budget that decodes every row."""
    rows = max_batch_rows or concurrency
    if model_rows:
        rows = min(rows, model_rows)
    return SchedulerConfig(max_batch=rows, max_tokens=max(rows, chunk, STEP_TOKENS), chunk=chunk)


def model_sizes(model, loaded=None) -> tuple[int | None, int]:
    """(weight bytes a decode step reads, K+V bytes per token of all layers): the model's own
    `weight_bytes` / `kv_bytes_per_token` (the CUDA paged engine), else, for an ONNX Runtime paged
    graph, its pool's shape and (given the opened engine) its graph's weights."""
    kv = getattr(model, "kv_bytes_per_token", None)
    if kv is None:
        pool = model.pool  # runtime.engines.ort_paged_model.OrtPagedModel: pools [NB, BS, Hkv, D], one per K and per V
        kv = len(pool.past) * pool.shape[2] * pool.shape[3] * pool.dtype.itemsize
    weights = getattr(model, "weight_bytes", None)
    if weights is None and loaded is not None:
        weights = speed.onnx_weight_bytes(loaded.path / loaded.manifest.graph)
    return weights, int(kv)


def model_device(model) -> str:
    return getattr(model, "device", None) or getattr(getattr(model, "engine", None), "device", None) or "cpu"


def copy_bandwidth(device: str) -> float:
    """GB/s of the device's memory copy (speed.measure_copy_bandwidth)."""
    measured = speed.measure_copy_bandwidth()
    if device == "cuda":
        if "cuda_gbs" not in measured:
            raise UserError("the model runs on CUDA but torch sees no GPU to measure its bandwidth",
                            "install torch with CUDA support")
        return measured["cuda_gbs"]
    return measured["cpu_gbs"]


def run_offline(model: PagedModel, requests: Sequence[BenchRequest], concurrency: int,
                config: SchedulerConfig | None = None, *, warmup: int | None = None,
                enable_prefix_caching: bool = False, bandwidth_gbs: float | None = None,
                weight_bytes: int | None = None, kv_bytes_per_token: int | None = None,
                progress: bool = False, on_step: Callable[[StepOutput], None] | None = None) -> dict:
    """Serve `requests` with at most `concurrency` in flight (the next is added when one finishes),
    after `warmup` untimed requests (default: min(C, N), at most WARMUP_NEW_TOKENS tokens each, all
    at once); the module doc's figures as a JSON-able dict. The bound needs the weight bytes (the
    model's, or given) and the bandwidth (measured when not given). Prefix caching is off by default
    so that overlapping Austen prompts do not skip work."""
    if not isinstance(concurrency, int) or concurrency < 1:
        raise UserError(f"invalid concurrency={concurrency!r}", "give a concurrency >= 1")
    if not requests:
        raise UserError("no requests to run", "give at least one request")
    config = config or scheduler_config(concurrency, model_rows=getattr(model, "max_batch", None))
    warmup = min(concurrency, len(requests)) if warmup is None else warmup
    if warmup:  # also fills the CUDA engine's top batch bucket (its graph is captured on a later run)
        _closed_loop(ContinuousBatcher(model, config, enable_prefix_caching),
                     [BenchRequest(r.prompt, min(r.new_tokens, WARMUP_NEW_TOKENS)) for r in requests[:warmup]],
                     warmup)
    batcher = ContinuousBatcher(model, config, enable_prefix_caching)
    steps: list[StepOutput] = []

    def record(out: StepOutput) -> None:
        steps.append(out)
        if on_step is not None:
            on_step(out)

    bar = _progress(len(requests), concurrency, progress)
    seconds, token_times = _closed_loop(batcher, requests, concurrency, record, bar.update)
    bar.close()
    done = [batcher.finished[f"r{i}"] for i in range(len(requests))]
    for req, want in zip(done, requests):
        if len(req.output) != want.new_tokens or req.finish_reason != "length":
            raise RuntimeError(f"{req.request_id} ended with {len(req.output)} of {want.new_tokens} tokens "
                               f"({req.finish_reason})")
    out_tokens = sum(r.new_tokens for r in requests)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    ttft = [req.first_token_at - req.added_at for req in done]
    itl = [b - a for times in token_times.values() for a, b in zip(times, times[1:])]
    pages = [s.pages_used for s in steps]
    if weight_bytes is None or kv_bytes_per_token is None:
        own_weights, own_kv = model_sizes(model)
        weight_bytes, kv_bytes_per_token = weight_bytes or own_weights, kv_bytes_per_token or own_kv
    return {
        "requests": len(requests), "concurrency": concurrency, "max_batch_rows": config.max_batch,
        "chunk": batcher.chunk, "warmup_requests": warmup,
        "output_tokens": out_tokens, "prompt_tokens": prompt_tokens, "seconds": seconds,
        "tok_s": out_tokens / seconds, "total_tok_s": (out_tokens + prompt_tokens) / seconds,
        "req_s": len(requests) / seconds,
        "ttft_ms": percentiles(ttft), "itl_ms": percentiles(itl),
        "steps": len(steps), "max_batch": max(len(s.scheduled) for s in steps),
        "pages": {"total": model.num_pages - 1, "peak": max(pages), "mean": statistics.fmean(pages)},
        "preemptions": sum(len(s.preempted) for s in steps),
        "leaked_pages": batcher.pages_used,  # every page must be back in the pool
        "bound": decode_bound(steps, weight_bytes, kv_bytes_per_token, model_device(model), bandwidth_gbs),
    }


def _closed_loop(batcher: ContinuousBatcher, requests: Sequence[BenchRequest], concurrency: int,
                 on_step: Callable[[StepOutput], None] | None = None,
                 on_finished: Callable[[int], object] | None = None) -> tuple[float, dict[str, list[float]]]:
    """Run every request with at most `concurrency` added and unfinished; (seconds, token arrival
    times per request id). Request i is "r{i}"."""
    queue = iter(enumerate(requests))
    times: dict[str, list[float]] = {}

    def admit(k: int) -> None:
        for i, r in itertools.islice(queue, k):
            batcher.add_request(list(r.prompt), r.new_tokens, request_id=f"r{i}")

    start = time.perf_counter()
    admit(concurrency)
    while batcher.has_unfinished:
        out = batcher.step()
        now = time.perf_counter()
        for rid in out.new_tokens:
            times.setdefault(rid, []).append(now)
        if on_step is not None:
            on_step(out)
        if out.finished:
            admit(len(out.finished))
            if on_finished is not None:
                on_finished(len(out.finished))
    return time.perf_counter() - start, times


def decode_bound(steps: Sequence[StepOutput], weight_bytes: int | None, kv_bytes_per_token: int, device: str,
                 bandwidth_gbs: float | None = None) -> dict | None:
    """Fraction of the bandwidth bound reached by the decode-only steps at the highest batch seen
    (module doc); None without the weight bytes or without a decode step."""
    decode = [s for s in steps if s.width == 1 and s.seconds > 0]
    if weight_bytes is None or not decode:
        return None
    batch = max(len(s.scheduled) for s in decode)
    top = [s for s in decode if len(s.scheduled) == batch]
    gbs = bandwidth_gbs if bandwidth_gbs is not None else copy_bandwidth(device)
    fractions = [(weight_bytes + s.context_tokens * kv_bytes_per_token) / s.seconds / (gbs * 1e9) for s in top]
    ms = statistics.median(s.seconds for s in top) * 1e3
    return {"device": device, "bandwidth_gbs": gbs, "weight_bytes": int(weight_bytes),
            "kv_bytes_per_token": int(kv_bytes_per_token), "batch": batch, "steps": len(top),
            "decode_steps": len(decode), "ms_per_step_median": ms, "tok_s_median": batch / ms * 1e3,
            "fraction_mean": statistics.fmean(fractions), "fraction_median": statistics.median(fractions)}


def percentiles(seconds: Sequence[float]) -> dict:
    """{"p50", "p99"} in milliseconds of durations in seconds (None each when there are none)."""
    if not seconds:
        return {"p50": None, "p99": None}
    p50, p99 = np.percentile(np.asarray(seconds) * 1e3, [50, 99])
    return {"p50": float(p50), "p99": float(p99)}


def _progress(total: int, concurrency: int, enabled: bool):
    return progress_bar(total=total, desc=f"concurrency {concurrency}", unit="req", disable=not enabled, leave=False)


# ----------------------------------------------------------------------------- sweep, report, plot

def sweep(model: PagedModel, requests: Sequence[BenchRequest], concurrencies: Sequence[int], *,
          max_batch_rows: int | None = None, chunk: int = CHUNK, weight_bytes: int | None = None,
          kv_bytes_per_token: int | None = None, progress: bool = False) -> list[dict]:
    """run_offline at each concurrency on the same requests (the copy bandwidth measured once)."""
    if weight_bytes is None or kv_bytes_per_token is None:
        own_weights, own_kv = model_sizes(model)
        weight_bytes, kv_bytes_per_token = weight_bytes or own_weights, kv_bytes_per_token or own_kv
    gbs = copy_bandwidth(model_device(model)) if weight_bytes is not None else None
    rows = getattr(model, "max_batch", None)
    return [run_offline(model, requests, c, scheduler_config(c, max_batch_rows, chunk, rows), bandwidth_gbs=gbs,
                        weight_bytes=weight_bytes, kv_bytes_per_token=kv_bytes_per_token, progress=progress)
            for c in concurrencies]


def describe_workload(requests: Sequence[BenchRequest], seed: int, prompt_tokens: int | None,
                      new_tokens: int | None, text: str) -> dict:
    """What the runs were fed: fixed lengths or the drawn ones' spread."""
    p = [len(r.prompt) for r in requests]
    t = [r.new_tokens for r in requests]
    return {"requests": len(requests), "seed": seed, "text": text,
            "prompt_tokens": prompt_tokens if prompt_tokens is not None else "drawn",
            "new_tokens": new_tokens if new_tokens is not None else "drawn",
            "prompt_tokens_mean": statistics.fmean(p), "prompt_tokens_range": [min(p), max(p)],
            "new_tokens_mean": statistics.fmean(t), "new_tokens_range": [min(t), max(t)]}


def format_sweep(result: dict) -> str:
    """One block per concurrency under a header naming the engine, the device and the workload."""
    w = result["workload"]
    lengths = (f"prompt {w['prompt_tokens_mean']:.0f} tokens (mean; {w['prompt_tokens_range'][0]}.."
               f"{w['prompt_tokens_range'][1]}), output {w['new_tokens_mean']:.0f} (mean; "
               f"{w['new_tokens_range'][0]}..{w['new_tokens_range'][1]})")
    lines = [f"{result['model']} {result['precision']} on {result['device_name']}: {w['requests']} requests of "
             f"{w['text']}, {lengths}, seed {w['seed']}"]
    for r in result["runs"]:
        ttft, itl, pages = r["ttft_ms"], r["itl_ms"], r["pages"]
        lines += [
            f"\nconcurrency {r['concurrency']} (rows per step {r['max_batch_rows']}, chunk {r['chunk']}): "
            f"{r['requests']} requests, {r['output_tokens']} output tokens in {r['seconds']:.2f} s, {r['steps']} steps",
            f"  throughput  {r['tok_s']:.1f} output tok/s, {r['total_tok_s']:.1f} total tok/s, {r['req_s']:.2f} req/s",
            f"  TTFT ms     p50 {_ms(ttft['p50'])}  p99 {_ms(ttft['p99'])}",
            f"  ITL ms      p50 {_ms(itl['p50'])}  p99 {_ms(itl['p99'])}",
            f"  pages       peak {pages['peak']} of {pages['total']}, mean {pages['mean']:.1f}; "
            f"preemptions {r['preemptions']}; leaked {r['leaked_pages']}"]
        b = r["bound"]
        if b:
            lines.append(f"  bound       {b['steps']} decode steps at batch {b['batch']}: {100 * b['fraction_mean']:.1f} % "
                         f"mean, {100 * b['fraction_median']:.1f} % median of the {b['bandwidth_gbs']:.0f} GB/s copy "
                         f"bandwidth ({b['weight_bytes'] / 1e6:.1f} MB weights + {b['kv_bytes_per_token']} B KV "
                         f"per context token); {b['ms_per_step_median']:.2f} ms/step")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def require_matplotlib() -> None:
    """A UserError now (before a long run) when --png cannot be written."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UserError("--png needs matplotlib", "pip install 'enginesmith[plot]'")


def plot(result: dict, path: str) -> str:
    """PNG of output and total tok/s against concurrency (log 2 axis), each point labelled."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    c = [r["concurrency"] for r in runs]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(c, [r["tok_s"] for r in runs], "o-", label="output tok/s")
    ax.plot(c, [r["total_tok_s"] for r in runs], "s--", alpha=0.6, label="prompt + output tok/s")
    for r in runs:
        ax.annotate(f"{r['tok_s']:.0f}", (r["concurrency"], r["tok_s"]), textcoords="offset points",
                    xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(c, [str(x) for x in c])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("tokens/s")
    w = result["workload"]
    ax.set_title(f"{result['model']} {result['precision']} on {result['device_name']}\n{w['requests']} requests, "
                 f"prompt {w['prompt_tokens']}, output {w['new_tokens']}", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def bench_offline(loaded, model: PagedModel, requests: Sequence[BenchRequest], concurrencies: Sequence[int],
                  workload_info: dict, *, max_batch_rows: int | None = None, chunk: int = CHUNK,
                  progress: bool = True) -> dict:
    """`enginesmith bench --requests`: the sweep on an opened engine's PagedModel, with the engine,
    device, pool and workload named beside the runs."""
    weights, kv = model_sizes(model, loaded)
    device = model_device(model)
    runs = sweep(model, requests, concurrencies, max_batch_rows=max_batch_rows, chunk=chunk, weight_bytes=weights,
                 kv_bytes_per_token=kv, progress=progress)
    return {"model": loaded.manifest.source.name, "engine": str(loaded.path), "precision": loaded.manifest.precision,
            "backend": type(model).__name__, "device": device, "device_name": speed.device_name(device),
            # num_pages: the usable pages, as the runs' pages.total (page 0 of the pool is the null page)
            "num_pages": model.num_pages - 1, "page_size": model.page_size, "workload": workload_info, "runs": runs}
