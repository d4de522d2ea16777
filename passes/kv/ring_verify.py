"""The pass manager's output check for a ring-layout graph: compare it with the dense graph it came
from. Before any eviction the two must agree, so `verify.compare` feeds both the same random tokens
(a prefill, then single-token decode steps, batch 2), fewer than the ring holds; the ring graph is fed
by the ring policy's own arithmetic (core/kv_layout.py: `ring_feeds`, the one runtime/kv/kv_ring.py's
RingKVCache follows), with plain numpy past/present arrays.
"""

from __future__ import annotations

import numpy as np

from enginesmith.core import io_names
from enginesmith.core.errors import UserError
from enginesmith.core.kv_layout import ring_feeds


def is_ring(session) -> bool:
    return io_names.WRITE_INDICES in {i.name for i in session.get_inputs()}


def ring_steps(session, ids: np.ndarray, next_ids: np.ndarray) -> list[np.ndarray]:
    """Logits of a prefill of `ids` [B, S], then one decode step per column of `next_ids` [B, T],
    on a ring graph."""
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = [o.name for o in session.get_outputs()]
    batch = ids.shape[0]
    past = {n: np.zeros([batch] + [int(d) for d in inputs[n].shape[1:]],
                        np.float16 if "float16" in inputs[n].type else np.float32)
            for n in inputs if io_names.is_past(n) or io_names.is_past_sinks(n)}
    window = next(int(inputs[n].shape[2]) for n in inputs if io_names.is_past(n))
    sinks = next((int(inputs[n].shape[2]) for n in inputs if io_names.is_past_sinks(n)), 0)
    if ids.shape[1] + next_ids.shape[1] > sinks + window:
        raise UserError(f"the ring holds {sinks + window} tokens, fewer than the {ids.shape[1] + next_ids.shape[1]} "
                        "the output check feeds before any eviction",
                        "use a ring of at least 8 tokens (sinks + window)")
    if ids.shape[1] > window:  # the ring writes a chunk before attending: at most a window of tokens
        raise UserError(f"a chunk of {ids.shape[1]} tokens does not fit the KV window of {window}",
                        "check with a shorter prefill or build with a larger window")
    count = np.zeros(batch, np.int64)  # tokens each row holds
    logits = []
    for step_ids in (ids, *np.split(next_ids, next_ids.shape[1], axis=1)):
        feeds, count = ring_feeds(count, sinks, window, np.ones(step_ids.shape, bool))
        out = dict(zip(outputs, session.run(outputs, {io_names.INPUT_IDS: step_ids, **feeds, **past})))
        logits.append(out[io_names.LOGITS].astype(np.float32))
        past = {n: out[io_names.present_of(n)] for n in past}
    return logits
