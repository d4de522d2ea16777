"""The pass manager's output check for a paged-layout graph: compare it with the dense graph it came
from. `verify.compare` feeds both the same random tokens (a prefill, then single-token decode steps,
batch 2); the paged graph (cpu lowering) gets zeroed page pools bound as past input and present
output at once (the graph writes them in place) and each step's block_tables, context_lens and
slot_mapping from core/kv_layout.py (`paged_step`, the arithmetic runtime/kv/kv_paged.py follows).
Pages are handed out as a fresh block manager hands them out (1, 2, 3, ... on demand, row by row),
so a row's table is not contiguous once decode crosses a page, and every step passes `check_step`.
"""

from __future__ import annotations

import numpy as np

from enginesmith.core import io_names
from enginesmith.core.kv_layout import check_step, paged_step
from enginesmith.core.onnxruntime_flavour import onnxruntime as ort  # checked: one line if missing or mixed

_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def is_paged(session) -> bool:
    return io_names.BLOCK_TABLES in {i.name for i in session.get_inputs()}


def paged_steps(session, ids: np.ndarray, next_ids: np.ndarray) -> list[np.ndarray]:
    """Logits of a prefill of `ids` [B, S], then one decode step per column of `next_ids` [B, T],
    on a paged graph."""
    inputs = {i.name: i for i in session.get_inputs()}
    past = [n for n in inputs if io_names.is_past(n)]
    first = inputs[past[0]]
    page_size, kv_heads, head_dim = (int(d) for d in first.shape[1:])
    batch, seq = ids.shape
    num_pages = 1 + batch * -(-(seq + next_ids.shape[1]) // page_size)  # page 0: the null page
    pools = [np.zeros((num_pages, page_size, kv_heads, head_dim), _NP[first.type]) for _ in past]
    values = [ort.OrtValue.ortvalue_from_numpy(a, "cpu", 0) for a in pools]  # share the arrays' memory
    tables: list[list[int]] = [[] for _ in range(batch)]
    next_page = 1
    logits = []
    start = 0
    for step_ids in (ids, *np.split(next_ids, next_ids.shape[1], axis=1)):
        width = step_ids.shape[1]
        for row in tables:  # pages on demand, row by row, from a FIFO of 1 .. num_pages - 1
            while len(row) * page_size < start + width:
                row.append(next_page)
                next_page += 1
        assert next_page <= num_pages
        step = paged_step(tables, page_size, [start] * batch, [width] * batch, width, right_padded=False)
        check_step(step, num_pages, page_size)
        binding = session.io_binding()
        binding.bind_cpu_input(io_names.INPUT_IDS, np.ascontiguousarray(step_ids, dtype=np.int64))
        binding.bind_cpu_input(io_names.POSITION_IDS, np.ascontiguousarray(step.position_ids, dtype=np.int64))
        binding.bind_output(io_names.LOGITS, "cpu")
        for name, value in zip(past, values):
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(io_names.present_of(name), value)
        for name in io_names.PAGED_INPUTS:
            binding.bind_cpu_input(name, np.ascontiguousarray(getattr(step, name), dtype=np.int32))
        session.run_with_iobinding(binding)
        logits.append(binding.get_outputs()[0].numpy().astype(np.float32))
        start += width
    return logits
