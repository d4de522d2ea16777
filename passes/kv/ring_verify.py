"""The pass manager's output check for a ring-layout graph: compare it with the dense graph it came
from. Before any eviction the two must agree, so `verify.compare` feeds both the same random tokens
(a prefill, then single-token decode steps, batch 2), fewer than the ring holds; the ring graph is
driven by the runtime's own RingKVCache policy (its feeds), with plain numpy past/present arrays.
"""

from __future__ import annotations

import numpy as np


def is_ring(session) -> bool:
    return "write_indices" in {i.name for i in session.get_inputs()}


def ring_steps(session, ids: np.ndarray, next_ids: np.ndarray) -> list[np.ndarray]:
    """Logits of a prefill of `ids` [B, S], then one decode step per column of `next_ids` [B, T],
    on a ring graph."""
    from enginesmith.runtime.kv_ring import RingKVCache

    inputs = {i.name: i for i in session.get_inputs()}
    outputs = [o.name for o in session.get_outputs()]
    cache = RingKVCache.for_session(session, ids.shape[0], "cpu")
    past = {n: np.zeros([ids.shape[0]] + [int(d) for d in inputs[n].shape[1:]],
                        np.float16 if "float16" in inputs[n].type else np.float32)
            for n in inputs if n.startswith(("past_key_values.", "past_sinks."))}
    if ids.shape[1] + next_ids.shape[1] > cache.capacity:
        from enginesmith.core.errors import UserError

        raise UserError(f"the ring holds {cache.capacity} tokens, fewer than the {ids.shape[1] + next_ids.shape[1]} "
                        "the output check feeds before any eviction",
                        "use a ring of at least 8 tokens (sinks + window)")
    logits = []
    for step_ids in (ids, *np.split(next_ids, next_ids.shape[1], axis=1)):
        feeds = cache.feeds(np.ones_like(step_ids), step_ids)
        out = dict(zip(outputs, session.run(outputs, {"input_ids": step_ids, **feeds, **past})))
        cache.advance([])
        logits.append(out["logits"].astype(np.float32))
        past = {n: out[n.replace("past_key_values.", "present.").replace("past_sinks.", "present_sinks.")]
                for n in past}
    return logits
