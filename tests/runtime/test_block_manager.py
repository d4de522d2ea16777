"""The paged KV block manager (runtime/kv/block_manager.py): allocation, prefix sharing, copy-on-write,
freeing, and its invariants over 1,000 random requests. No model involved: pure bookkeeping."""

from __future__ import annotations

import random

import pytest

from enginesmith.core.errors import UserError
from enginesmith.runtime.kv.block_manager import KVCacheManager, hash_blocks

BS = 4


def test_allocation_slots_and_out_of_blocks():
    m = KVCacheManager(num_blocks=6, block_size=BS)           # 5 usable pages, page 0 is null
    a = m.allocate_slots("a", 6)                               # 2 pages
    assert len(a.block_ids) == 2 and 0 not in a.block_ids and a.copies == ()
    assert m.slots("a", 0, 6) == [a.block_ids[0] * BS + i for i in range(4)] + \
        [a.block_ids[1] * BS + i for i in range(2)]
    b = m.allocate_slots("b", 9)                               # 3 pages
    assert set(a.block_ids).isdisjoint(b.block_ids) and m.num_free_blocks == 0
    assert m.allocate_slots("a", 2).block_ids == a.block_ids   # fills page 2 of a: no new page
    assert m.allocate_slots("a", 1) is None                    # needs a 3rd page: none left
    assert m.num_tokens("a") == 8 and m.block_ids("a") == a.block_ids  # nothing changed by the refusal
    assert m.allocate_slots("c", 1) is None and "c" not in m.seqs
    m.check_invariants()
    m.free("b")
    assert m.num_free_blocks == 3 and m.allocate_slots("a", 1) is not None
    m.check_invariants()


def test_prefix_sharing_by_block_hash():
    m = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(100, 111))                             # 11 tokens: 2 full blocks + 3
    m.allocate_slots("a", len(prompt))
    assert m.cache_blocks("a", prompt, len(prompt)) == 2
    hits, n = m.get_computed_blocks(prompt[:9] + [7, 7])       # shares the first 2 full blocks
    assert n == 8 and [b.block_id for b in hits] == list(m.block_ids("a")[:2])
    m.allocate_slots("b", 3, hits)
    assert m.block_ids("b")[:2] == m.block_ids("a")[:2] and m.block_ids("b")[2] != m.block_ids("a")[2]
    assert [m.pool.blocks[i].ref_cnt for i in m.block_ids("a")] == [2, 2, 1]
    # A hit never covers the last token (its logits must be computed): 8 tokens hit only 1 block.
    assert m.get_computed_blocks(prompt[:8])[1] == 4
    assert m.get_computed_blocks([1, 2, 3, 4, 5])[1] == 0     # other tokens: no hit
    m.check_invariants()
    # Freed blocks stay cached and come back; reuse for other tokens evicts their hash.
    m.free("a")
    m.free("b")
    assert m.num_free_blocks == 15 and len(m.pool.cached) == 2
    hits, n = m.get_computed_blocks(prompt)
    assert n == 8
    m.allocate_slots("c", 3, hits)                             # revives 2 cached blocks from the free queue
    assert m.num_free_blocks == 12
    m.check_invariants()
    m.free("c")
    m.allocate_slots("d", 15 * BS)                             # takes every page: the hashes go
    assert m.pool.cached == {} and m.get_computed_blocks(prompt)[1] == 0
    m.check_invariants()


