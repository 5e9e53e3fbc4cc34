"""Property tests of the paged KV block manager: a hypothesis state machine against a small model of the pool.

The machine allocates prompts drawn from a tiny vocabulary (so prefixes collide and blocks get shared), grows
sequences, marks random amounts of their tokens computed, frees them and resets the prefix cache, on pools of a
few blocks. After every rule the manager's own `check_invariants()` runs, and the model checks, independently:

- every block is exactly one of free / cached / referenced, and its ref count is the number of tables holding it;
- num_free_blocks + blocks in use == num_blocks;
- a table holds ceil(tokens / block_size) blocks (waste < one block per sequence);
- can_allocate / can_append agree with whether allocate / append_slots succeed; a refused call raises
  RuntimeError and leaves every bit of state untouched; the watermark answer matches the pool left afterwards;
- a prefix hit never includes the block holding the prompt's last token, and every hit block holds (as tracked
  by the test, only once cache_blocks declared it computed) exactly the requesting prompt's tokens up to its end;
- a named block's hash is the chained hash of the tokens actually computed into it;
- fresh blocks come from the free list before any cached block is evicted, and evictions take the least recently
  used cached block (a freed table queues its tail first);
- named blocks held by a sequence stay findable; reset_prefix_cache forgets exactly the unheld ones;
- a fork shares exactly the parent's leading full blocks it has computed among the tokens asked for (never
  copied: the same ids, reference counts up), `can_fork` agrees with whether fork + append_slots fits, and
  freeing either side (in any order, with preemption as free + allocate again) keeps every invariant;
- an allocation with `cache_prefix=False` takes no prefix hits and leaves the hit counters alone.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nanoserve.block_manager import BlockManager, CacheConfig, hash_block

VOCAB = 3   # tiny, so random prompts share prefixes


def ceil_div(a: int, b: int) -> int: return -(-a // b)


def snapshot(bm: BlockManager):
    "Everything a refused call must leave alone."
    return (tuple((b.block_id, b.ref_count, b.hash) for b in bm.blocks), list(bm._free_ids), list(bm._cached),
            dict(bm._hash_to_block), {k: list(v) for k, v in bm._tables.items()},
            {k: list(v) for k, v in bm._hashes.items()}, bm.num_hit_tokens, bm.num_queried_tokens,
            dict(bm._num_computed_blocks))


def chain_hash(tokens, block_size: int) -> bytes:
    parent = None
    for j in range(len(tokens) // block_size):
        parent = hash_block(parent, list(tokens[j * block_size:(j + 1) * block_size]))
    return parent


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4, 16]), num_blocks=st.integers(1, 12),
                prefix=st.booleans(), watermark=st.sampled_from([0.0, 0.1, 0.3]), data=st.data())
    def setup(self, block_size, num_blocks, prefix, watermark, data):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix, watermark=watermark)
        self.bs, self.prefix = block_size, prefix
        self.tokens: dict[int, list[int]] = {}    # seq_id -> tokens it holds slots for
        self.computed: dict[int, int] = {}        # seq_id -> tokens declared computed via cache_blocks
        self.tables: dict[int, list[int]] = {}    # seq_id -> the test's copy of its block table
        self.content: dict[int, tuple] = {}       # block_id -> all tokens up to the block's end, once computed
        self.history: list[list[int]] = [[0] * (3 * block_size + 1)]   # sources of shared prefixes
        self.lru: list[int] = []                  # unheld named blocks, least recently used first
        self.next_id = 0
        for _ in range(data.draw(st.integers(0, 3))):            # start from a non-empty pool
            if (seq_id := self._allocate(data)) is not None:
                self._cache(seq_id, data.draw(st.integers(self.computed[seq_id], len(self.tokens[seq_id]))))
                if data.draw(st.booleans()): self._free(seq_id)

    # -- helpers ------------------------------------------------------------------------------------------
    def draw_tokens(self, data, max_len: int, min_len: int = 0) -> list[int]:
        recent = self.history[-3:]            # mostly extend what was just allocated or grown
        base = data.draw(st.sampled_from(recent) | st.sampled_from(self.history))
        keep = data.draw(st.just(len(base)) | st.integers(0, len(base)))
        suffix = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=max(0, min_len - keep),
                                    max_size=max(0, max_len - keep)))
        return list(base[:keep]) + suffix

    def in_use(self) -> set[int]: return {b for t in self.tables.values() for b in t}

    def check_evictions(self, fresh: list[int], unnamed_free: int) -> None:
        "Fresh blocks beyond the free list are the least recently used cached ones."
        evicted = max(0, len(fresh) - unnamed_free)
        assert set(self.lru[:evicted]) <= set(fresh), f"evicted {fresh} but the LRU blocks were {self.lru[:evicted]}"
        self.lru = self.lru[evicted:]

    def num_unnamed_free(self) -> int:
        return sum(b.ref_count == 0 and b.hash is None for b in self.bm.blocks)

    def num_named(self) -> int: return sum(b.hash is not None for b in self.bm.blocks)

    # -- rules --------------------------------------------------------------------------------------------
    def _allocate(self, data, prompt: list[int] | None = None) -> int | None:
        "Allocate a drawn prompt (or `prompt`) under a new id, checking everything; returns the id, or None if refused."
        bm, bs = self.bm, self.bs
        if prompt is None: prompt = self.draw_tokens(data, max_len=min(bm.num_blocks * bs + bs, 4 * bs + 3), min_len=1)
        seq_id, self.next_id = self.next_id, self.next_id + 1
        cache_prefix = data.draw(st.sampled_from([True, True, False]))
        expected_hits = bm.num_cached_tokens(prompt) if cache_prefix else 0
        can = bm.can_allocate(prompt, watermark=False, cache_prefix=cache_prefix)
        can_wm = bm.can_allocate(prompt, watermark=True, cache_prefix=cache_prefix)
        assert can or not can_wm, "the watermark can only make admission harder"
        before, in_use, free_before = snapshot(bm), self.in_use(), bm.num_free_blocks
        unnamed_free, named_before = self.num_unnamed_free(), self.num_named()
        if not can:
            with pytest.raises(RuntimeError, match="not enough free blocks"):
                bm.allocate(seq_id, prompt, cache_prefix=cache_prefix)
            assert snapshot(bm) == before, "a refused allocate changed the manager"
            assert seq_id not in bm
            event("allocate refused")
            return None
        hit_tokens_before, queried_before = bm.num_hit_tokens, bm.num_queried_tokens
        num_cached = bm.allocate(seq_id, prompt, cache_prefix=cache_prefix)
        self.history.append(prompt)
        table = list(bm.block_table(seq_id))
        assert num_cached == expected_hits
        assert num_cached % bs == 0
        assert num_cached < len(prompt), "a prefix hit included the block with the prompt's last token"
        assert num_cached <= bs * ((len(prompt) - 1) // bs)
        if not self.prefix or not cache_prefix:
            assert num_cached == 0
            assert (bm.num_hit_tokens, bm.num_queried_tokens) == (hit_tokens_before, queried_before)
        else:
            assert bm.num_hit_tokens == hit_tokens_before + num_cached
            assert bm.num_queried_tokens == queried_before + len(prompt)
        assert len(table) == ceil_div(len(prompt), bs), "table is not ceil(tokens / block_size) blocks"
        k = num_cached // bs
        event("allocate hit" if k else "allocate miss")
        if any(b in in_use for b in table[:k]): event("hit shares a held block")
        if any(b not in in_use for b in table[:k]): event("hit revives a cached block")
        fresh = table[k:]
        if len(fresh) > unnamed_free: event("allocate evicts")
        if not can_wm: event("allocate below watermark")
        for i, b in enumerate(table[:k]):
            assert self.content.get(b) == tuple(prompt[:(i + 1) * bs]), \
                f"hit block {b} (position {i}) holds {self.content.get(b)}, prompt needs {prompt[:(i + 1) * bs]}"
        assert not set(fresh) & in_use, "a fresh block was already held by another sequence"
        for b in fresh: self.content.pop(b, None)          # its old contents are about to be overwritten
        self.lru = [b for b in self.lru if b not in table[:k]]    # revived hits leave the LRU queue
        self.check_evictions(fresh, unnamed_free)
        shared = sum(b in in_use for b in table[:k])
        assert free_before - bm.num_free_blocks == len(table) - shared
        # the watermark answer is exactly whether the pool kept `watermark_blocks` free
        assert can_wm == (bm.num_free_blocks >= bm.config.watermark_blocks)
        # fresh blocks come from the free list first; cached ones are evicted only when it is empty
        assert self.num_named() == named_before - max(0, len(fresh) - unnamed_free)
        self.tokens[seq_id], self.computed[seq_id], self.tables[seq_id] = list(prompt), num_cached, table
        return seq_id

    @rule(data=st.data())
    def allocate_invalid(self, data):
        bm, before = self.bm, snapshot(self.bm)
        if self.tables and data.draw(st.booleans()):
            seq_id = data.draw(st.sampled_from(sorted(self.tables)))
            with pytest.raises(ValueError, match="already has blocks"):
                bm.allocate(seq_id, [0])
        else:
            with pytest.raises(ValueError, match="empty"):
                bm.allocate(10_000 + self.next_id, [])
        assert snapshot(bm) == before

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def append(self, data):
        bm, bs = self.bm, self.bs
        seq_id = data.draw(st.sampled_from(sorted(self.tables)))
        grow = data.draw(st.integers(0, 2 * bs + 1))
        new_len = len(self.tokens[seq_id]) + grow
        need = ceil_div(new_len, bs) - len(self.tables[seq_id])
        can = bm.can_append(seq_id, new_len)
        assert can == (need <= bm.num_free_blocks)
        before, in_use, free_before = snapshot(bm), self.in_use(), bm.num_free_blocks
        unnamed_free, named_before = self.num_unnamed_free(), self.num_named()
        if not can:
            with pytest.raises(RuntimeError, match="not enough free blocks"):
                bm.append_slots(seq_id, new_len)
            assert snapshot(bm) == before, "a refused append_slots changed the manager"
            event("append refused")
            return
        new_ids = bm.append_slots(seq_id, new_len)
        assert len(new_ids) == max(0, need)
        assert not set(new_ids) & in_use
        for b in new_ids: self.content.pop(b, None)
        assert free_before - bm.num_free_blocks == len(new_ids)
        self.check_evictions(new_ids, unnamed_free)
        assert self.num_named() == named_before - max(0, len(new_ids) - unnamed_free)
        self.tables[seq_id].extend(new_ids)
        self.tokens[seq_id].extend(data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=grow, max_size=grow)))
        self.history.append(list(self.tokens[seq_id]))
        assert bm.block_table(seq_id) == self.tables[seq_id]
        # slot mapping covers exactly the table
        assert bm.slot_mapping(seq_id, 0, new_len) == [self.tables[seq_id][p // bs] * bs + p % bs
                                                       for p in range(new_len)]
        with pytest.raises(IndexError):
            bm.slot_mapping(seq_id, 0, len(self.tables[seq_id]) * bs + 1)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def trim(self, data):
        "Give back the tail of a table (a verify step's rejected drafts): fresh blocks only, no full computed block cut."
        bm, bs = self.bm, self.bs
        seq_id = data.draw(st.sampled_from(sorted(self.tables)))
        n = data.draw(st.integers(0, len(self.tokens[seq_id])))
        keep, table = ceil_div(n, bs), self.tables[seq_id]
        before, free_before = snapshot(bm), bm.num_free_blocks
        if n < max(1, bm._num_computed_blocks[seq_id] * bs):
            with pytest.raises(ValueError, match="cannot trim"):
                bm.trim_slots(seq_id, n)
            assert snapshot(bm) == before, "a refused trim_slots changed the manager"
            event("trim refused")
            return
        freed = bm.trim_slots(seq_id, n)
        assert freed == table[keep:]
        assert not set(freed) & self.in_use() - set(freed), "a trimmed block was held by another table"
        for b in freed:
            assert bm.blocks[b].ref_count == 0 and bm.blocks[b].hash is None and b in bm._free_ids
            self.content.pop(b, None)
        assert bm.num_free_blocks == free_before + len(freed)
        if freed: event("trim frees blocks")
        del table[keep:], self.tokens[seq_id][n:]
        self.computed[seq_id] = min(self.computed[seq_id], n)
        assert bm.block_table(seq_id) == table

    def _cache(self, seq_id: int, n: int) -> None:
        bm, bs = self.bm, self.bs
        tokens = self.tokens[seq_id]
        named_before = self.num_named()
        num_named = bm.cache_blocks(seq_id, tokens, n)
        assert num_named == self.num_named() - named_before
        assert 0 <= num_named <= n // bs
        if not self.prefix: assert num_named == 0
        table = self.tables[seq_id]
        for i in range(n // bs):   # these blocks' K/V are now written
            self.content[table[i]] = tuple(tokens[:(i + 1) * bs])
        self.computed[seq_id] = n
        if self.prefix:
            # the sequence's named leading blocks (which it holds, so nobody can evict them) are findable
            k = 0
            while k < len(table) and bm.blocks[table[k]].hash is not None: k += 1
            if k * bs <= len(tokens):
                assert bm.num_cached_tokens(tokens[:k * bs] + [0]) == k * bs

    def _free(self, seq_id: int) -> None:
        bm = self.bm
        table = self.tables.pop(seq_id)
        del self.tokens[seq_id], self.computed[seq_id]
        free_before, still_held = bm.num_free_blocks, self.in_use()
        bm.free(seq_id)
        assert seq_id not in bm
        released = [b for b in table if b not in still_held]
        assert bm.num_free_blocks == free_before + len(released)
        for b in released:
            assert bm.blocks[b].ref_count == 0
            assert (b in bm._cached) == (bm.blocks[b].hash is not None)
        # the tail of the table is queued for eviction first: walk it backwards
        self.lru += [b for b in reversed(table) if b in released and bm.blocks[b].hash is not None]

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data):
        "Fork a held sequence over a drawn number of its leading tokens, then grow the child to its own length."
        bm, bs = self.bm, self.bs
        parent = data.draw(st.sampled_from(sorted(self.tables)))
        ptokens = self.tokens[parent]
        keep = data.draw(st.integers(0, len(ptokens)))
        child = list(ptokens[:keep]) + data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=2 * bs))
        if not child: child = [0]
        num_tokens = data.draw(st.integers(0, min(keep, len(child))))     # tokens the child has in common
        k = min(num_tokens // bs, self.computed[parent] // bs)             # only computed full blocks are shared
        assert bm.num_shareable_tokens(parent, num_tokens) == k * bs
        need = ceil_div(len(child), bs) - k
        can = bm.can_fork(parent, num_tokens, len(child), watermark=False)
        assert can == (need <= bm.num_free_blocks)
        assert bm.can_fork(parent, num_tokens, len(child)) == (bm.num_free_blocks - need >= bm.config.watermark_blocks)
        if not can:
            event("fork refused")
            return
        seq_id, self.next_id = self.next_id, self.next_id + 1
        in_use, unnamed_free, free_before = self.in_use(), self.num_unnamed_free(), bm.num_free_blocks
        refs_before = [b.ref_count for b in bm.blocks]
        assert bm.fork(parent, seq_id, num_tokens) == k * bs
        shared = self.tables[parent][:k]
        assert bm.block_table(seq_id) == shared, "a fork copied instead of sharing"
        for b in shared: assert bm.blocks[b].ref_count == refs_before[b] + 1
        assert bm.num_free_blocks == free_before, "a fork took blocks from the pool"
        new_ids = bm.append_slots(seq_id, len(child))
        assert len(new_ids) == need and not set(new_ids) & in_use
        for b in new_ids: self.content.pop(b, None)
        self.check_evictions(new_ids, unnamed_free)
        self.tokens[seq_id], self.computed[seq_id], self.tables[seq_id] = child, k * bs, shared + new_ids
        self.history.append(child)
        event("fork shares blocks" if k else "fork shares nothing")
        with pytest.raises(ValueError, match="already has blocks"):
            bm.fork(parent, seq_id, num_tokens)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def preempt(self, data):
        "Free a sequence and allocate its tokens again (preemption by recompute), as a new id."
        seq_id = data.draw(st.sampled_from(sorted(self.tables)))
        tokens = list(self.tokens[seq_id])
        self._free(seq_id)
        self._allocate(data, prompt=tokens)

    @rule(data=st.data())
    def allocate(self, data):
        seq_id = self._allocate(data)
        if seq_id is not None and data.draw(st.booleans()):     # some prefill progress right away
            self._cache(seq_id, data.draw(st.integers(self.computed[seq_id], len(self.tokens[seq_id]))))

    @rule(data=st.data())
    def request_lifecycle(self, data):
        "Allocate, compute everything, free: what a finished request leaves in the prefix cache."
        seq_id = self._allocate(data)
        if seq_id is not None:
            self._cache(seq_id, len(self.tokens[seq_id]))
            self._free(seq_id)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def cache(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tables)))
        self._cache(seq_id, data.draw(st.integers(self.computed[seq_id], len(self.tokens[seq_id]))))

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data):
        self._free(data.draw(st.sampled_from(sorted(self.tables))))

    @rule()
    def reset_prefix_cache(self):
        bm = self.bm
        free_before = bm.num_free_blocks
        held_named = {b.block_id: b.hash for b in bm.blocks if b.ref_count and b.hash is not None}
        num_unheld_named = sum(b.ref_count == 0 and b.hash is not None for b in bm.blocks)
        assert bm.reset_prefix_cache() == num_unheld_named
        assert bm.num_free_blocks == free_before
        for b in bm.blocks:
            if b.ref_count == 0: assert b.hash is None, f"unheld block {b.block_id} still named after reset"
        assert {b.block_id: b.hash for b in bm.blocks if b.hash is not None} == held_named
        self.lru = []

    # -- after every rule ---------------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if not hasattr(self, "bm"): return
        bm, bs = self.bm, self.bs
        bm.check_invariants()
        assert set(bm._tables) == set(self.tables)
        holders = [0] * bm.num_blocks
        for seq_id, table in self.tables.items():
            assert bm.block_table(seq_id) == table
            assert len(table) == ceil_div(len(self.tokens[seq_id]), bs), "waste >= one block"
            assert len(table) * bs - len(self.tokens[seq_id]) < bs
            for b in table: holders[b] += 1
        free, cached = set(bm._free_ids), set(bm._cached)
        for b in bm.blocks:
            assert b.ref_count == holders[b.block_id]
            states = (b.block_id in free, b.block_id in cached, holders[b.block_id] > 0)
            assert sum(states) == 1, f"block {b.block_id} is free/cached/referenced = {states}"
            if b.hash is not None:
                assert self.prefix
                content = self.content.get(b.block_id)
                assert content is not None, f"block {b.block_id} is named but was never computed"
                assert b.hash == chain_hash(content, bs), f"block {b.block_id}'s name is not its contents"
        assert list(bm._cached) == self.lru, "cached blocks out of least-recently-used order"
        used = len(self.in_use())
        assert bm.num_free_blocks + used == bm.num_blocks
        assert bm.num_used_blocks == used


# Shrinking a failing run can take minutes; by default a failure is reported as found (deterministic, thanks to
# derandomize). Set NANOSERVE_SHRINK=1 to minimise it.
_SHRINK = os.environ.get("NANOSERVE_SHRINK") == "1"
BlockManagerMachine.TestCase.settings = settings(
    max_examples=400, stateful_step_count=50, deadline=None, derandomize=True, database=None,
    phases=tuple(Phase) if _SHRINK else (Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_block_manager_state_machine = BlockManagerMachine.TestCase


# -- a few fixed cases the machine relies on ---------------------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
def test_waste_below_one_block(block_size):
    bm = BlockManager(num_blocks=64, block_size=block_size, enable_prefix_caching=False)
    for n in range(1, 3 * block_size + 2):
        bm.allocate(n, list(range(n)))
        assert 0 <= len(bm.block_table(n)) * block_size - n < block_size
        for m in range(n, n + block_size + 1):
            bm.append_slots(n, m)
            assert len(bm.block_table(n)) == ceil_div(m, block_size)
        bm.free(n)
    bm.check_invariants()
    assert bm.num_free_blocks == 64


def test_last_token_block_never_shared():
    bm = BlockManager(num_blocks=8, block_size=4)
    p = list(range(8))                           # exactly two full blocks
    bm.allocate(0, p); bm.cache_blocks(0, p, 8)
    assert bm.num_cached_tokens(p) == 4          # not 8: the block with token 7 must be computed again
    assert bm.allocate(1, p) == 4
    assert bm.block_table(1)[0] == bm.block_table(0)[0] and bm.block_table(1)[1] != bm.block_table(0)[1]
    bm.check_invariants()


def test_uncomputed_blocks_are_not_shared():
    bm = BlockManager(num_blocks=8, block_size=4)
    p = list(range(12))
    bm.allocate(0, p)
    assert bm.num_cached_tokens(p + [0]) == 0    # allocated but not computed
    bm.cache_blocks(0, p, 7)
    assert bm.num_cached_tokens(p + [0]) == 4    # one full computed block
    bm.cache_blocks(0, p, 12)
    assert bm.num_cached_tokens(p + [0]) == 12


def test_cached_block_revival_counts_against_the_pool():
    bm = BlockManager(num_blocks=3, block_size=2, watermark=0.0)
    p = [1, 1, 2, 2, 3]
    bm.allocate(0, p); bm.cache_blocks(0, p, 5); bm.free(0)
    assert bm.num_free_blocks == 3                       # two named blocks cached, one free
    q = [1, 1, 2, 2, 9, 9, 9]                            # hits 2 cached blocks, needs 2 more: 4 > 3
    assert bm.num_cached_tokens(q) == 4
    assert not bm.can_allocate(q, watermark=False)
    with pytest.raises(RuntimeError):
        bm.allocate(1, q)
    bm.check_invariants()
    assert bm.can_allocate(q[:6], watermark=False)       # 2 revived + 1 new = 3
    assert bm.allocate(1, q[:6]) == 4
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_cache_config_validation():
    for bad in (dict(num_blocks=0), dict(num_blocks=2, block_size=0), dict(num_blocks=2, watermark=1.0),
                dict(num_blocks=2, watermark=-0.1), dict(num_blocks=2.0)):
        with pytest.raises(ValueError):
            CacheConfig(**bad)
