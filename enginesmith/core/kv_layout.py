"""What the ring and paged KV graphs are fed per step: the pure slot and index arithmetic.

The kv_ring and kv_paged passes define these inputs (core/io_names.py names them), the runtime's
caches (runtime/kv/kv_ring.py, runtime/kv/kv_paged.py) compute them for real traffic and the passes'
output checks (passes/kv/ring_verify.py, paged_verify.py) compute them to compare a rewritten graph
with its dense source. It sits in core, below both, because it is part of the graph's I/O contract,
not of a cache implementation: numpy in, numpy out, no session, no buffers, no block manager.

Dimension legend: B rows, S new tokens, s sinks, w window, C = s + w ring slots, MB pages per row in
a block table, BS page size.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from enginesmith.core import io_names
from enginesmith.core.errors import UserError

# ---- ring (StreamingLLM sinks + window; policy in runtime/kv/kv_ring.py's module doc) -----------------


def ring_feeds(count: np.ndarray, sinks: int, window: int,
               real: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The ring graph's inputs for a step whose columns are `real` [B, S] (False = left padding),
    for rows that hold `count` [B] tokens before it; and the rows' token counts after it. The caller
    checks the padding rules and that S <= window."""
    batch, cols = real.shape
    new = real.sum(axis=1).astype(np.int64)
    pads = cols - new
    s, w, c = sinks, window, sinks + window
    start = count - pads                            # token number of column 0 (< 0 for pads)
    total = count + new                             # tokens after this step
    in_window = np.maximum(total - s, 0)            # window tokens ever written
    oldest = np.maximum(in_window - w, 0)           # window number of the oldest one kept

    slots = np.arange(w)[None, :]                                           # [1, w]
    last = in_window[:, None] - 1 - slots                                   # [B, w]
    u = slots + w * np.floor_divide(np.maximum(last, 0), w)                 # newest token in slot
    win_occupied = last >= 0
    win_pos = np.where(win_occupied, s + u - oldest[:, None], 0)
    sink_occupied = np.arange(s)[None, :] < np.minimum(total, s)[:, None]   # [B, s]
    occupied = np.concatenate([sink_occupied, win_occupied], axis=1).astype(np.int64)
    cache_pos = np.concatenate([np.where(sink_occupied, np.arange(s)[None, :], 0), win_pos], axis=1)

    t = start[:, None] + np.arange(cols)[None, :]                           # [B, S] token numbers
    query_pos = np.where(t < s, t, s + (t - s) - oldest[:, None])
    query_pos = np.where(real, query_pos, 0)
    feeds = {io_names.ATTENTION_MASK: occupied, io_names.POSITION_IDS: query_pos.astype(np.int64),
             io_names.CACHE_POSITIONS: cache_pos.astype(np.int64),
             io_names.WRITE_INDICES: np.mod(start - s, w).astype(np.int64)}
    if s:
        j = np.arange(s)[None, :]
        fills = (j >= count[:, None]) & (j < total[:, None])
        feeds[io_names.SINK_SOURCES] = np.where(fills, j - start[:, None], -1).astype(np.int64)
    assert occupied.shape == (batch, c) and np.all(cache_pos < c)
    return feeds, total


# ---- paged (block tables, context lengths, slot mapping; plugins/paged_attention's layout) ---------


@dataclass(frozen=True)
class PagedStep:
    block_tables: np.ndarray   # [B, MB] int32
    context_lens: np.ndarray   # [B] int32
    slot_mapping: np.ndarray   # [B, S] int32
    position_ids: np.ndarray   # [B, S] int64


