"""Shared checks of the quantized-KV tests (dense and paged engines): real text, token ids of Pride and
Prejudice in an engine's own tokenizer (the scales are calibrated on this text; random ids saturate
some channels), and the one tolerance of int8 / fp8 logits against fp16 KV's."""

from __future__ import annotations

import numpy as np


def austen_tokens(engine_dir, start: int, count: int) -> np.ndarray:
    """Tokens start .. start + count - 1 of Pride and Prejudice, by the tokenizer in `engine_dir`."""
    from transformers import AutoTokenizer  # deferred: heavy; only the tests that read text need it

    from enginesmith.models.corpus import austen_text, tokenize

    tok = AutoTokenizer.from_pretrained(str(engine_dir / "tokenizer"))
    return tokenize(tok, austen_text("prideprejudice"), max_tokens=start + count)[start:]


# kv_dtype, max |diff|, rms diff of the logits against the fp16-KV engine's (tiny:llama-hd64, 40 tokens:
# measured int8 0.047 / 0.0071, fp8 0.112 / 0.018; about 2x headroom)
LOGIT_TOLERANCES = [("int8", 0.1, 0.015), ("fp8", 0.25, 0.04)]


def assert_close_to_fp16(got: np.ndarray, ref: np.ndarray, max_tol: float, rms_tol: float) -> None:
    """Quantized-KV logits are finite, differ from fp16 KV's (the codes are used) and lie within the tolerance."""
    diff = got - ref
    assert np.isfinite(got).all()
    assert 0 < np.abs(diff).max() <= max_tol and np.sqrt((diff ** 2).mean()) <= rms_tol, (
        float(np.abs(diff).max()), float(np.sqrt((diff ** 2).mean())))
