"""Long-stream perplexity: one text, far longer than the model's context, scored token after token
under a KV-cache policy, as in StreamingLLM (Xiao et al., ICLR 2024, Fig. 3):

  dense      one growing cache, exact causal attention over everything (fed in chunks; memory
             and positions grow with the stream, past the trained context)
  window     a ring of `window` slots and no sinks: only the most recent tokens
  ring       `sinks` + `window` slots (StreamingLLM): the first tokens stay as attention sinks
  recompute  sliding window with re-computation: a fresh forward over the previous W = sinks +
             window tokens for every token. Exact at stride 1; with stride r one forward scores
             its last r tokens (each sees W-r..W-1 tokens of context) -- its cost per generated
             token is still one W-token forward, which is what `ms_per_step` reports.

Every run returns the negative log-likelihood of each predicted token (token t+1 from tokens
0..t), wall time, the time of one step (ring/window/dense: one decode token once the cache is
warm; recompute: one W-token forward, batch 1), and the KV cache size and process RSS sampled
along the stream. `summary` bins the nll into perplexity over position; `plot` draws it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from enginesmith.core.errors import UserError
from enginesmith.core.progress import bar as progress_bar
from enginesmith.measure.perplexity import _token_nll, spans
from enginesmith.measure.speed import rss_mib
from enginesmith.runtime.protocols import Engine, KVCache

POLICIES = ("dense", "window", "ring", "recompute")


@dataclass
class StreamRun:
    policy: str
    nll: np.ndarray                 # [N-1] nats, float64: nll[t] scores token t+1
    seconds: float
    ms_per_step: float
    settings: dict
    cache_mib: list[tuple[int, float]] = field(default_factory=list)   # (tokens seen, MiB)
    rss_mib: list[tuple[int, float]] = field(default_factory=list)


def _cache_mib(cache: KVCache) -> float:
    return cache.nbytes() / 2**20


def _bar(total: int, desc: str, progress: bool):
    return progress_bar(total=total, desc=desc, unit="tok", disable=not progress, leave=False, mininterval=1.0)


def _nll_rows(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Per-row nll of targets [n] under logits [n, V], float64."""
    return np.array([_token_nll(logits[i:i + 1], targets[i:i + 1]) for i in range(len(targets))])


