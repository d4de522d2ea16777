"""The batcher's model over an ONNX Runtime paged graph: an OrtEngine and its PagedKVPool as the
ContinuousBatcher's `PagedModel` (runtime/decoding/batching.py), sampling on the host. The CUDA paged
engine (paged_cuda.py) is the other PagedModel."""

from __future__ import annotations

import numpy as np

from enginesmith.core.kv_layout import PagedStep
from enginesmith.runtime.decoding.sampling import sample
from enginesmith.runtime.kv.kv_paged import PagedKVPool


class OrtPagedModel:
    """An ONNX Runtime paged graph (OrtEngine) and its PagedKVPool as the ContinuousBatcher's
    `PagedModel`: a step is one `forward`; tokens are sampled on the host, each with noise keyed by
    (its request's seed, its index), so a request's draws do not depend on its batch-mates."""

    def __init__(self, engine, num_pages: int, max_positions: int | None = None):
        self.engine = engine
        self.pool = PagedKVPool.for_session(engine.session, num_pages, engine.device)
        self.num_pages, self.page_size = self.pool.num_pages, self.pool.page_size
        self.max_chunk = None
        self.max_positions = max_positions  # None: the pool bounds a request

    def copy_pages(self, copies) -> None:
        self.pool.copy_pages(copies)

    def run(self, ids: np.ndarray, step: PagedStep, picks) -> list[int]:
        self.pool.prepare(step)
        logits = self.engine.forward(ids, np.ones_like(ids), step.position_ids, self.pool)  # [B, S, V]
        tokens = []
        for pick in picks:
            seen = [np.asarray(pick.history)] if pick.history is not None else None
            rng = np.random.default_rng([pick.seed, pick.index])
            tokens.append(int(sample(logits[pick.row, pick.col][None], pick.sampling, rng, seen)[0]))
        return tokens