def test_copy_on_write_after_fork():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    m.allocate_slots("p", 6)                                   # pages [x, y], y half full
    parent = m.block_ids("p")
    assert m.fork("p", "c").block_ids == parent
    assert [m.pool.blocks[i].ref_cnt for i in parent] == [2, 2]
    c = m.allocate_slots("c", 1)                               # child writes position 6 in shared page y
    assert c.copies == ((parent[1], c.block_ids[1]),) and c.block_ids[0] == parent[0]
    assert m.pool.blocks[parent[1]].ref_cnt == 1               # the parent keeps y alone now
    p = m.allocate_slots("p", 1)                               # the parent writes y in place: no copy
    assert p.copies == () and p.block_ids == parent
    m.check_invariants()
    # A write into a block of the prefix map (after a rollback) copies too: cached contents are promised.
    m.allocate_slots("p", 1)                                   # y full (8 tokens)
    m.cache_blocks("p", list(range(8)), 8)
    m.truncate("p", 7)
    w = m.allocate_slots("p", 1)
    assert w.copies == ((parent[1], w.block_ids[1]),)
    m.check_invariants()
    # Out of pages for the copy: None and nothing changed.
    m.fork("p", "d")
    while m.num_free_blocks:
        m.allocate_slots(f"fill{m.num_free_blocks}", BS)
    before = m.block_ids("d")
    assert m.allocate_slots("d", 1) is None and m.block_ids("d") == before
    m.check_invariants()


def test_no_leak_after_1000_random_requests():
    """Random arrivals, chunked prefills, decode steps, prefix hits (shared system prompts), forks
    (copy-on-write), rollbacks, finishes and preemptions; invariants after every operation; at the
    end every page is free and every ref count is 0."""
    rng = random.Random(0)
    m = KVCacheManager(num_blocks=64, block_size=BS)
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice([4, 8, 13]))] for _ in range(5)]
    live: dict[str, list[int]] = {}                            # request -> its tokens
    written: dict[str, int] = {}
    made = forks = hits = copies = refused = 0

    def finish(rid):
        m.free(rid)
        del live[rid], written[rid]

    while made < 1000 or live:
        op = rng.random()
        if made < 1000 and (op < 0.3 or not live):
            tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 20))]
            blocks, n = m.get_computed_blocks(tokens)
            rid = f"r{made}"
            made += 1
            if m.allocate_slots(rid, len(tokens) - n, blocks) is None:
                refused += 1
                continue
            hits += n > 0
            live[rid], written[rid] = tokens, len(tokens)
            m.cache_blocks(rid, tokens, len(tokens))
        elif op < 0.75:                                        # a decode step of a random request
            rid = rng.choice(list(live))
            live[rid].append(rng.randrange(1000))
            got = m.allocate_slots(rid, 1)
            if got is None:                                    # preempt it (recompute later: dropped here)
                finish(rid)
            else:
                copies += len(got.copies)
                written[rid] += 1
                m.cache_blocks(rid, live[rid], written[rid])
        elif op < 0.8 and len(live) < 40:                      # fork (parallel sampling)
            parent = rng.choice(list(live))
            child = f"{parent}.f{forks}"
            forks += 1
            m.fork(parent, child)
            live[child], written[child] = list(live[parent]), written[parent]
        elif op < 0.85:                                        # speculative rollback
            rid = rng.choice(list(live))
            keep = rng.randrange(1, written[rid] + 1)
            m.truncate(rid, keep)
            live[rid], written[rid] = live[rid][:keep], keep
        else:
            finish(rng.choice(list(live)))
        m.check_invariants()
    assert made == 1000 and hits > 50 and forks > 20 and copies > 5, (hits, forks, copies, refused)
    assert m.seqs == {} and m.num_free_blocks == 63
    assert all(b.ref_cnt == 0 for b in m.pool.blocks)


def test_hashes_chain_and_bad_input():
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], BS)
    b = hash_blocks([9, 9, 9, 9, 5, 6, 7, 8], BS)
    assert a[1].token_ids == b[1].token_ids and a[1] != b[1]  # same tokens, different prefix
    with pytest.raises(UserError, match="at least 2 pages"):
        KVCacheManager(num_blocks=1, block_size=BS)
    with pytest.raises(UserError, match="page size"):
        KVCacheManager(num_blocks=4, block_size=0)
    m = KVCacheManager(num_blocks=8, block_size=BS)
    m.allocate_slots("a", 5)
    m.cache_blocks("a", [1, 2, 3, 4, 5], 5)
    hits, _ = m.get_computed_blocks([1, 2, 3, 4, 5, 6])
    with pytest.raises(ValueError, match="new requests only"):
        m.allocate_slots("a", 1, hits)
    with pytest.raises(ValueError, match="already exists"):
        m.fork("a", "a")
