"""Speed benchmarks: an enginesmith engine and HF transformers eager, same method, same prompt.

Method (identical for `bench_engine` and `bench_hf`):
- prompt: `make_prompt` gives [B, P] ids, real text when a tokenizer is passed and the Austen
  corpus is installed (row b starts b*P tokens later), else seeded random ids; both benches of one
  comparison must get the same array (pass `prompt=`);
- `warmup` untimed runs (prefill + min(4, new_tokens) decode steps), then `repeats` timed runs;
- prefill: one forward of [B, P] from an empty cache; prefill_tok_s = B*P / time;
- decode: `new_tokens` forwards of [B, 1], greedy argmax fed back, attention_mask all ones over
  P+i+1 slots, position_ids P+i; decode_ms_per_token = decode time / new_tokens (per step, i.e.
  per token of each row), decode_tok_s = B*new_tokens / decode time; step p50/p90 are reported too;
- timings are the median over repeats; memory is process-wide: peak RSS (getrusage ru_maxrss,
  which includes everything the process did before) and current RSS (/proc/self/status VmRSS);
- threads: bench_hf sets torch.set_num_threads(threads) for the run (default: the CPU count the
  process may use, ORT's own default); build the OrtEngine with the same `threads` to compare.
An engine with a device decode loop (the ORT CUDA GqaEngine) is timed through that loop instead
(`bench_device_engine`: decode counted from the first generated token, as HF's generate is in
`bench_hf_generate`, which also covers the static cache + torch.compile on CUDA).
All results are plain dicts of JSON-able values. `bandwidth_bound` turns bytes read per decode step
and a measured copy bandwidth (`measure_copy_bandwidth`) into the tokens/s a memory-bound decoder
cannot exceed.
"""

from __future__ import annotations

import os
import platform
import resource
import statistics
import time

import numpy as np

from enginesmith.core.errors import UserError
from enginesmith.models.corpus import tokenize
from enginesmith.models.corpus import austen_text
from enginesmith.runtime.decoding import speculative as sp
from enginesmith.runtime.decoding.generate import GenerationConfig, generate_ids
from enginesmith.runtime.engines.ort_cuda import DecodeTimes, GqaEngine, fast_generate_ids
from enginesmith.runtime.protocols import Engine


