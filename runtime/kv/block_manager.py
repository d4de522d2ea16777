"""Paged KV block manager in vLLM v1's shape, scaled down (vllm/v1/core/block_pool.py,
kv_cache_manager.py): a front door returning immutable results, a per-request record, a block pool.

    KVCacheManager ─ allocate_slots(req, n) ─▶ KVCacheBlocks(block_ids, copies) | None (out of blocks)
         │  prefix hits (get_computed_blocks), fork, copy-on-write, free on finish
         ▼
    BlockPool ─ blocks[0] is the null block (page 0 of the pool: padding reads it, nothing owns it)
         │      free queue (LRU: a freed block goes to the back, allocation takes from the front)
         │      prefix map: BlockHash -> block, for full blocks whose KV has been written
         ▼
    KVBlock(block_id, ref_cnt, block_hash)

Prefix sharing: a full block is identified by the hash of its tokens chained to its parent's
(`BlockHash`, which keeps the tokens too, so equal hashes of different tokens never match). A freed
block keeps its hash while it waits in the free queue, so a later request with the same prefix can
take it back (`touch`); it loses the hash only when it is reused for other tokens. As in vLLM v1 a
hit covers at most `len(tokens) - 1` tokens, so the last prompt token is always computed (its logits
are needed) and prefix hits never make a request write into a shared block.

Copy-on-write: `fork(parent, child)` shares every block of the parent, the partly filled last one
included. A write into a block whose ref_cnt > 1 (or that is in the prefix map: its contents are
promised to future hits) first moves the writer to a fresh block; the result lists the (src, dst)
pages the runtime must copy before the step runs.

Sliding windows (`window` W: every layer of the model attends to at most its last W positions):
a request's block-table entries wholly behind the window go back to the pool and point at the null
page. The paged kernels never read them: with a window they read a row's table from the page holding
`context_lens - S - W + 1` on, which is the step's first position - W + 1 (plugins/ort_ops/paged_gqa.h,
paged_attention_kernels.cuh `lo`, the CPU kernel's `first_page`). A step frees the pages behind the
window of the request's previous step start (not its own): with async scheduling that step may
still be running and reading them. So a request holds at most `window_pages(chunk)` pages, whatever
its length. Models with a global layer beside windowed ones (Gemma 2/3) share one table: no window.

Invariants (asserted by `check_invariants`, run by the tests after every operation): the null block
is never free nor owned; a block is in the free queue iff its ref_cnt is 0; ref_cnt equals the
number of requests holding the block; the prefix map points only at blocks carrying that hash;
a request's table has exactly ceil(num_tokens / block_size) entries, its first `num_freed` the null
block (only with a window, only pages behind it) and the others its own.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

from enginesmith.core.errors import UserError


class BlockHash(NamedTuple):
    """Identity of a full block: chained hash value and the block's own token ids."""

    value: int
    token_ids: tuple[int, ...]


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    tokens = tuple(int(t) for t in token_ids)
    return BlockHash(hash((parent.value if parent is not None else None, tokens)), tokens)