def check_step(step: PagedStep, num_pages: int, page_size: int) -> None:
    """Refuse a step the kernels would answer wrongly: a page outside the pool, a context outside
    the block table, a slot that is not where the table puts that position."""
    tables, ctx, slots = step.block_tables, step.context_lens, step.slot_mapping
    batch, width = slots.shape
    if tables.ndim != 2 or tables.shape[0] != batch or ctx.shape != (batch,) or step.position_ids.shape != slots.shape:
        raise UserError(f"paged step shapes disagree: block_tables {tables.shape}, context_lens {ctx.shape}, "
                        f"slot_mapping {slots.shape}, position_ids {step.position_ids.shape}",
                        "give block_tables [B, MB], context_lens [B], slot_mapping and position_ids [B, S]")
    bad = np.argwhere((tables < 0) | (tables >= num_pages))
    if len(bad):
        row, col = bad[0]
        raise UserError(f"block table out of range: row {row} entry {col} is page {tables[row, col]}, the pool "
                        f"has pages 0..{num_pages - 1}", "pad block tables with 0 (the null page) and "
                        "allocate pages through the block manager")
    capacity = tables.shape[1] * page_size
    bad = np.flatnonzero((ctx < 1) | (ctx > capacity))
    if len(bad):
        row = bad[0]
        raise UserError(f"context length {ctx[row]} of row {row} is outside [1, {capacity}] (block table of "
                        f"{tables.shape[1]} pages of {page_size})", "widen the block table to cover the context")
    bad = np.argwhere((slots < -1) | (slots >= num_pages * page_size))
    if len(bad):
        row, col = bad[0]
        raise UserError(f"slot mapping out of range: row {row} column {col} is slot {slots[row, col]}, the pool "
                        f"has slots 0..{num_pages * page_size - 1}", "use page * page_size + offset, or -1 for padding")
    pos = ctx[:, None].astype(np.int64) - width + np.arange(width)[None, :]              # [B, S]
    real = slots >= 0
    if np.any(real & (pos < 0)):
        row, col = np.argwhere(real & (pos < 0))[0]
        raise UserError(f"row {row} column {col} writes a token at position {pos[row, col]} < 0",
                        "context_lens must count the row's real new tokens")
    page = np.take_along_axis(tables, np.clip(pos // page_size, 0, tables.shape[1] - 1), axis=1)
    expected = page * page_size + pos % page_size
    bad = np.argwhere(real & (slots != expected))
    if len(bad):
        row, col = bad[0]
        raise UserError(f"row {row} column {col} writes slot {slots[row, col]} but its position {pos[row, col]} "
                        f"lives at slot {expected[row, col]} of its block table",
                        "compute the slot mapping from the block table")


def paged_step(block_ids: list[list[int]], page_size: int, starts: list[int], counts: list[int], width: int,
               right_padded: bool = True) -> PagedStep:
    """The step where row r writes counts[r] tokens from position starts[r] in `width` columns, padded
    on the right (or the left), its positions living in the pages `block_ids[r]` (in order; they must
    cover starts[r] + counts[r] positions). Tables are padded with page 0, the null page."""
    batch, bs = len(block_ids), page_size
    starts_a = np.asarray(starts, np.int64).reshape(batch)
    counts_a = np.asarray(counts, np.int64).reshape(batch)
    ctx = (starts_a + (width if right_padded else counts_a)).astype(np.int32)
    pages = max(1, int(-(-int(ctx.max(initial=1)) // bs)))
    tables = np.zeros((batch, pages), np.int32)  # 0: the null page
    lengths = np.array([len(ids) for ids in block_ids], np.int64).reshape(batch)
    if lengths.any():  # one flat list of ints: numpy converts it at once (a per-row array costs a call per row)
        rows = block_ids if lengths.max() <= pages else [ids[:pages] for ids in block_ids]
        held = np.arange(pages)[None, :] < np.minimum(lengths, pages)[:, None]
        tables[held] = list(itertools.chain.from_iterable(rows))
    # column c of row r holds position start + c - pad (pad = 0 right-padded, width - n left-padded)
    pad = np.zeros(batch, np.int64) if right_padded else width - counts_a
    col = np.arange(width)[None, :]
    pos = starts_a[:, None] + col - pad[:, None]                                   # [B, S]
    real = (col >= pad[:, None]) & (col < (pad + counts_a)[:, None])
    page = np.take_along_axis(tables, np.clip(pos // bs, 0, pages - 1), axis=1)
    slots = np.where(real, page.astype(np.int64) * bs + pos % bs, -1).astype(np.int32)
    positions = np.where(real, pos, 0)
    return PagedStep(tables, ctx, slots, positions)


__all__ = ["ring_feeds", "PagedStep", "check_step", "paged_step"]