def run_cached(policy: str, engine: Engine, ids: np.ndarray, sample_every: int = 256, chunk: int = 512,
               progress: bool = True) -> StreamRun:
    """dense, window or ring over `engine` (a dense graph for dense, a ring graph otherwise).

    The first tokens go in as a prefill as long as nothing would be evicted (identical to feeding
    them one by one), then one token per step."""
    cache = engine.new_cache(1)
    n = len(ids)
    nll = np.zeros(n - 1)
    ring = cache.evicts  # the ring (and the window: a ring of no sinks)
    if ring != (policy != "dense"):
        raise UserError(f"policy {policy} needs a {'ring' if policy != 'dense' else 'dense'} engine",
                        "open the engine built for it")
    prefill = min(cache.capacity, n) if ring else n
    step = min(chunk, cache.max_chunk) if ring else chunk
    memory: list[tuple[int, float]] = []
    rss: list[tuple[int, float]] = []
    decode_times: list[float] = []
    started = time.perf_counter()
    bar = _bar(n, policy, progress)
    pos = 0
    while pos < n:
        size = min(step, prefill - pos) if pos < prefill else 1
        piece = ids[None, pos:pos + size]
        t0 = time.perf_counter()
        mask = np.ones((1, size if ring else pos + size), np.int64)  # the ring reads only the new columns
        logits = engine.forward(piece, mask, np.arange(pos, pos + size)[None], cache)[0]
        if size == 1:
            decode_times.append(time.perf_counter() - t0)
        targets = ids[pos + 1:pos + size + 1]
        nll[pos:pos + len(targets)] = _nll_rows(logits[:len(targets)], targets)
        if (pos // sample_every) != ((pos + size) // sample_every) or pos == 0:
            memory.append((pos + size, round(_cache_mib(cache), 2)))
            rss.append((pos + size, rss_mib()["rss_mib"]))
        pos += size
        bar.update(size)
    bar.close()
    seconds = time.perf_counter() - started
    warm = decode_times[len(decode_times) // 10:] or decode_times
    if not warm:  # dense: chunked prefill only; time one decode step at the end instead
        t0 = time.perf_counter()
        engine.forward(ids[None, -1:], np.ones((1, n + 1), np.int64), np.array([[n]]), cache)
        warm = [time.perf_counter() - t0]
    settings = ({"sinks": cache.sinks, "window": cache.window} if ring else {"chunk": chunk})
    return StreamRun(policy, nll, seconds, 1000 * float(np.median(warm)), settings, memory, rss)


def last_token_graph(src, dst) -> str:
    """A copy of the dense graph `src` whose logits are those of the last position only ([B, 1, V]):
    what re-computation needs per generated token, without moving [B, W, V] logits to the host."""
    from pathlib import Path

    import onnx_ir as ir

    model = ir.load(src)
    graph = model.graph
    logits = next(v for v in graph.outputs if v.name == "logits")
    consts = [ir.Value(name=f"last_token_{k}", const_value=ir.Tensor(np.array([v], np.int64), name=f"last_token_{k}"))
              for k, v in (("start", -1), ("end", 2**62), ("axis", 1))]
    for c in consts:
        c.shape, c.type = ir.Shape([1]), ir.TensorType(ir.DataType.INT64)
        graph.register_initializer(c)
    node = ir.Node("", "Slice", [logits, *consts], num_outputs=1, name="last_token_logits")
    graph.append(node)
    logits.name = "logits_all"
    out = node.outputs[0]
    out.name, out.type = "logits", logits.type
    graph.outputs[list(graph.outputs).index(logits)] = out
    ir.save(model, dst, external_data=Path(dst).name + ".data")
    return str(dst)


def run_recompute(engine, ids: np.ndarray, window: int, stride: int = 1, batch: int = 8,
                  progress: bool = True, last_engine=None) -> StreamRun:
    """Sliding window with re-computation over a dense `engine` (see the module doc).
    `last_engine` (the same graph through `last_token_graph`) serves windows that score only their
    last token (all but the first at stride 1) and times the per-token cost."""
    if not 1 <= stride <= window:
        raise UserError(f"--stride {stride} is outside [1, {window}]", "use a stride between 1 and the window")
    n = len(ids)
    nll = np.full(n - 1, np.nan)
    plan = spans(n, window, stride)
    started = time.perf_counter()
    bar = _bar(n, "recompute", progress)
    rss: list[tuple[int, float]] = []
    i = 0
    while i < len(plan):  # windows of one length run as a batch
        length = plan[i][1] - plan[i][0]
        group = [plan[i]]
        while i + len(group) < len(plan) and len(group) < batch and \
                plan[i + len(group)][1] - plan[i + len(group)][0] == length:
            group.append(plan[i + len(group)])
        last_only = last_engine is not None and all(e - f == 1 for _, e, f in group)
        if last_only:  # the window's own tokens but its target: the last position predicts it
            rows = np.stack([ids[b:e - 1] for b, e, _ in group])
            runner, offset = last_engine, length - 2
        else:
            rows = np.stack([ids[b:e] for b, e, _ in group])
            runner, offset = engine, 0
        logits = runner.forward(rows, np.ones_like(rows), np.broadcast_to(np.arange(rows.shape[1]), rows.shape).copy(),
                                runner.new_cache(len(group)))
        for row, (begin, end, first) in enumerate(group):
            targets = ids[first:end]
            nll[first - 1:end - 1] = _nll_rows(logits[row, first - 1 - begin - offset:end - 1 - begin - offset],
                                               targets)
        rss.append((group[-1][1], rss_mib()["rss_mib"]))
        bar.update(sum(e - f for _, e, f in group))
        i += len(group)
    bar.close()
    seconds = time.perf_counter() - started
    times = []
    probe = ids[None, :min(window, n)]
    timed = last_engine or engine
    for _ in range(5):  # the cost per generated token: one W-token forward, batch 1
        t0 = time.perf_counter()
        timed.forward(probe, np.ones_like(probe), np.arange(probe.shape[1])[None], timed.new_cache(1))
        times.append(time.perf_counter() - t0)
    return StreamRun("recompute", nll, seconds, 1000 * float(np.median(times)),
                     {"window": window, "stride": stride, "batch": batch}, [], rss)


def summary(run: StreamRun, bin_tokens: int = 1024) -> dict:
    """Perplexity overall and per `bin_tokens` of position, speed and memory, as plain numbers."""
    nll = run.nll[~np.isnan(run.nll)]
    bins = [float(math.exp(run.nll[i:i + bin_tokens].mean())) for i in range(0, len(run.nll), bin_tokens)]
    cache = [float(m) for _, m in run.cache_mib]
    rss = [float(m) for _, m in run.rss_mib if m is not None and not math.isnan(m)]
    return {
        "policy": run.policy, **run.settings, "tokens": int(len(nll)),
        "ppl": float(math.exp(nll.mean())), "ppl_last_bin": bins[-1], "ppl_bins": bins, "bin_tokens": bin_tokens,
        "seconds": round(run.seconds, 1), "ms_per_step": round(run.ms_per_step, 2),
        "cache_mib_first": cache[0] if cache else None, "cache_mib_last": cache[-1] if cache else None,
        "rss_mib_first": rss[0] if rss else None, "rss_mib_max": max(rss) if rss else None,
        "rss_mib_last": rss[-1] if rss else None,
    }


def format_table(summaries: list[dict], text: str) -> str:
    lines = [f"long-stream perplexity on {text}",
             f"{'policy':10} {'tokens':>7} {'ppl':>9} {'ppl last bin':>12} {'ms/step':>9} "
             f"{'cache MiB first/last':>21} {'RSS MiB first/max':>18}"]
    for s in summaries:
        cache = "-" if s["cache_mib_first"] is None else f"{s['cache_mib_first']:.1f}/{s['cache_mib_last']:.1f}"
        rss = "-" if s["rss_mib_first"] is None else f"{s['rss_mib_first']:.0f}/{s['rss_mib_max']:.0f}"
        lines.append(f"{s['policy']:10} {s['tokens']:>7} {s['ppl']:>9.2f} {s['ppl_last_bin']:>12.2f} "
                     f"{s['ms_per_step']:>9.1f} {cache:>21} {rss:>18}")
    return "\n".join(lines)


def plot(runs: list[StreamRun], path: str, bin_tokens: int = 256, title: str = "") -> str:
    """PNG: perplexity per `bin_tokens` over position (log scale) and the KV cache size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib", "pip install matplotlib") from None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1.3]})
    for run in runs:
        x = np.arange(0, len(run.nll), bin_tokens)
        y = [math.exp(np.nanmean(run.nll[i:i + bin_tokens])) for i in x]
        label = run.policy + "".join(f" {k}={v}" for k, v in run.settings.items() if k in ("sinks", "window", "stride"))
        top.plot(x + bin_tokens / 2, y, label=label, linewidth=1.2)
        if run.cache_mib:
            px, mib = zip(*run.cache_mib)
            bottom.plot(px, mib, label=run.policy)
    top.set_yscale("log")
    top.set_ylabel(f"perplexity per {bin_tokens} tokens")
    top.set_title(title or "long-stream perplexity")
    top.legend(fontsize=8)
    top.grid(alpha=0.3, which="both")
    bottom.set_ylabel("KV cache MiB")
    bottom.set_xlabel("token position in the stream")
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
