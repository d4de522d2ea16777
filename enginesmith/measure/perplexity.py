"""Perplexity of a causal LM on a token sequence, for any backend that maps ids to logits.

Method (the convention of the reference figures in facts.md):
- no BOS is added: the token sequence is the text's tokens as they are;
- windows of `window` tokens, each run from an empty KV cache; the first token of a window has no
  context and is never predicted, so a window of W tokens scores at most W-1 tokens;
- `stride=None` (or = window) gives non-overlapping windows [0,W), [W,2W), ...; a shorter
  `stride` gives the sliding evaluation of the Hugging Face perplexity guide: windows start every
  `stride` tokens and each scores only the tokens not scored by an earlier window, so every scored
  token sees up to W-1 tokens of context;
- the last window ends at the last token (it may be shorter than `window` when the length is not a
  multiple of the stride); truncate `token_ids` yourself to score whole windows only;
- nll is the mean negative log-likelihood in nats per scored token, ppl = exp(nll); sums in float64.
"""

from __future__ import annotations

import math
import sys
from typing import Callable

import numpy as np

from enginesmith.core.errors import UserError

LogitsFn = Callable[[np.ndarray], np.ndarray]  # ids int64 [1, W] -> logits [1, W, V]


def spans(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) of every window over n tokens; targets are [first_scored, end)."""
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


def _token_nll(logits: np.ndarray, targets: np.ndarray) -> float:
    """Sum over rows of -log softmax(logits[row])[targets[row]], in float64, 128 rows at a time."""
    total = 0.0
    for i in range(0, len(targets), 128):
        x = logits[i:i + 128].astype(np.float64)
        m = x.max(axis=-1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=-1))
        total += float((lse - x[np.arange(len(x)), targets[i:i + 128]]).sum())
    return total


def perplexity(logits_fn: LogitsFn, token_ids, window: int = 1024, stride: int | None = None,
               progress: bool = True) -> dict:
    """Perplexity of `token_ids` (1-D ints) under `logits_fn` (see the module doc for the method).

    Returns {"ppl", "nll" (mean nats/token), "tokens" (scored), "windows", "window", "stride"},
    all plain Python numbers. Raises UserError for window < 2, a stride outside [1, window], fewer
    tokens than one window, or token ids outside the model's vocabulary.
    """
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise UserError(f"token ids must be a 1-D integer sequence, got shape {ids.shape} {ids.dtype}",
                        "pass the tokenizer's input_ids for one text")
    ids = ids.astype(np.int64)
    if window < 2:
        raise UserError(f"window {window} is too small", "use a window of at least 2 tokens")
    stride = window if stride is None else stride
    if not 1 <= stride <= window:
        raise UserError(f"stride {stride} is outside [1, window={window}]",
                        "use a stride between 1 and the window (window = non-overlapping)")
    if len(ids) < window:
        raise UserError(f"the text has {len(ids)} tokens, fewer than one window of {window}",
                        "use a longer text or a smaller window")
    if ids.min() < 0:
        raise UserError("token ids must not be negative", "pass the tokenizer's input_ids")
    from tqdm import tqdm

    plan = spans(len(ids), window, stride)
    total, count = 0.0, 0
    for begin, end, first in tqdm(plan, desc="perplexity", unit="window", file=sys.stderr,
                                  disable=not progress, leave=False):
        logits = np.asarray(logits_fn(ids[None, begin:end]))
        if logits.ndim != 3 or logits.shape[:2] != (1, end - begin):
            raise RuntimeError(f"logits_fn returned shape {logits.shape} for ids [1, {end - begin}]")
        vocab = logits.shape[2]
        targets = ids[first:end]
        if targets.max() >= vocab:
            raise UserError(f"token id {int(targets.max())} is outside the model's vocabulary of {vocab}",
                            "tokenize with the model's own tokenizer")
        total += _token_nll(logits[0, first - 1 - begin:end - 1 - begin], targets)
        count += len(targets)
    nll = total / count
    return {"ppl": math.exp(nll), "nll": nll, "tokens": count, "windows": len(plan),
            "window": window, "stride": stride}


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