def rss_mib() -> dict:
    """{"peak_rss_mib": ru_maxrss, "rss_mib": current VmRSS (None where /proc is absent)}."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    current = None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    current = int(line.split()[1]) / 1024
    except OSError:
        pass
    return {"peak_rss_mib": round(peak, 1), "rss_mib": None if current is None else round(current, 1)}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make_prompt(prompt_tokens: int, batch: int, vocab: int, tokenizer=None, seed: int = 0) -> np.ndarray:
    """Prompt ids int64 [batch, prompt_tokens], all < vocab (see the module doc)."""
    need = prompt_tokens * batch
    if tokenizer is not None:
        try:
            ids = tokenize(tokenizer, austen_text()[: need * 8 + 1000], need)
            if len(ids) == need and ids.max() < vocab:
                return ids.reshape(batch, prompt_tokens)
        except Exception:  # no corpus: random ids measure the same speed
            pass
    return np.random.default_rng(seed).integers(0, vocab, (batch, prompt_tokens), dtype=np.int64)


def _run(step, prompt: np.ndarray, new_tokens: int, warmup: int, repeats: int) -> dict:
    """Time prefill and decode of `step(ids, mask, pos, state) -> (logits np [B,S,V], state)`."""
    batch, plen = prompt.shape

    def once(steps: int):
        t0 = time.perf_counter()
        logits, state = step(prompt, np.ones_like(prompt), np.broadcast_to(np.arange(plen), prompt.shape), None)
        nxt = logits[:, -1].argmax(-1)
        prefill = time.perf_counter() - t0
        times = []
        for i in range(steps):
            t = time.perf_counter()
            ids = nxt.astype(np.int64)[:, None]
            mask = np.ones((batch, plen + i + 1), dtype=np.int64)
            pos = np.full((batch, 1), plen + i, dtype=np.int64)
            logits, state = step(ids, mask, pos, state)
            nxt = logits[:, -1].argmax(-1)
            times.append(time.perf_counter() - t)
        return prefill, times

    for _ in range(warmup):
        once(min(4, new_tokens))
    runs = [once(new_tokens) for _ in range(repeats)]
    prefill = statistics.median(r[0] for r in runs)
    decode = statistics.median(sum(r[1]) for r in runs)
    steps = sorted(t for r in runs for t in r[1])
    pct = (lambda q: steps[min(len(steps) - 1, int(q * len(steps)))] * 1e3) if steps else (lambda q: None)
    return {
        "batch": batch, "prompt_tokens": plen, "new_tokens": new_tokens, "warmup": warmup,
        "repeats": repeats, "prefill_s": prefill, "prefill_tok_s": batch * plen / prefill,
        "decode_s": decode,
        "decode_ms_per_token": decode / new_tokens * 1e3 if new_tokens else None,
        "decode_tok_s": batch * new_tokens / decode if new_tokens else None,
        "decode_ms_p50": pct(0.5), "decode_ms_p90": pct(0.9),
    }


def _check(prompt_tokens: int, new_tokens: int, batch: int, warmup: int, repeats: int) -> None:
    for name, value, low in (("prompt_tokens", prompt_tokens, 1), ("new_tokens", new_tokens, 0),
                             ("batch", batch, 1), ("warmup", warmup, 0), ("repeats", repeats, 1)):
        if not isinstance(value, int) or value < low:
            raise UserError(f"invalid {name}={value!r}", f"use an integer >= {low}")


def bench_engine(engine: Engine, tokenizer=None, prompt_tokens: int = 128, new_tokens: int = 64, batch: int = 1,
                 warmup: int = 1, repeats: int = 1, prompt: np.ndarray | None = None) -> dict:
    """Benchmark an Engine (new_cache/forward, e.g. OrtEngine); returns the module doc's figures
    plus backend, device, threads and memory."""
    if prompt is None:
        _check(prompt_tokens, new_tokens, batch, warmup, repeats)
        prompt = make_prompt(prompt_tokens, batch, engine.vocab, tokenizer)
    _check(prompt.shape[1], new_tokens, prompt.shape[0], warmup, repeats)

    def step(ids, mask, pos, cache):
        cache = engine.new_cache(ids.shape[0]) if cache is None else cache
        return engine.forward(ids, mask, pos, cache), cache

    if engine.device_decode:
        result = bench_device_engine(engine, prompt, new_tokens, warmup, repeats)
    else:
        result = {"backend": type(engine).__name__, **_run(step, prompt, new_tokens, warmup, repeats)}
    device = engine.device
    session = getattr(engine, "session", None)  # ONNX Runtime engines: report their thread count
    threads = session.get_session_options().intra_op_num_threads if session is not None else None
    result.update(device=device, device_name=device_name(device), threads=threads or None, **rss_mib())
    return result


def bench_device_engine(engine: GqaEngine, prompt: np.ndarray, new_tokens: int, warmup: int = 1, repeats: int = 1) -> dict:
    """An engine with a device decode loop (runtime.engines.ort_cuda.GqaEngine): greedy through
    `fast_generate_ids` (fixed IOBinding, CUDA graphs, argmax on the device, one host sync per
    token), as `enginesmith run` decodes with it. Prefill = prompt to first token; decode tok/s =
    B * (N - 1) / time from token 1 to token N (the first token comes from the prefill)."""
    batch, plen = prompt.shape
    _check(plen, new_tokens, batch, warmup, repeats)
    if new_tokens < 2:
        raise UserError("the device decode benchmark needs --new-tokens >= 2", "use more new tokens")
    config = GenerationConfig(max_new_tokens=new_tokens)
    prompts = prompt.tolist()
    decode, prefill = [], []
    for i in range(warmup + repeats):
        times = DecodeTimes()
        n = sum(1 for _ in fast_generate_ids(engine, prompts, config, times=times))
        if n != new_tokens:
            raise RuntimeError(f"the device decode loop produced {n} of {new_tokens} tokens")
        if i >= warmup:
            decode.append(sum(times.step_s))
            prefill.append(times.prefill_s)
    d, steps = statistics.median(decode), new_tokens - 1
    return {"backend": type(engine).__name__, "batch": batch, "prompt_tokens": plen, "new_tokens": new_tokens,
            "warmup": warmup, "repeats": repeats, "prefill_s": statistics.median(prefill),
            "prefill_tok_s": batch * plen / statistics.median(prefill), "decode_s": d,
            "decode_ms_per_token": 1e3 * d / steps, "decode_tok_s": batch * steps / d,
            "decode_tok_s_min": batch * steps / max(decode), "decode_tok_s_max": batch * steps / min(decode),
            "cuda_graph": engine.cuda_graph}


class _TokenClock:
    """A generate() streamer that notes when each new token arrives (put gets the prompt first,
    then each generated token)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        self.times.append(time.perf_counter())