def hash_blocks(token_ids: Sequence[int], block_size: int, parent: BlockHash | None = None,
                start_block: int = 0) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from block `start_block` on."""
    hashes = []
    for i in range(start_block, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    is_null: bool = False


class FreeBlockQueue:
    """Free blocks in eviction order: popleft takes the least recently freed; O(1) remove."""

    def __init__(self, blocks: Sequence[KVBlock]):
        self._queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, block: KVBlock) -> bool:
        return block.block_id in self._queue

    def popleft(self) -> KVBlock:
        return self._queue.popitem(last=False)[1]

    def remove(self, block: KVBlock) -> None:
        del self._queue[block.block_id]

    def append(self, block: KVBlock) -> None:
        self._queue[block.block_id] = block


class BlockPool:
    """`num_blocks` blocks; block 0 is the null block. Allocation returns None when short."""

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise UserError(f"a paged KV pool needs at least 2 pages (got {num_blocks}): page 0 is the "
                            "null page", "give the cache more pages")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.enable_caching = enable_caching
        self.cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_new_blocks(self, n: int) -> list[KVBlock] | None:
        """n fresh blocks (ref_cnt 1, no hash), or None when fewer than n are free."""
        if n > len(self.free_queue):
            return None
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict_hash(block)
            assert block.ref_cnt == 0 and not block.is_null
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a full, written block under its hash (first writer wins on duplicates)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        assert block.ref_cnt > 0 and not block.is_null
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, block)

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """One more holder of each block (a prefix hit or a fork); a free one leaves the queue."""
        for block in blocks:
            assert not block.is_null
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Sequence[KVBlock]) -> None:
        """One holder fewer; blocks reaching 0 join the free queue in the order given (first = evicted
        first), keeping their hash until they are reused."""
        for block in blocks:
            assert block.ref_cnt > 0 and not block.is_null, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)


@dataclass(frozen=True)
class KVCacheBlocks:
    """What an allocation produced: the request's whole block table and the pages to copy
    (copy-on-write) before the step that writes them runs."""

    block_ids: tuple[int, ...]
    copies: tuple[tuple[int, int], ...] = ()


@dataclass
class _Seq:
    blocks: list[KVBlock] = field(default_factory=list)
    num_tokens: int = 0        # positions with a slot (written or about to be written this step)
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix map
    ids: list[int] = field(default_factory=list)  # [b.block_id for b in blocks], kept in step (read per step)
    num_freed: int = 0         # leading entries behind the window, given back (the null block)
    last_start: int = 0        # first position of the last allocation (its step may still read)

    def __post_init__(self):
        self.ids = [b.block_id for b in self.blocks]


class KVCacheManager:
    """Per-request block tables over one BlockPool (the front door of the paged KV cache)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, window: int | None = None):
        if block_size < 1:
            raise UserError(f"page size {block_size} must be at least 1", "use 16, 32 or 64")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise UserError(f"sliding window {window!r} must be a positive integer", "give the model's window, or None")
        self.block_size = block_size
        self.window = window  # every layer's keys: the last `window` positions (None: all)
        self.pool = BlockPool(num_blocks, enable_caching)
        self.seqs: dict[str, _Seq] = {}

    # ---------------------------------------------------------------- queries

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_tokens(self, request_id: str) -> int:
        return self.seqs[request_id].num_tokens if request_id in self.seqs else 0

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        return tuple(self.seqs[request_id].ids)

    def num_held(self, request_id: str) -> int:
        """Pages the request holds (its table less the entries given back behind the window)."""
        seq = self.seqs.get(request_id)
        return len(seq.blocks) - seq.num_freed if seq is not None else 0

    def window_pages(self, chunk: int) -> int | None:
        """The most pages a request holds with the window, steps of at most `chunk` tokens (None: no
        window). Two steps' positions (this one's and the previous one's, see the module doc) plus the
        window before them, each end rounded out to a page."""
        if self.window is None:
            return None
        return -(-(self.window - 1 + 2 * chunk) // self.block_size) + 1

    def pages_for(self, num_tokens: int, chunk: int) -> int:
        """Pages a request of `num_tokens` positions holds at most, in steps of <= `chunk` tokens."""
        full = -(-num_tokens // self.block_size)
        bound = self.window_pages(chunk)
        return full if bound is None else min(full, bound)

    def slots(self, request_id: str, start: int, count: int) -> list[int]:
        """Pool slots (page * block_size + offset) of positions start .. start + count - 1."""
        seq = self.seqs[request_id]
        assert start + count <= seq.num_tokens, "positions beyond the allocated slots"
        assert start // self.block_size >= seq.num_freed or count == 0, "positions behind the window"
        bs = self.block_size
        return [seq.blocks[p // bs].block_id * bs + p % bs for p in range(start, start + count)]

    def get_computed_blocks(self, token_ids: Sequence[int]) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of `token_ids` in whole blocks, at most len - 1 tokens, and
        the number of tokens it covers. Changes nothing (allocate_slots takes the hit)."""
        bs = self.block_size
        hits, block_hash = [], None
        for i in range((len(token_ids) - 1) // bs):  # hashed block by block: a long prompt stops at its first miss
            block_hash = hash_block(block_hash, token_ids[i * bs:(i + 1) * bs])
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        behind = self._behind_window(len(hits) * bs)  # the request's first step reads none of these
        return [self.pool.null_block] * behind + hits[behind:], len(hits) * bs

    def _behind_window(self, start: int) -> int:
        """Table entries a step starting at position `start` never reads (the pages wholly before its
        first position's window)."""
        return 0 if self.window is None else max(0, start - self.window + 1) // self.block_size

    def _give_back_behind_window(self, seq: _Seq) -> None:
        """The request's pages behind the window of its last allocation's start go back to the pool."""
        end = min(self._behind_window(seq.last_start), len(seq.blocks))
        if end <= seq.num_freed:
            return
        gone = seq.blocks[seq.num_freed:end]
        seq.blocks[seq.num_freed:end] = [self.pool.null_block] * len(gone)
        seq.ids[seq.num_freed:end] = [self.pool.null_block.block_id] * len(gone)
        seq.num_freed = end
        self.pool.free_blocks(list(reversed(gone)))  # as `free`: the later block evicted first

    # ---------------------------------------------------------------- changes

    def allocate_slots(self, request_id: str, num_new_tokens: int,
                       computed_blocks: Sequence[KVBlock] = ()) -> KVCacheBlocks | None:
        """Slots for the next `num_new_tokens` positions of a request (creating it on first call,
        starting from the prefix-hit `computed_blocks`). None, with nothing changed, when the pool
        cannot supply the blocks; the caller then preempts or waits. With a window, pages behind the
        window of the last allocation's start go back first (even when this one then fails)."""
        assert num_new_tokens >= 0
        seq = self.seqs.get(request_id)
        bs = self.block_size
        if seq is not None and not computed_blocks:
            if self.window is not None:
                self._give_back_behind_window(seq)
            # The common case (a decode step, a prompt chunk inside the last block): the positions fit in
            # the blocks held and the one block written is the request's own. Same result as below.
            start = seq.num_tokens
            end = start + num_new_tokens
            if end <= len(seq.blocks) * bs and (num_new_tokens == 0 or (
                    start // bs == (end - 1) // bs and not _shared(seq.blocks[start // bs]))):
                seq.num_tokens, seq.last_start = end, start
                return KVCacheBlocks(tuple(seq.ids))
        if seq is None:
            seq = _Seq()
        elif computed_blocks:
            raise ValueError(f"request {request_id!r} already holds blocks; prefix hits apply to new "
                             "requests only")
        start = seq.num_tokens + len(computed_blocks) * bs
        end = start + num_new_tokens
        held = len(seq.blocks) + len(computed_blocks)
        fresh = -(-end // bs) - held
        # Existing blocks this step writes into that others hold or the prefix map promises: copy.
        cow = [i for i in range(start // bs, min(held, -(-end // bs)))
               if num_new_tokens and i < len(seq.blocks) and _shared(seq.blocks[i])]
        # A new request's prefix hits are full, cached blocks; those behind its window are the null block
        # (get_computed_blocks), never read, held by no one.
        behind = self._behind_window(start) if computed_blocks else 0
        kept = list(computed_blocks[behind:])
        assert all(b.is_null for b in computed_blocks[:behind]) and not any(b.is_null for b in kept)
        revived = sum(1 for b in kept if b.ref_cnt == 0)  # hits waiting in the free queue
        if fresh + len(cow) + revived > self.pool.num_free_blocks:
            return None
        if computed_blocks:
            self.pool.touch(kept)
            seq.blocks.extend(computed_blocks)
            seq.ids.extend(b.block_id for b in computed_blocks)
            seq.num_cached_blocks, seq.num_freed = len(computed_blocks), behind
        copies = []
        for i in cow:
            (new,) = self.pool.get_new_blocks(1)
            old = seq.blocks[i]
            copies.append((old.block_id, new.block_id))
            seq.blocks[i] = new
            seq.ids[i] = new.block_id
            self.pool.free_blocks([old])
            seq.num_cached_blocks = min(seq.num_cached_blocks, i)
        new_blocks = self.pool.get_new_blocks(max(fresh, 0)) or []
        seq.blocks.extend(new_blocks)
        seq.ids.extend(b.block_id for b in new_blocks)
        seq.num_tokens, seq.last_start = end, start
        self.seqs[request_id] = seq
        return KVCacheBlocks(tuple(seq.ids), tuple(copies))

    def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_written: int) -> int:
        """Register the request's full blocks among its first `num_written` positions (their KV is
        now in the pool) in the prefix map; returns how many were added."""
        seq = self.seqs[request_id]
        assert num_written <= seq.num_tokens and len(token_ids) >= num_written
        full = num_written // self.block_size
        first = max(seq.num_cached_blocks, seq.num_freed)  # blocks given back behind the window: not cached
        if full <= first or not self.pool.enable_caching:
            return 0
        if first == 0:
            parent = None
        elif first - 1 >= seq.num_freed:
            parent = seq.blocks[first - 1].block_hash
        else:  # the parent went back to the pool (window): its chained hash from the tokens
            parent = hash_blocks(token_ids[:first * self.block_size], self.block_size)[-1]
        hashes = hash_blocks(token_ids[:full * self.block_size], self.block_size, parent, first)
        seq.num_cached_blocks = first
        added = 0
        for block, block_hash in zip(seq.blocks[seq.num_cached_blocks:full], hashes):
            self.pool.cache_block(block, block_hash)
            if block.block_hash != block_hash:  # caching disabled
                break
            seq.num_cached_blocks += 1
            added += 1
        return added

    def fork(self, parent_id: str, child_id: str) -> KVCacheBlocks:
        """The child shares all of the parent's blocks (copy-on-write on the next write)."""
        if child_id in self.seqs:
            raise ValueError(f"request {child_id!r} already exists")
        parent = self.seqs[parent_id]
        self.pool.touch(parent.blocks[parent.num_freed:])
        self.seqs[child_id] = _Seq(list(parent.blocks), parent.num_tokens, parent.num_cached_blocks,
                                   num_freed=parent.num_freed, last_start=parent.last_start)
        return KVCacheBlocks(self.block_ids(child_id))

    def free(self, request_id: str) -> None:
        """Release a finished (or preempted) request's blocks, tail first to be evicted first."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.pool.free_blocks(list(reversed(seq.blocks[seq.num_freed:])))

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Forget positions >= num_tokens (speculative rollback); whole blocks past them are freed."""
        seq = self.seqs[request_id]
        if num_tokens >= seq.num_tokens:
            return
        keep = -(-num_tokens // self.block_size)
        if self._behind_window(num_tokens) < seq.num_freed:
            raise ValueError(f"request {request_id!r}: cannot roll back to {num_tokens} tokens, its pages "
                             "before them went back behind the window")
        seq.last_start = min(seq.last_start, num_tokens)
        self.pool.free_blocks(list(reversed(seq.blocks[keep:])))
        del seq.blocks[keep:]
        del seq.ids[keep:]
        seq.num_tokens = num_tokens
        seq.num_cached_blocks = min(seq.num_cached_blocks, num_tokens // self.block_size)

    # ---------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        pool = self.pool
        holders: dict[int, int] = {}
        for rid, seq in self.seqs.items():
            assert len(seq.blocks) == -(-seq.num_tokens // self.block_size), \
                f"{rid}: {len(seq.blocks)} blocks for {seq.num_tokens} tokens"
            assert 0 <= seq.num_cached_blocks <= len(seq.blocks)
            assert seq.ids == [b.block_id for b in seq.blocks], f"{rid}: block ids out of step with its blocks"
            assert seq.num_freed <= self._behind_window(seq.last_start) and seq.last_start <= seq.num_tokens, \
                f"{rid}: {seq.num_freed} pages given back, behind the window of position {seq.last_start}"
            assert all(b.is_null for b in seq.blocks[:seq.num_freed]), f"{rid}: a page behind its window is held"
            for block in seq.blocks[seq.num_freed:]:
                assert not block.is_null, f"{rid}: the null block in its window"
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        assert pool.null_block.ref_cnt == 0 and pool.null_block not in pool.free_queue
        assert pool.null_block.block_hash is None
        for block in pool.blocks[1:]:
            assert block.ref_cnt == holders.get(block.block_id, 0), \
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {holders.get(block.block_id, 0)}"
            assert (block in pool.free_queue) == (block.ref_cnt == 0), f"block {block.block_id} free state"
        for block_hash, block in pool.cached.items():
            assert block.block_hash == block_hash, f"prefix map entry of block {block.block_id} is stale"


def _shared(block: KVBlock) -> bool:
    return block.ref_cnt > 1 or block.block_hash is not None
