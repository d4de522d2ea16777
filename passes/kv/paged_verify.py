"""The pass manager's output check for a paged-layout graph: compare it with the dense graph it came
from. `verify.compare` feeds both the same random tokens (a prefill, then single-token decode steps,
batch 2); the paged graph (cpu lowering) is driven by the runtime's own PagedKVCache: its block
manager allocates the pages, its pools are bound as past input and present output at once (the
graph writes them in place) and it prepares block_tables, context_lens and slot_mapping per step.
"""

from __future__ import annotations

import numpy as np


def is_paged(session) -> bool:
    return "block_tables" in {i.name for i in session.get_inputs()}


def paged_steps(session, ids: np.ndarray, next_ids: np.ndarray) -> list[np.ndarray]:
    """Logits of a prefill of `ids` [B, S], then one decode step per column of `next_ids` [B, T],
    on a paged graph."""
    from enginesmith.runtime.kv_paged import PagedKVCache

    batch, seq = ids.shape
    cache = PagedKVCache.for_session(session, batch, "cpu", max_tokens=seq + next_ids.shape[1])
    logits = []
    start = 0
    for step_ids in (ids, *np.split(next_ids, next_ids.shape[1], axis=1)):
        start += step_ids.shape[1]
        feeds = cache.feeds(np.ones((batch, start), np.int64), np.zeros_like(step_ids))
        binding = session.io_binding()
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(step_ids, dtype=np.int64))
        for name, array in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(array, dtype=np.int64))
        binding.bind_output("logits", "cpu")
        cache.bind(binding, "cpu")
        session.run_with_iobinding(binding)
        cache.advance(None)
        logits.append(binding.get_outputs()[0].numpy().astype(np.float32))
    return logits