def bench_hf_generate(model, prompt: np.ndarray, new_tokens: int, repeats: int = 1, static: bool = False) -> dict:
    """HF transformers' own `generate` on CUDA (greedy, exactly `new_tokens`): decode tok/s from
    token 1 to token N. static=True uses its static cache, which generate() compiles with
    torch.compile (CUDA graphs) on CUDA: the first 3 runs (compilation, graph recording) are
    untimed. Same prompt and token accounting as bench_device_engine."""
    import torch  # deferred: torch is needed only to compare with HF

    device = next(model.parameters()).device
    if device.type != "cuda":
        raise UserError("the static-cache + torch.compile comparison runs on CUDA only",
                        "use --device cuda on a GPU machine, or --compare hf on the CPU")
    batch, plen = prompt.shape
    _check(plen, new_tokens, batch, 0, repeats)
    ids = torch.from_numpy(np.ascontiguousarray(prompt, dtype=np.int64)).to(device)
    mask = torch.ones_like(ids)
    extra = {"cache_implementation": "static"} if static else {}

    def run():
        clock = _TokenClock()
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, streamer=clock, **extra)
        torch.cuda.synchronize()
        if out.shape[1] != plen + new_tokens:
            raise RuntimeError(f"generate returned {out.shape[1] - plen} of {new_tokens} tokens")
        first = clock.times[1]  # [0]: the prompt, [1]: token 1, ..., [-1]: end
        return first - start, clock.times[-1] - first

    for _ in range(3 if static else 1):
        run()
    runs = [run() for _ in range(repeats)]
    d, steps = statistics.median(r[1] for r in runs), new_tokens - 1
    prefill = statistics.median(r[0] for r in runs)
    return {"backend": "transformers-generate" + ("-static-compile" if static else ""), "batch": batch,
            "prompt_tokens": plen, "new_tokens": new_tokens, "repeats": repeats, "prefill_s": prefill,
            "prefill_tok_s": batch * plen / prefill, "decode_s": d, "decode_ms_per_token": 1e3 * d / steps,
            "decode_tok_s": batch * steps / d, "static_cache": static,
            "compiled": getattr(model, "_compiled_call", None) is not None,
            "device": "cuda", "device_name": device_name("cuda"), **rss_mib()}


def bench_hf(model, tokenizer=None, prompt_tokens: int = 128, new_tokens: int = 64, batch: int = 1,
             warmup: int = 1, repeats: int = 1, threads: int | None = None,
             prompt: np.ndarray | None = None) -> dict:
    """Benchmark a transformers causal LM in eager PyTorch with its KV cache, same method as
    bench_engine (cache handling through enginesmith.export.adapter)."""
    import torch  # deferred: torch and transformers are needed only to compare with HF

    from enginesmith.export import adapter  # deferred: imports torch and transformers

    if prompt is None:
        _check(prompt_tokens, new_tokens, batch, warmup, repeats)
        prompt = make_prompt(prompt_tokens, batch, model.config.vocab_size, tokenizer)
    _check(prompt.shape[1], new_tokens, prompt.shape[0], warmup, repeats)
    device = next(model.parameters()).device
    cuda = device.type == "cuda"

    def step(ids, mask, pos, cache):
        cache = adapter.make_cache(model.config, []) if cache is None else cache
        t = [torch.from_numpy(np.array(a, dtype=np.int64)).to(device) for a in (ids, mask, pos)]
        with torch.inference_mode():
            out = adapter.forward(model, *t, cache)
        logits = out.logits[:, -1:].float().cpu().numpy()  # .cpu() synchronizes on CUDA
        return logits, adapter.output_cache(out)

    old = torch.get_num_threads()
    torch.set_num_threads(threads or default_threads())
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        result = {"backend": "transformers-eager", **_run(step, prompt, new_tokens, warmup, repeats),
                  "threads": torch.get_num_threads()}
    finally:
        torch.set_num_threads(old)
    result.update(device=device.type, device_name=device_name(device.type), **rss_mib())
    if cuda:
        result["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return result


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def device_name(device: str) -> str:
    """Human name of "cpu" (the CPU model) or "cuda" (the GPU, e.g. "NVIDIA H100 80GB HBM3")."""
    if device == "cuda":
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.get_device_name(0)
        except ImportError:
            pass
        return "cuda"
    return cpu_name()


def measure_copy_bandwidth(size_mib: int = 256, repeats: int = 5, threads: int | None = None) -> dict:
    """Best-of-`repeats` memory copy bandwidth in GB/s (1e9 B/s), counting read + written bytes
    as STREAM's copy does. {"cpu_gbs", "cpu_threads", "cpu"} always; "cuda_gbs" and "cuda" when
    torch sees a GPU. CPU copies run in `threads` threads (numpy copyto releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    threads = threads or default_threads()
    n = size_mib * 2**20 // 8
    src, dst = np.ones(n), np.empty(n)
    bounds = np.linspace(0, n, threads + 1).astype(int)
    parts = [(dst[a:b], src[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats + 1):  # the first pass faults the pages in
            t = time.perf_counter()
            list(pool.map(lambda p: np.copyto(*p), parts))
            best = min(best, time.perf_counter() - t)
    result = {"cpu_gbs": 2 * src.nbytes / best / 1e9, "cpu_threads": threads, "cpu": cpu_name()}
    try:
        import torch

        if torch.cuda.is_available():
            a = torch.empty(4 * n, dtype=torch.float64, device="cuda")  # 4x: well past L2
            b = torch.empty_like(a)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(repeats + 1):
                start.record()
                b.copy_(a)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            result.update(cuda_gbs=2 * a.nbytes / min(times[1:]) / 1e9, cuda=torch.cuda.get_device_name(0))
    except ImportError:
        pass
    return result


def bandwidth_bound(weight_bytes: int, bandwidth_gbs: float, *, layers: int = 0, kv_heads: int = 0,
                    head_dim: int = 0, context: int = 0, batch: int = 1, kv_bytes: int = 4,
                    measured_tok_s: float | None = None) -> dict:
    """Upper bound on decode tokens/s if every step must read all weights once (shared by the
    batch) plus each row's K and V for `context` positions: bytes_per_step = weight_bytes +
    batch * layers * 2 * kv_heads * head_dim * context * kv_bytes; tok_s_bound = batch *
    bandwidth / bytes_per_step. With `measured_tok_s`, also the fraction of the bound reached."""
    kv = batch * layers * 2 * kv_heads * head_dim * context * kv_bytes
    per_step = weight_bytes + kv
    bound = batch * bandwidth_gbs * 1e9 / per_step
    out = {"weight_bytes": int(weight_bytes), "kv_bytes_per_step": int(kv), "bytes_per_step": int(per_step),
           "bandwidth_gbs": bandwidth_gbs, "tok_s_bound": bound, "ms_per_token_bound": 1e3 * batch / bound}
    if measured_tok_s is not None:
        out["fraction_of_bound"] = measured_tok_s / bound
    return out


def onnx_weight_bytes(onnx_path) -> int:
    """Bytes of the ONNX graph's weights a decode step reads: every initializer and Constant,
    except tables consumed only as a Gather's data input (an embedding lookup reads B rows)."""
    import onnx
    from onnx import helper

    model = onnx.load(str(onnx_path), load_external_data=False)
    graph = model.graph
    consumers: dict[str, list] = {}
    for node in graph.node:
        for k, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node.op_type, k))
    tensors = list(graph.initializer)
    tensors += [a.t for n in graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"]
    total = 0.0
    for t in tensors:
        uses = consumers.get(t.name, [])
        if uses and all(op == "Gather" and k == 0 for op, k in uses):
            continue
        bits = 4 if t.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4) else \
            8 * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        total += int(np.prod(t.dims, dtype=np.int64)) * bits / 8
    return int(total)


