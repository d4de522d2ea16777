"""Perplexity of a causal LM on a token sequence, for any backend that maps ids to logits.

Two protocols; the token sequence is always the text's tokens without BOS/EOS, and every window is
run from an empty KV cache (positions 0..W-1). nll is the mean negative log-likelihood in nats per
scored token, ppl = exp(nll); sums in float64.

- `harness` (lm-evaluation-harness's `loglikelihood_rolling`, the default of `eval ppl`): a prefix
  token p (BOS where the tokenizer adds one, else EOS: `prefix_token`) is put in front of the text,
  so every text token is scored, exactly once, the first one conditioned on p alone. The first window
  reads p and `window`-1 text tokens and scores `window` tokens; each later window scores the next
  `stride` tokens (default `window`: disjoint windows, the harness's context_len=1) and reads the
  `window` tokens that end just before its last target, so its first target sees `window`-`stride`+1
  tokens of context (1 at the default stride) and the last window reads a full window too. Only the
  first window reads p. A text of n tokens scores n tokens.
- `windows` (the protocol of every figure before session 14): no prefix token; windows of `window`
  tokens whose first token has no context and is never predicted, so a window of W tokens scores at
  most W-1 tokens. `stride` = window gives non-overlapping windows [0,W), [W,2W), ...; a shorter
  stride gives the sliding evaluation of the Hugging Face perplexity guide: windows start every
  `stride` tokens and each scores only the tokens no earlier window scored (all but token 0). The
  last window ends at the last token (it may be shorter than `window`).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from enginesmith.core.errors import UserError
from enginesmith.core.progress import bar as progress_bar

LogitsFn = Callable[[np.ndarray], np.ndarray]  # ids int64 [1, W] -> logits [1, W, V]
PROTOCOLS = ("harness", "windows")


def spans(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """`windows` protocol: (begin, end, first_scored) of every window over n tokens; the model reads
    [begin, end) and the targets are [first_scored, end)."""
    out, prev_end, begin = [], 0, 0
    while True:
        end = min(begin + window, n)
        first = max(begin + 1, prev_end)
        if end > first:
            out.append((begin, end, first))
        prev_end = end
        if end >= n:
            return out
        begin += stride


def harness_spans(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """`harness` protocol over [prefix] + n text tokens (text token i at position i+1): (begin, end,
    first) of every window; the model reads [begin, end-1) (at most `window` tokens, the prefix only
    in the first window) and the targets are [first, end). Targets cover 1..n, each exactly once."""
    end = min(window, n) + 1
    out = [(0, end, 1)]
    while end <= n:
        new_end = min(end + stride, n + 1)
        out.append((new_end - 1 - window, new_end, end))
        end = new_end
    return out


def prefix_token(tokenizer) -> tuple[int, str, str]:
    """The harness protocol's prefix token as (id, "bos" | "eos", its text): BOS when the tokenizer
    puts it in front of a text it encodes with special tokens, else EOS (the harness's EOT fallback).
    UserError when the tokenizer adds no BOS and has no EOS."""
    bos = tokenizer.bos_token_id
    if bos is not None:
        probe = tokenizer("a", add_special_tokens=True)["input_ids"]
        if len(probe) > 0 and probe[0] == bos:
            return int(bos), "bos", tokenizer.bos_token
    if tokenizer.eos_token_id is None:
        raise UserError("the tokenizer adds no BOS and has no EOS token for the harness protocol's prefix",
                        "use --protocol windows")
    return int(tokenizer.eos_token_id), "eos", tokenizer.eos_token


def _token_nll(logits: np.ndarray, targets: np.ndarray) -> float:
    """Sum over rows of -log softmax(logits[row])[targets[row]], in float64, 128 rows at a time."""
    total = 0.0
    for i in range(0, len(targets), 128):
        x = logits[i:i + 128].astype(np.float64)
        m = x.max(axis=-1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=-1))
        total += float((lse - x[np.arange(len(x)), targets[i:i + 128]]).sum())
    return total


def _checked_ids(token_ids, window: int, stride: int, protocol: str, prefix: int | None) -> np.ndarray:
    """The token ids as 1-D int64 after the argument checks that `perplexity` promises (UserError)."""
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise UserError(f"token ids must be a 1-D integer sequence, got shape {ids.shape} {ids.dtype}",
                        "pass the tokenizer's input_ids for one text")
    if protocol not in PROTOCOLS:
        raise UserError(f"unknown perplexity protocol {protocol!r}", f"use one of: {', '.join(PROTOCOLS)}")
    if protocol == "harness" and (prefix is None or prefix < 0):
        raise UserError(f"the harness protocol needs a prefix token id >= 0, got {prefix}",
                        "pass prefix_token=perplexity.prefix_token(tokenizer)[0]")
    if window < 2:
        raise UserError(f"window {window} is too small", "use a window of at least 2 tokens")
    if not 1 <= stride <= window:
        raise UserError(f"stride {stride} is outside [1, window={window}]",
                        "use a stride between 1 and the window (window = non-overlapping)")
    if len(ids) < window:
        raise UserError(f"the text has {len(ids)} tokens, fewer than one window of {window}",
                        "use a longer text or a smaller window")
    if ids.min() < 0:
        raise UserError("token ids must not be negative", "pass the tokenizer's input_ids")
    return ids.astype(np.int64)


def perplexity(logits_fn: LogitsFn, token_ids, window: int = 1024, stride: int | None = None,
               progress: bool = True, protocol: str = "windows", prefix_token: int | None = None) -> dict:
    """Perplexity of `token_ids` (1-D ints, no BOS) under `logits_fn` with `protocol` (the module doc
    says what each scores; `harness` needs `prefix_token`, an id).

    Returns {"ppl", "nll" (mean nats/token), "tokens" (scored), "windows", "window", "stride",
    "protocol", "prefix_token_id" (None for `windows`)}, all plain Python values. Raises UserError
    for an unknown protocol, window < 2, a stride outside [1, window], fewer tokens than one window,
    or token ids (the prefix included) outside the model's vocabulary.
    """
    stride = window if stride is None else stride
    ids = _checked_ids(token_ids, window, stride, protocol, prefix_token)
    if protocol == "harness":  # positions shift by one: the prefix token is position 0
        seq, plan, trim = np.concatenate([[prefix_token], ids]), harness_spans(len(ids), window, stride), 1
    else:
        seq, plan, trim = ids, spans(len(ids), window, stride), 0
    total, count = 0.0, 0
    for begin, end, first in progress_bar(iterable=plan, desc="perplexity", unit="window", disable=not progress,
                                          leave=False):
        inputs = seq[begin:end - trim]  # harness: the last target is predicted from the input's last logit
        logits = np.asarray(logits_fn(inputs[None]))
        if logits.ndim != 3 or logits.shape[:2] != (1, len(inputs)):
            raise RuntimeError(f"logits_fn returned shape {logits.shape} for ids [1, {len(inputs)}]")
        targets = seq[first:end]
        top = max(int(targets.max()), int(inputs.max()))
        if top >= logits.shape[2]:
            raise UserError(f"token id {top} is outside the model's vocabulary of {logits.shape[2]}",
                            "tokenize with the model's own tokenizer")
        total += _token_nll(logits[0, first - 1 - begin:end - 1 - begin], targets)
        count += len(targets)
    nll = total / count
    return {"ppl": math.exp(nll), "nll": nll, "tokens": count, "windows": len(plan), "window": window,
            "stride": stride, "protocol": protocol,
            "prefix_token_id": int(prefix_token) if protocol == "harness" else None}


def ort_logits_fn(engine) -> LogitsFn:
    """logits_fn over an OrtEngine: every call runs the window as a prefill from a fresh cache."""
    def fn(ids: np.ndarray) -> np.ndarray:
        batch, seq = ids.shape
        mask = np.ones((batch, seq), dtype=np.int64)
        pos = np.broadcast_to(np.arange(seq, dtype=np.int64), (batch, seq))
        return engine.forward(ids, mask, pos, engine.new_cache(batch))
    return fn


def torch_logits_fn(model) -> LogitsFn:
    """logits_fn over a transformers causal LM (no cache, positions 0..W-1), fp32 numpy out."""
    import torch

    def fn(ids: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            t = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
            out = model(input_ids=t, attention_mask=torch.ones_like(t), use_cache=False)
        return out.logits.float().numpy()
    return fn
