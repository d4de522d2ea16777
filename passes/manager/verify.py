"""The verifier run between passes: ONNX checker, strict shape inference, and output comparison.

`compare` runs two graphs with the exported KV-cache signature on the same random tokens, as the
runtime would: a prefill from an empty cache, then single-token decode steps that feed each graph
its *own* present KV. Only logits are compared, so passes may change what the cache holds
(smoothing through V stores V / s) as long as what the model predicts is unchanged. ORT runs with
graph optimizations off, so the comparison is of the graphs' meaning, not of ORT's rewrites of them.

A graph whose KV layout a pass changed is driven by that layout's cache policy instead of the dense
past/present protocol: a ring graph by ring_verify, a paged graph by paged_verify.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from enginesmith.core import io_names
from enginesmith.passes.kv import paged_verify, ring_verify
from enginesmith.plugins import ort_ops


class PassCheckError(RuntimeError):
    """A pass produced an invalid graph, or an exact pass changed the outputs (a bug, not user error)."""


def check_graph(path: Path) -> None:
    """ONNX checker and strict shape inference on the file at `path` (external data not loaded)."""
    import onnx

    try:
        onnx.checker.check_model(str(path))
        proto = onnx.load(str(path), load_external_data=False)
        onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise PassCheckError(f"{path.parent.name}: the graph is invalid: {exc}") from exc


@dataclass(frozen=True)
class Comparison:
    max_diff: float
    tolerance: float
    scale: float    # max |logit| of the reference

    @property
    def ok(self) -> bool:
        return bool(self.max_diff <= self.tolerance)


def _session(path: Path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    ort_ops.register_for(opts, path)
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _steps(session, ids: np.ndarray, next_ids: np.ndarray) -> list[np.ndarray]:
    """Logits of a prefill of `ids` [B, S], then one decode step per column of `next_ids` [B, T]."""
    inputs = {i.name: i for i in session.get_inputs()}
    past = [n for n in inputs if io_names.is_past(n)]
    outputs = [o.name for o in session.get_outputs()]
    presents = [n for n in outputs if io_names.is_present(n)]
    batch = ids.shape[0]
    feeds = {n: np.zeros((batch, int(inputs[n].shape[1]), 0, int(inputs[n].shape[3])),
                         np.float16 if "float16" in inputs[n].type else np.float32) for n in past}
    logits = []
    start = 0
    for step_ids in (ids, *np.split(next_ids, next_ids.shape[1], axis=1)):
        length = step_ids.shape[1]
        feeds.update({io_names.INPUT_IDS: step_ids,
                      io_names.ATTENTION_MASK: np.ones((batch, start + length), np.int64),
                      io_names.POSITION_IDS: np.broadcast_to(np.arange(start, start + length), (batch, length)).copy()})
        out = dict(zip(outputs, session.run(outputs, feeds)))
        logits.append(out[io_names.LOGITS].astype(np.float32))
        feeds.update({p: out[q] for p, q in zip(past, presents)})
        start += length
    return logits


def compare(reference: Path, candidate: Path, rtol: float = 1e-3, seed: int = 0,
            batch: int = 2, seq: int = 4, decode: int = 3) -> Comparison | None:
    """Max |logits difference| between two graphs over a prefill of `seq` tokens and `decode`
    single-token steps, or None when the graphs do not have the exported KV-cache signature (nothing
    to feed them). The default 4 + 3 = 7 tokens cross a page of 4 during decode and fit any ring of
    7 slots or more (the ring check must not evict)."""
    ref = _session(reference)
    names = {i.name for i in ref.get_inputs()}
    if not {io_names.INPUT_IDS, io_names.ATTENTION_MASK, io_names.POSITION_IDS} <= names:
        return None
    vocab = ref.get_outputs()[0].shape[-1]
    vocab = vocab if isinstance(vocab, int) else 1000
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(batch, seq), dtype=np.int64)
    next_ids = rng.integers(0, vocab, size=(batch, decode), dtype=np.int64)
    expected = _layout_steps(ref)(ref, ids, next_ids)   # a ring graph's own passes (kv_h2o) compare ring to ring
    del ref
    session = _session(candidate)
    got = _layout_steps(session)(session, ids, next_ids)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(expected, got, strict=True))
    scale = max(float(np.abs(a).max()) for a in expected)
    return Comparison(diff, rtol * max(scale, 1.0), scale)


def _layout_steps(session):
    """How to drive `session`: by its KV layout's cache policy (ring, paged) or the dense protocol."""
    if ring_verify.is_ring(session):
        return ring_verify.ring_steps
    if paged_verify.is_paged(session):
        return paged_verify.paged_steps
    return _steps
