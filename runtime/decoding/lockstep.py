"""generate.generate_ids over a paged engine: prompts as requests of one ContinuousBatcher, their tokens
yielded in lockstep (token i of every row once all rows have it)."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator, Sequence

import numpy as np

from enginesmith.runtime.decoding.batching import ContinuousBatcher, PagedModel, SchedulerConfig
from enginesmith.runtime.decoding.sampling import SamplingParams


def batched_ids(model: PagedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                stop_token_ids: Sequence[int] = (), sampling: SamplingParams | None = None,
                max_batch: int = 64) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """generate.generate_ids over a PagedModel: the prompts run as requests of one batcher, and
    token i of every row is yielded once all rows have it (finished rows repeat their last token,
    flagged finished). Row r's sampling seed is seed + r (rows with equal prompts differ)."""
    sampling = sampling or SamplingParams()
    batcher = ContinuousBatcher(model, SchedulerConfig(max_batch=min(max_batch, len(prompts)), max_tokens=2048,
                                                       chunk=model.max_chunk or 256))
    rows = [batcher.add_request(p, max_new_tokens, stop_token_ids,
                                replace(sampling, seed=None if sampling.seed is None else sampling.seed + r))
            for r, p in enumerate(prompts)]
    try:
        yield from _lockstep(batcher, rows, max_new_tokens)
    finally:
        batcher.close()  # a step still in flight (async) ends with the generator


def _lockstep(batcher: ContinuousBatcher, rows: list[str], max_new_tokens: int
              ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    emitted = 0
    while True:
        reqs = [batcher.request(rid) for rid in rows]
        ready = min(len(r.output) if r.finish_reason is None else max_new_tokens for r in reqs)
        while emitted < min(ready, max_new_tokens):
            ids = np.array([r.output[min(emitted, len(r.output) - 1)] for r in reqs], np.int64)
            finished = np.array([emitted >= len(r.output) for r in reqs])
            yield ids, finished
            emitted += 1
            if all(r.finish_reason is not None and emitted >= len(r.output) for r in reqs):
                return
        if emitted >= max_new_tokens or not batcher.has_unfinished:
            return
        batcher.step()