def torch_weight_bytes(model) -> int:
    """Bytes of a torch model's parameters read per decode step (tied tensors once; an input
    embedding not tied to the output head is skipped: a lookup reads only B rows)."""
    skip = set()
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if emb is not None and (head is None or head.weight.data_ptr() != emb.weight.data_ptr()):
        skip.add(emb.weight.data_ptr())
    seen, total = set(), 0
    for p in model.parameters():  # parameters() already yields a tied tensor once
        if p.data_ptr() not in seen and p.data_ptr() not in skip:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def bench_speculative(engine, drafter, prompt: np.ndarray, new_tokens: int, k: int = 4, repeats: int = 1,
                      stop_token_ids: tuple[int, ...] = ()) -> dict:
    """Greedy decoding of one prompt ([P] ids) plainly and with speculative decoding on the same
    engine: tok/s of each (median over `repeats` after one warm-up), speedup, whether the outputs
    are identical, acceptance rate and tokens per target call."""
    config = GenerationConfig(max_new_tokens=new_tokens, stop_token_ids=tuple(stop_token_ids))
    spec = sp.SpeculativeConfig(k=k)
    prompt = [int(t) for t in prompt]

    def plain():
        return [int(ids[0]) for ids, _ in generate_ids(engine, [prompt], config)]

    def speculative(stats):
        return list(sp.speculative_tokens(engine, drafter, prompt, config, spec, stats))

    def timed(fn, *a):
        t = time.perf_counter()
        out = fn(*a)
        return out, time.perf_counter() - t

    plain(), speculative(sp.SpeculativeStats())  # warm-up
    stats = sp.SpeculativeStats()
    runs_plain = [timed(plain) for _ in range(repeats)]
    runs_spec = [timed(speculative, stats if i == 0 else sp.SpeculativeStats()) for i in range(repeats)]
    ref, out = runs_plain[0][0], runs_spec[0][0]
    t_plain = statistics.median(r[1] for r in runs_plain)
    t_spec = statistics.median(r[1] for r in runs_spec)
    return {"drafter": type(drafter).__name__, "k": k, "new_tokens": len(ref), "identical": out == ref,
            "plain_tok_s": len(ref) / t_plain, "speculative_tok_s": len(out) / t_spec, "speedup": t_plain / t_spec,
            **stats.to_json()}
