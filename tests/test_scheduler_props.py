"""Property and regression tests of the continuous-batching scheduler, driven with the fake model.

Three layers:
1. A hypothesis state machine that adds requests (valid and invalid), aborts them in every state (also between
   `schedule()` and `update()`), and steps the scheduler with the fake model (check_kv=True), on small pools that
   force preemption, small token budgets (chunked prefill), both policies, with and without prefix caching.
   Every step is checked (see `StepChecker`), and at the end the machine drains to completion under a step
   bound and compares every surviving request's tokens with the same requests run on an unlimited pool.
   (Plus seeded random walks with the same per-step checks, biased towards running out of blocks, and steps
   cancelled with `Scheduler.cancel` as after a model failure.)
2. `@given` properties over `simulate(lognormal_workload(...))`: tight vs roomy pools, static vs continuous,
   random aborts.
3. Targeted regression tests (a)-(j) for the failure modes the notebook names and the bugs these tests found.
4. Forks (n choices of one prompt, `Sequence.fork_of`): `@given` workloads of forked groups under preemption,
   aborts, both policies, with and without prefix caching (invariants every step, no hang, every choice's own
   tokens, prompt tokens computed = the prompt less what was cached or shared), the prompt computed once with
   room for everything, and the parent aborted or preempted around its child.

The reference for "the same requests on an unlimited pool" is itself checked against `oracle_tokens`, which
drives the fake model with one contiguous block table and no scheduler at all.
"""
from __future__ import annotations

import os
import random
import sys
from unittest import mock

import pytest
from hypothesis import HealthCheck, Phase, event, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nanoserve.block_manager import BlockManager, CacheConfig
from nanoserve.scheduler import (FakeModel, Request, ScheduledSeq, Scheduler, SchedulerConfig, Sequence,
                                 SequenceStatus, Step, Trace, lognormal_workload, simulate)

PROMPT_VOCAB = 3   # prompts from a tiny vocabulary, so prefixes collide and the prefix cache finds them
MODEL_VOCAB = 7    # the fake model's outputs, small so that stop tokens are hit


def ceil_div(a: int, b: int) -> int: return -(-a // b)


# -- reference: the same requests on an unlimited pool -------------------------------------------------------
def oracle_tokens(prompt: list[int], max_tokens: int, stop: frozenset, vocab: int = MODEL_VOCAB) -> list[int]:
    "The fake model's tokens for one request with no scheduler or block manager: one contiguous block table."
    n = len(prompt) + max_tokens
    model, table = FakeModel(n, 1, vocab_size=vocab, check_kv=True), list(range(n))
    tokens, out, start = list(prompt), [], 0
    while True:
        chunk = ScheduledSeq(0, tokens[start:], start, table, list(range(start, len(tokens))), sample=True)
        token = model.step(Step(0, [chunk]))[0]
        out.append(token)
        start = len(tokens)
        tokens.append(token)
        if token in stop or len(out) == max_tokens: return out


def run_roomy(reqs: dict[int, tuple[list[int], int, frozenset]], vocab: int = MODEL_VOCAB,
              block_size: int = 3) -> dict[int, tuple[list[int], str]]:
    """Run `reqs` ({seq_id: (prompt, max_tokens, stop_token_ids)}) with room for everything at once.

    A block size of 3 (unlike anything the tests under test use) and no prefix cache: the tokens must not
    depend on either."""
    if not reqs: return {}
    total = sum(ceil_div(len(p) + m, block_size) for p, m, _ in reqs.values())
    longest = max(len(p) + m for p, m, _ in reqs.values())
    cfg = SchedulerConfig(max_num_seqs=len(reqs), max_num_batched_tokens=max(len(reqs), longest, 64),
                          max_model_len=longest)
    bm = BlockManager(total + 1, block_size, enable_prefix_caching=False, watermark=0.0)
    sched, model = Scheduler(cfg, bm), FakeModel(total + 1, block_size, vocab_size=vocab, check_kv=True)
    for i, (p, m, stop) in reqs.items(): sched.add(Sequence(i, list(p), m, stop_token_ids=stop))
    out, steps = {}, 0
    while sched.has_unfinished():
        step = sched.schedule()
        assert not step.preempted_seq_ids
        for s in sched.update(step, model.step(step)): out[s.seq_id] = (s.output_token_ids, s.finish_reason)
        steps += 1
        assert steps <= 10 * longest * len(reqs) + 100
    for i, (p, m, stop) in reqs.items():   # the reference itself agrees with a scheduler-free run
        assert out[i][0] == oracle_tokens(p, m, stop, vocab)
    return out


def check_finished(seq: Sequence) -> None:
    "A request that ran to its end: exactly max_tokens tokens, or fewer ending in (and only there) a stop token."
    out = seq.output_token_ids
    assert seq.status is SequenceStatus.FINISHED
    assert 1 <= len(out) <= seq.max_tokens
    assert not set(out[:-1]) & seq.stop_token_ids, f"seq {seq.seq_id} ran past a stop token: {out}"
    if out[-1] in seq.stop_token_ids: assert seq.finish_reason == "stop"
    else: assert seq.finish_reason == "length" and len(out) == seq.max_tokens, (seq.seq_id, out, seq.finish_reason)


class StepChecker:
    "Checks one schedule -> model -> update round against the scheduler's state before it."

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.running = [s.seq_id for s in sched.running]
        self.waiting = [s.seq_id for s in sched.waiting]
        self.state = {i: (s.num_computed_tokens, s.num_tokens, list(s.output_token_ids), s.num_preemptions,
                          s.max_computed_tokens) for i, s in sched.seqs.items()}

    def after_schedule(self, step) -> None:
        sched, cfg, bm = self.sched, self.sched.config, self.sched.block_manager
        bs = bm.block_size
        ids = [s.seq_id for s in step.seqs]
        assert step.seqs, "empty step while requests are unfinished"
        assert step.num_tokens <= cfg.max_num_batched_tokens
        assert len(step.seqs) <= cfg.max_num_seqs and len(step.seqs) <= cfg.batch_limit
        assert len(sched.running) <= cfg.batch_limit
        assert len(set(ids)) == len(ids), f"a sequence scheduled twice in one step: {ids}"
        flags = [s.is_decode for s in step.seqs]
        assert flags == sorted(flags, reverse=True), f"a decode after a prefill chunk: {flags}"
        slots = step.slot_mapping
        assert len(set(slots)) == len(slots), "two tokens of one step write the same cache slot"
        assert step.token_ids == [t for s in step.seqs for t in s.token_ids]

        # preemption: the youngest first, back to the front of the queue, keeping their tokens
        pre = step.preempted_seq_ids
        assert pre == self.running[::-1][:len(pre)], f"preempted {pre}, running was {self.running}"
        if self.running: assert self.running[0] not in pre, "the oldest running request was preempted"
        for i in pre:
            seq = sched.seqs[i]
            assert seq.status is SequenceStatus.WAITING and i not in bm and seq.num_computed_tokens == 0
            assert seq.output_token_ids == self.state[i][2], "a preempted request lost its generated tokens"
            assert seq.num_preemptions == self.state[i][3] + 1
            assert i not in ids
        # admission: first come first served, none in a step that preempted, static only into an empty batch
        running_now = [s.seq_id for s in sched.running]
        admitted = [i for i in running_now if i not in self.running]
        assert running_now == [i for i in self.running if i not in pre] + admitted
        assert admitted == self.waiting[:len(admitted)], f"admitted {admitted} overtook the queue {self.waiting}"
        assert [s.seq_id for s in sched.waiting] == pre[::-1] + self.waiting[len(admitted):]
        if pre: assert not admitted
        if cfg.policy == "static" and self.running: assert not admitted, "static admitted into a running batch"
        if not self.running and self.waiting: assert admitted, "running 0, waiting N"
        if self.running: assert self.running[0] in ids, "the oldest running request made no progress"
        if cfg.policy == "continuous": assert set(admitted) <= set(ids)

        for s in step.seqs:
            seq = sched.seqs[s.seq_id]
            assert seq.status is SequenceStatus.RUNNING
            if s.seq_id in self.state and s.seq_id not in admitted:
                assert s.start_pos == self.state[s.seq_id][0]
            else:   # admitted now: starts after the prefix-cache hits, which are whole blocks, never the last
                assert s.start_pos % bs == 0 and s.start_pos < seq.num_tokens
                if not bm.config.enable_prefix_caching: assert s.start_pos == 0
            assert s.start_pos == seq.num_computed_tokens
            assert s.num_tokens >= 1
            assert s.token_ids == seq.all_token_ids[s.start_pos:s.context_len]
            assert s.sample == (s.context_len == seq.num_tokens)
            if s.is_decode: assert s.num_tokens == 1 and s.sample
            if not cfg.enable_chunked_prefill:
                assert s.sample, (f"chunked prefill is off but seq {s.seq_id} got a partial chunk "
                                  f"[{s.start_pos}, {s.context_len}) of {seq.num_tokens} tokens")
            table = bm.block_table(s.seq_id)
            assert s.block_table == table
            assert len(table) * bs >= s.context_len
            for pos, slot in zip(s.positions, s.slot_mapping):
                assert slot // bs in table, f"seq {s.seq_id} writes slot {slot} outside its blocks {table}"
                assert slot == table[pos // bs] * bs + pos % bs

    def after_cancel(self, step, aborted_between: set[int]) -> None:
        "A cancelled step (the model failed) computed nothing: no tokens, no progress, state still consistent."
        sched, bm = self.sched, self.sched.block_manager
        sched.check_invariants()
        admitted = {s.seq_id for s in sched.running} - set(self.running)
        for i, (computed, _, out, _, max_computed) in self.state.items():
            if i in aborted_between: continue
            seq = sched.seqs[i]
            assert seq.output_token_ids == out and seq.max_computed_tokens == max_computed
            if i in step.preempted_seq_ids: assert seq.num_computed_tokens == 0
            elif i in admitted: assert seq.num_computed_tokens == bm.num_cached_tokens(seq.all_token_ids)
            else: assert seq.num_computed_tokens == computed
        held = {b for s in sched.running for b in bm.block_table(s.seq_id)}
        assert bm.num_free_blocks == bm.num_blocks - len(held)

    def after_update(self, step, sampled, finished, aborted_between: set[int], ledger: dict | None = None) -> None:
        """Check an applied step. `ledger` (seq_id -> tokens recomputed so far, kept by the caller across steps)
        counts recompute from the steps actually computed: positions below the sequence's high-water mark."""
        sched, bm = self.sched, self.sched.block_manager
        sched.check_invariants()
        tokens = iter(sampled)
        ids = {s.seq_id for s in step.seqs}
        finished_ids = {s.seq_id for s in finished}
        assert not finished_ids & aborted_between
        for s in step.seqs:
            token = next(tokens) if s.sample else None
            before = self.state[s.seq_id] if s.seq_id in self.state else None
            if s.seq_id in aborted_between:
                continue
            seq = sched.seqs.get(s.seq_id) or next(f for f in finished if f.seq_id == s.seq_id)
            assert seq.num_computed_tokens == s.context_len
            old_out = before[2] if before else []
            assert seq.output_token_ids == (old_out + [token] if s.sample else old_out)
            assert seq.max_computed_tokens == max(before[4], s.context_len)
            if ledger is not None:
                ledger[s.seq_id] = ledger.get(s.seq_id, 0) + max(0, min(s.context_len, before[4]) - s.start_pos)
                assert seq.num_recomputed_tokens == ledger[s.seq_id], \
                    f"seq {s.seq_id}: num_recomputed_tokens {seq.num_recomputed_tokens}, recomputed {ledger[s.seq_id]}"
        for i, (_, _, out, _, _) in self.state.items():
            if i not in sched.seqs or i in ids: continue
            assert sched.seqs[i].output_token_ids == out, f"seq {i} was not scheduled but its output changed"
        for seq in finished:
            check_finished(seq)
            assert seq.seq_id not in bm and seq.seq_id not in sched.seqs
        held = {b for s in sched.running for b in bm.block_table(s.seq_id)}
        assert bm.num_free_blocks == bm.num_blocks - len(held)


def run_step(sched: Scheduler, model: FakeModel, abort_between=lambda step: (), cancel: int = 0,
             ledger: dict | None = None) -> tuple[list, set]:
    """One checked round; `abort_between(step)` names sequences to abort after schedule() and before update().

    `cancel`: 1 cancels the step instead of running it (a model failure before it wrote anything), 2 runs the
    fake model (which writes K/V) and then cancels (a failure after the kernels ran)."""
    checker = StepChecker(sched)
    step = sched.schedule()
    checker.after_schedule(step)
    aborted = set()
    for i in abort_between(step):
        seq = sched.abort(i)
        if seq is not None:
            aborted.add(i)
            assert seq.finish_reason == "abort" and i not in sched.block_manager
    if cancel:
        if cancel == 2: model.step(step)
        sched.cancel(step)
        checker.after_cancel(step, aborted)
        return [], aborted
    sampled = model.step(step)
    finished = sched.update(step, sampled)
    checker.after_update(step, sampled, finished, aborted, ledger)
    return finished, aborted


def drain_and_compare(sched: Scheduler, model: FakeModel, reqs: dict, objs: dict[int, Sequence],
                      aborted: set[int], ledger: dict | None = None) -> None:
    """Step to completion (checked, under a bound that catches hangs), then check every request's end state
    and compare the tokens with the same requests on an unlimited pool."""
    bm = sched.block_manager
    bound = sum((len(p) + m) * 4 for i, (p, m, _) in reqs.items() if i in sched.seqs) + 100
    for _ in range(bound):
        if not sched.has_unfinished(): break
        run_step(sched, model, ledger=ledger)
    assert not sched.has_unfinished(), f"not finished after {bound} steps: {sorted(sched.seqs)}"
    assert bm.num_free_blocks == bm.num_blocks and not bm._tables, "blocks still held after the last request"
    bm.check_invariants()
    survivors = {i: r for i, r in reqs.items() if i not in aborted}
    for i in survivors: check_finished(objs[i])
    for i in aborted: assert objs[i].finish_reason == "abort"
    got = {i: (objs[i].output_token_ids, objs[i].finish_reason) for i in survivors}
    assert got == run_roomy(survivors), "preemption / prefix caching / chunking changed the tokens"
    full = run_roomy({i: reqs[i] for i in aborted})
    for i in aborted:   # what an aborted request produced is a prefix of its full output
        out = objs[i].output_token_ids
        assert full[i][0][:len(out)] == out


# == 1. the state machine ====================================================================================
class SchedulerMachine(RuleBasedStateMachine):
    @initialize(data=st.data())
    def setup(self, data):
        d = data.draw
        bs = d(st.sampled_from([1, 2, 4, 16]), label="block_size")
        num_blocks = d(st.integers(2, 5) if bs == 16 else st.integers(2, 24 // bs + 4), label="num_blocks")
        max_num_seqs = d(st.sampled_from([3, 2, 4, 5, 1]), label="max_num_seqs")
        chunked = d(st.booleans(), label="chunked")
        slots = num_blocks * bs   # requests of up to the whole pool, so that a few of them run out of blocks
        max_model_len = d(st.integers(max(2, min(40, slots // 2)), min(48, slots + 4)), label="max_model_len")
        budget = d(st.integers(max_num_seqs, max_num_seqs + 20), label="budget")
        if not chunked: budget = max(budget, max_model_len)
        policy = d(st.sampled_from(["continuous", "static"]), label="policy")
        static_batch_size = (d(st.none() | st.integers(1, max_num_seqs), label="static_batch_size")
                             if policy == "static" else None)
        self.cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                   max_model_len=max_model_len, enable_chunked_prefill=chunked, policy=policy,
                                   static_batch_size=static_batch_size)
        self.cache = CacheConfig(num_blocks, bs, d(st.booleans(), label="prefix"),
                                 d(st.sampled_from([0.0, 0.01, 0.2]), label="watermark"))
        self.bm = BlockManager(num_blocks, bs, self.cache.enable_prefix_caching, self.cache.watermark)
        self.sched = Scheduler(self.cfg, self.bm, Trace())
        self.model = FakeModel(num_blocks, bs, vocab_size=MODEL_VOCAB, check_kv=True)
        self.reqs: dict[int, tuple[list[int], int, frozenset]] = {}   # every accepted request
        self.objs: dict[int, Sequence] = {}
        self.aborted: set[int] = set()
        self.ledger: dict[int, int] = {}     # seq_id -> tokens recomputed in the steps actually run
        self.history: list[list[int]] = [[0] * 20]
        self.next_id = 0
        event(f"{policy}, chunked={chunked}, prefix={self.cache.enable_prefix_caching}")
        # the shape of the requests: "grow" (short prompts, long outputs) runs out of blocks mid-decode
        self.shape = d(st.sampled_from(["grow", "mixed", "both", "long"]), label="request shape")
        for _ in range(d(st.integers(1, 6), label="initial requests")): self.add_request(data, valid=True)

    # -- requests ---------------------------------------------------------------------------------------------
    def expected_valid(self, seq: Sequence) -> bool:
        total = seq.num_prompt_tokens + seq.max_tokens
        return (seq.num_prompt_tokens > 0 and seq.max_tokens >= 1 and total <= self.cfg.max_model_len
                and ceil_div(total, self.cache.block_size) <= self.cache.num_blocks
                and seq.seq_id not in self.sched.seqs)

    def state(self):
        s = self.sched
        return ([q.seq_id for q in s.waiting], [q.seq_id for q in s.running], sorted(s.seqs), s.num_steps,
                self.bm.num_free_blocks, {i: list(self.bm.block_table(i)) for i in s.seqs if i in self.bm},
                s._pending_step)

    @rule(data=st.data())
    def add(self, data):
        self.add_request(data, valid=data.draw(st.integers(0, 5)) > 0)

    def add_request(self, data, valid: bool):
        "Add a request drawn to be valid (most often) or likely invalid; the test decides which it is."
        d = data.draw
        room = min(self.cfg.max_model_len, self.cache.num_slots)
        long = st.integers(max(1, room * 2 // 3), max(1, room - 1)) | st.just(max(1, room - 1))
        short = st.integers(1, max(1, room // 3))
        shape = {"mixed": st.integers(1, max(1, room - 1)) | long, "grow": short, "long": long,
                 "both": short | long}[self.shape]
        length = d(shape if valid else st.integers(0, room + 4))
        base = d(st.sampled_from(self.history[-3:]) | st.sampled_from(self.history))
        keep = min(len(base), length)
        keep = d(st.just(keep) | st.integers(0, keep))     # often a long shared prefix
        prompt = list(base[:keep]) + d(st.lists(st.integers(0, PROMPT_VOCAB - 1), min_size=length - keep,
                                               max_size=length - keep))
        most = max(1, room - len(prompt))
        outputs = st.integers(1, most) if self.shape == "mixed" else st.integers(max(1, most // 2), most) | st.just(1)
        max_tokens = d(outputs if valid else st.integers(0, 12))
        stop = d(st.just(frozenset()) | st.frozensets(st.integers(0, MODEL_VOCAB - 1), max_size=1))
        if not valid and self.sched.seqs and d(st.booleans()):
            seq_id = d(st.sampled_from(sorted(self.sched.seqs)))       # a duplicate id: must be refused
        else:
            seq_id, self.next_id = self.next_id, self.next_id + 1
        seq = Sequence(seq_id, prompt, max_tokens, stop_token_ids=stop)
        if self.expected_valid(seq):
            self.sched.add(seq)
            self.reqs[seq_id], self.objs[seq_id] = (list(prompt), max_tokens, stop), seq
            self.history.append(prompt)
            assert seq in self.sched.waiting and seq.arrival_step == self.sched.num_steps
            event("add")
        else:
            before = self.state()
            with pytest.raises(ValueError):
                self.sched.add(seq)
            assert self.state() == before, "a rejected request changed the scheduler"
            event("add rejected")

    @precondition(lambda self: self.objs)
    @rule(data=st.data())
    def abort(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.objs)))
        seq = self.objs[seq_id]
        was = seq.status
        if was is SequenceStatus.RUNNING:
            event("abort mid-prefill" if seq.num_uncomputed_tokens > 1 else "abort in decode")
        elif was is SequenceStatus.WAITING:
            event("abort preempted" if seq.num_preemptions else "abort waiting")
        res = self.sched.abort(seq_id)
        if was is SequenceStatus.FINISHED:
            assert res is None
            return
        assert res is seq and seq.finish_reason == "abort" and seq.status is SequenceStatus.FINISHED
        assert seq_id not in self.sched.seqs and seq_id not in self.bm
        held = {b for s in self.sched.running for b in self.bm.block_table(s.seq_id)}
        assert self.bm.num_free_blocks == self.bm.num_blocks - len(held), "abort did not return the blocks"
        self.aborted.add(seq_id)

    # -- steps ------------------------------------------------------------------------------------------------
    @precondition(lambda self: self.sched.has_unfinished())
    @rule(data=st.data())
    def step(self, data):
        def abort_between(step):
            ids = [s.seq_id for s in step.seqs] + sorted(self.sched.seqs)
            if not data.draw(st.integers(0, 5)) == 0: return []
            return data.draw(st.lists(st.sampled_from(ids), max_size=2, unique=True))
        cancel = data.draw(st.sampled_from([0] * 8 + [1, 2]))
        finished, aborted = run_step(self.sched, self.model, abort_between, cancel=cancel, ledger=self.ledger)
        if cancel: event("cancelled a step")
        if aborted: event("abort between schedule and update")
        if self.sched.num_preemptions: event("preempted")
        if any(a["cached"] for a in self.sched.trace.of("admit")): event("prefix hit")
        self.aborted |= aborted

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(data=st.data())
    def several_steps(self, data):
        for _ in range(data.draw(st.integers(1, 6))):
            if not self.sched.has_unfinished(): break
            run_step(self.sched, self.model, ledger=self.ledger)

    @invariant()
    def consistent(self):
        if hasattr(self, "sched"): self.sched.check_invariants()

    def teardown(self):
        if not hasattr(self, "sched") or sys.exc_info()[0] is not None: return   # a rule failed: report that
        drain_and_compare(self.sched, self.model, self.reqs, self.objs, self.aborted, self.ledger)
        tr, bm = self.sched.trace, self.bm
        if self.sched.num_preemptions: event("run had a preemption")
        if any(a["cached"] for a in tr.of("admit")): event("run had a prefix hit")
        if any(p[1] % bm.block_size for e in tr.of("step") for p in e["prefill"]):
            event("run had a prefill chunk starting mid-block")
        if any(a["recompute"] for a in tr.of("admit")): event("run re-admitted a preempted request")
        if any(f["reason"] == "stop" for f in tr.of("finish")): event("run had a stop token")


# Shrinking a failing run of this machine can take minutes (each candidate drains and re-runs the reference),
# so by default a failure is reported as found (deterministic: derandomize). NANOSERVE_SHRINK=1 minimises it.
_SHRINK = os.environ.get("NANOSERVE_SHRINK") == "1"
SchedulerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=30, deadline=None, derandomize=True, database=None,
    phases=tuple(Phase) if _SHRINK else (Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_scheduler_state_machine = SchedulerMachine.TestCase


# == 2. properties over simulate() ===========================================================================
@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    reqs = lognormal_workload(
        num_requests=draw(st.integers(1, 12)), seed=draw(st.integers(0, 10_000)),
        prompt_median=draw(st.sampled_from([3, 8, 20])), output_median=draw(st.sampled_from([2, 6, 15])),
        max_prompt_len=40, max_output_len=30, shared_prefix_len=draw(st.sampled_from([0, 0, 5, 17])),
        arrival_rate=draw(st.none() | st.sampled_from([0.3, 1.0, 3.0])), vocab_size=draw(st.sampled_from([2, 50])))
    longest = max(len(r.prompt_token_ids) + r.output_len for r in reqs)
    max_num_seqs = draw(st.integers(1, 6))
    chunked = draw(st.booleans())
    budget = draw(st.integers(max_num_seqs, max_num_seqs + 40))
    if not chunked: budget = max(budget, longest)
    sched_cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=longest,
                                enable_chunked_prefill=chunked)
    min_blocks = max(ceil_div(len(r.prompt_token_ids) + r.output_len, bs) for r in reqs)
    tight = CacheConfig(min_blocks + draw(st.integers(0, 4)), bs, draw(st.booleans()),
                        draw(st.sampled_from([0.0, 0.01, 0.2])))
    return reqs, sched_cfg, tight


def roomy_cache(reqs, block_size=16) -> CacheConfig:
    return CacheConfig(sum(ceil_div(len(r.prompt_token_ids) + r.output_len, block_size) for r in reqs) + 1,
                       block_size, enable_prefix_caching=False, watermark=0.0)


def bound(reqs) -> int: return sum((len(r.prompt_token_ids) + r.output_len) * 4 for r in reqs) + 100 + \
    max(r.arrival_step for r in reqs)


PROPS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(workloads())
def test_tight_pool_same_tokens_as_roomy(w):
    reqs, cfg, tight = w
    a = simulate(reqs, cfg, tight, check_kv=True, check_invariants=True, max_steps=bound(reqs))
    b = simulate(reqs, cfg, roomy_cache(reqs), check_kv=True, check_invariants=True, max_steps=bound(reqs))
    assert a.outputs == b.outputs
    assert {i: len(o) for i, o in a.outputs.items()} == {r.seq_id: r.output_len for r in reqs}
    assert b.num_preemptions == 0
    assert all(s.finish_reason == "length" for s in a.seqs.values())
    if a.num_preemptions: event("tight pool preempted")


@PROPS
@given(workloads(), st.integers(1, 6), st.booleans())
def test_static_same_tokens_as_continuous(w, static_batch_size, tight_pool):
    reqs, cfg, tight = w
    cache = tight if tight_pool else roomy_cache(reqs, tight.block_size)
    static = SchedulerConfig(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                             max_model_len=cfg.max_model_len, enable_chunked_prefill=cfg.enable_chunked_prefill,
                             policy="static", static_batch_size=min(static_batch_size, cfg.max_num_seqs))
    trace = Trace()
    a = simulate(reqs, static, cache, check_kv=True, check_invariants=True, trace=trace, max_steps=bound(reqs))
    b = simulate(reqs, cfg, cache, check_kv=True, check_invariants=True, max_steps=bound(reqs))
    assert a.outputs == b.outputs
    # static: a schedule() admits only if the batch is empty when it reaches admission
    running, admitting = set(), False
    for e in trace.events:
        if e["event"] == "step": admitting = False
        elif e["event"] == "admit":
            if not admitting: assert not running, f"static admitted {e['seq']} beside {running}"
            admitting = True
            running.add(e["seq"])
        elif e["event"] in ("finish", "preempt"): running.discard(e["seq"])
    assert len(running) == 0


@PROPS
@given(workloads(), st.lists(st.integers(0, 40), min_size=1, max_size=12), st.integers(0, 2 ** 16))
def test_aborts_leave_the_rest_unchanged(w, abort_steps, pick):
    reqs, cfg, tight = w
    for j, r in enumerate(reqs):
        if (pick >> j) & 1: r.abort_step = r.arrival_step + abort_steps[j % len(abort_steps)]
    res = simulate(reqs, cfg, tight, check_kv=True, check_invariants=True, max_steps=bound(reqs))
    for r in reqs:
        s = res.seqs[r.seq_id]
        if s.finish_reason == "abort":
            event("aborted")
            assert r.abort_step is not None
            assert s.output_token_ids == full_outputs(reqs, r.seq_id)[:len(s.output_token_ids)]
        else:
            assert s.output_token_ids == full_outputs(reqs, r.seq_id)
    assert res.num_steps <= bound(reqs)


_full_cache: dict = {}
def full_outputs(reqs, seq_id):
    "Tokens of request `seq_id` run to its end on an unlimited pool, without aborts."
    key = tuple((r.seq_id, tuple(r.prompt_token_ids), r.output_len) for r in reqs)
    if key not in _full_cache:
        clean = [Request(r.seq_id, r.prompt_token_ids, r.output_len, r.arrival_step) for r in reqs]
        _full_cache.clear()
        _full_cache[key] = simulate(clean, SchedulerConfig(max_num_seqs=len(clean),
                                                           max_num_batched_tokens=max(len(clean), 64),
                                                           max_model_len=4096),
                                    roomy_cache(clean), check_kv=True).outputs
    return _full_cache[key][seq_id]


# == 1b. seeded random walks: the same checks, with a request mix that runs out of blocks more often ==========
def random_walk(seed: int, persistent_batch: bool = True) -> dict:
    """A random workload against a small pool, every step checked, drained and compared; returns what it saw.
    `persistent_batch`: the scheduler's (off: the full pass every step)."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 16])
    num_blocks = rng.randint(2, 5) if bs == 16 else rng.randint(2, 24 // bs + 4)
    slots = num_blocks * bs
    max_num_seqs = rng.randint(1, 5)
    chunked = rng.random() < 0.6
    max_model_len = rng.randint(max(2, min(40, slots // 2)), min(48, slots + 4))
    budget = rng.randint(max_num_seqs, max_num_seqs + 20)
    if not chunked: budget = max(budget, max_model_len)
    policy = rng.choice(["continuous", "static"])
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                          enable_chunked_prefill=chunked, policy=policy,
                          static_batch_size=rng.choice([None, rng.randint(1, max_num_seqs)])
                          if policy == "static" else None, persistent_batch=persistent_batch)
    cache = CacheConfig(num_blocks, bs, rng.random() < 0.6, rng.choice([0.0, 0.0, 0.01, 0.2]))
    bm = BlockManager(num_blocks, bs, cache.enable_prefix_caching, cache.watermark)
    sched = Scheduler(cfg, bm, Trace())
    model = FakeModel(num_blocks, bs, vocab_size=MODEL_VOCAB, check_kv=True)
    room = min(max_model_len, slots)
    reqs, objs, aborted, history, ledger = {}, {}, set(), [[0] * 20], {}

    def add():
        shape = rng.choice(["grow", "grow", "mixed", "long"])
        if shape == "grow": n = rng.randint(1, max(1, room // 3))
        elif shape == "long": n = rng.randint(max(1, room * 2 // 3), max(1, room - 1))
        else: n = rng.randint(1, max(1, room - 1))
        base = rng.choice(history[-3:])
        keep = min(n, len(base)) if rng.random() < 0.5 else rng.randint(0, min(n, len(base)))
        prompt = base[:keep] + [rng.randrange(PROMPT_VOCAB) for _ in range(n - keep)]
        most = max(1, room - n)
        m = rng.randint(max(1, most // 2), most) if shape == "grow" else rng.randint(1, most)
        stop = frozenset({rng.randrange(MODEL_VOCAB)}) if rng.random() < 0.3 else frozenset()
        i = len(reqs)
        seq = Sequence(i, prompt, m, stop_token_ids=stop)
        sched.add(seq)
        reqs[i], objs[i] = (list(prompt), m, stop), seq
        history.append(prompt)

    def abort(i):
        if sched.abort(i) is not None: aborted.add(i)
        assert i not in bm

    for _ in range(rng.randint(1, 6)): add()
    for _ in range(rng.randint(5, 60)):
        r = rng.random()
        if r < 0.25: add()
        elif r < 0.3 and sched.seqs:
            preempted = [s.seq_id for s in sched.waiting if s.num_preemptions]
            abort(rng.choice(preempted or sorted(sched.seqs)))
        elif sched.has_unfinished():
            between = lambda step: [rng.choice([s.seq_id for s in step.seqs])] if rng.random() < 0.05 else []
            cancel = rng.choice([1, 2]) if rng.random() < 0.05 else 0
            _, gone = run_step(sched, model, between, cancel=cancel, ledger=ledger)
            aborted |= gone
    drain_and_compare(sched, model, reqs, objs, aborted, ledger)
    tr = sched.trace
    return {"preempted": sched.num_preemptions > 0, "prefix_hit": any(a["cached"] for a in tr.of("admit")),
            "aborted": bool(aborted), "stop": any(f["reason"] == "stop" for f in tr.of("finish")),
            "aborted_after_preemption": any(objs[i].num_preemptions for i in aborted),
            "persistent_steps": sched.num_persistent_steps}


WALKS_PER_PART = 300


@pytest.mark.parametrize("part", range(4))
def test_random_walks(part):
    seen = {}
    for seed in range(part * WALKS_PER_PART, (part + 1) * WALKS_PER_PART):
        try:
            stats = random_walk(seed)
        except Exception as e:
            raise AssertionError(f"random_walk({seed}) failed: {e!r}") from e
        for k, v in stats.items(): seen[k] = seen.get(k, 0) + v
    # the walks must keep exercising what they are for
    assert seen["preempted"] >= 60 and seen["prefix_hit"] >= 60 and seen["aborted"] >= 150, seen
    assert seen["stop"] >= 100 and seen["aborted_after_preemption"] >= 10, seen
    assert seen["persistent_steps"] >= 500, seen


def walk_steps(seed: int, persistent_batch: bool) -> list[tuple]:
    "Every step `random_walk(seed)` schedules, as plain values: ids, tokens, positions, slots, tables, preempted."
    steps, schedule = [], Scheduler.schedule
    def recording(self):
        step = schedule(self)
        steps.append((step.step_id, [s.seq_id for s in step.seqs], step.token_ids, step.positions,
                      step.slot_mapping, [s.block_table for s in step.seqs], step.preempted_seq_ids))
        return step
    with mock.patch.object(Scheduler, "schedule", recording): random_walk(seed, persistent_batch)
    return steps


def test_persistent_batch_schedules_what_the_full_pass_does():
    """The persistent batch (decodes made from the last step's columns) against the full pass every step, in the
    same random walks (preemption, aborts between schedule and update, cancelled steps, prefix hits): every step
    the same rows, tokens, positions, slots and tables."""
    num_kept = 0
    for seed in range(150):
        on, off = walk_steps(seed, True), walk_steps(seed, False)
        assert on == off, f"random_walk({seed}) scheduled differently with the persistent batch"
        num_kept += sum(1 for a, b in zip(on, on[1:]) if a[1] == b[1])
    assert num_kept >= 300                         # steps with the same rows as the last: where it runs


# == 3. targeted regressions ================================================================================
def tiny(num_blocks=16, block_size=4, prefix=True, watermark=0.0, trace=None, **kw):
    cfg = SchedulerConfig(**{"max_num_seqs": 4, "max_num_batched_tokens": 8, "max_model_len": 64, **kw})
    return (Scheduler(cfg, BlockManager(num_blocks, block_size, prefix, watermark), trace),
            FakeModel(num_blocks, block_size, check_kv=True))


def drain(sched, model, limit=1000) -> dict[int, Sequence]:
    done = {}
    for _ in range(limit):
        if not sched.has_unfinished(): return done
        step = sched.schedule()
        done.update((s.seq_id, s) for s in sched.update(step, model.step(step)))
        sched.check_invariants()
    raise AssertionError(f"not finished after {limit} steps")


def roomy_outputs(reqs: list[Request]) -> dict[int, list[int]]:
    return simulate([Request(r.seq_id, r.prompt_token_ids, r.output_len) for r in reqs],
                    SchedulerConfig(max_num_seqs=len(reqs), max_num_batched_tokens=max(64, len(reqs)),
                                    max_model_len=4096), roomy_cache(reqs), check_kv=True).outputs


@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("giant_arrives", [0, 1, 3])
def test_a_whole_pool_request_beside_others(prefix, giant_arrives):
    "(a) A request needing exactly the whole pool, admitted beside others: nobody hangs, all finish."
    giant = Request(0, [5, 6, 7, 8, 9, 10], 26, arrival_step=giant_arrives)        # 32 tokens = 8 blocks of 4
    others = [Request(i, [1, 2, 3, 4, i], 10, arrival_step=0) for i in range(1, 5)]
    reqs = [giant] + others
    trace = Trace()
    res = simulate(reqs, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=32),
                   CacheConfig(num_blocks=8, block_size=4, enable_prefix_caching=prefix, watermark=0.0),
                   check_kv=True, check_invariants=True, trace=trace, max_steps=bound(reqs))
    assert {i: len(o) for i, o in res.outputs.items()} == {0: 26, 1: 10, 2: 10, 3: 10, 4: 10}
    assert res.outputs == roomy_outputs(reqs)
    first_admit = min(e["step"] for e in trace.of("admit") if e["seq"] == 0)
    others_done = max(e["step"] for e in trace.of("finish") if e["seq"] != 0)
    assert first_admit < others_done, "the giant was never admitted beside the others"
    assert res.num_preemptions > 0


def test_b_request_larger_than_the_pool_is_rejected_at_once():
    "(b) prompt + 1 (or prompt + max_tokens) beyond the whole pool: ValueError at add, naming the cache."
    trace = Trace()
    sched, model = tiny(num_blocks=4, block_size=4, trace=trace)          # 16 slots
    with pytest.raises(ValueError, match="cache"):
        sched.add(Sequence(0, list(range(16)), max_tokens=1))            # the prompt fits, prompt + 1 does not
    with pytest.raises(ValueError, match="whole cache has 4"):
        sched.add(Sequence(1, list(range(10)), max_tokens=7))
    assert not sched.has_unfinished() and not sched.waiting and sched.block_manager.num_free_blocks == 4
    assert [e["event"] for e in trace.events] == ["reject", "reject"]
    sched.add(Sequence(2, list(range(10)), max_tokens=6))                 # exactly the whole pool: accepted
    assert len(drain(sched, model)[2].output_token_ids) == 6


def test_c_longer_than_the_model_context_is_rejected():
    "(c) prompt + max_tokens > max_model_len: ValueError at add; exactly max_model_len is fine."
    sched, model = tiny(max_model_len=20)
    with pytest.raises(ValueError, match="context of 20"):
        sched.add(Sequence(0, list(range(15)), max_tokens=6))
    with pytest.raises(ValueError, match="context of 20"):
        sched.add(Sequence(0, list(range(21)), max_tokens=1))
    assert not sched.has_unfinished()
    sched.add(Sequence(0, list(range(15)), max_tokens=5))
    assert len(drain(sched, model)[0].output_token_ids) == 5


def test_c_other_invalid_requests():
    sched, _ = tiny()
    sched.add(Sequence(0, [1, 2], max_tokens=2))
    before = ([s.seq_id for s in sched.waiting], sched.block_manager.num_free_blocks)
    for bad, msg in ((Sequence(1, [], max_tokens=1), "empty"), (Sequence(1, [1], max_tokens=0), "max_tokens"),
                     (Sequence(0, [1], max_tokens=1), "already in use"),
                     (Sequence(1, [1], max_tokens=1, output_token_ids=[3]), "not new")):
        with pytest.raises(ValueError, match=msg):
            sched.add(bad)
        assert ([s.seq_id for s in sched.waiting], sched.block_manager.num_free_blocks) == before


def test_d_watermark_never_stalls_a_lone_request():
    "(d) A lone request needing more than num_blocks - watermark blocks is admitted when nothing runs."
    cache = CacheConfig(num_blocks=10, block_size=2, watermark=0.5)
    assert cache.watermark_blocks == 5
    sched, model = tiny(num_blocks=10, block_size=2, watermark=0.5, max_num_batched_tokens=32)
    sched.add(Sequence(0, list(range(14)), max_tokens=6))                  # 7 blocks now, 10 at the end
    step = sched.schedule()
    assert [s.seq_id for s in step.seqs] == [0]
    sched.update(step, model.step(step))
    assert len(drain(sched, model)[0].output_token_ids) == 6
    # beside a running request it waits for blocks, and is admitted as soon as that one is done
    trace = Trace()
    reqs = [Request(0, [1, 2], 6), Request(1, list(range(14)), 6, arrival_step=1)]
    res = simulate(reqs, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64), cache,
                   check_kv=True, check_invariants=True, trace=trace, max_steps=100)
    assert {i: len(o) for i, o in res.outputs.items()} == {0: 6, 1: 6}
    assert any(e["seq"] == 1 and e["reason"] == "blocks" for e in trace.of("wait"))


@pytest.mark.parametrize("prefix", [False, True])
def test_e_preempted_request_returns_to_the_front_and_keeps_its_tokens(prefix):
    "(e) The youngest is preempted, goes to the FRONT of the queue with its tokens, and is recomputed."
    sched, model = tiny(num_blocks=6, block_size=2, prefix=prefix, max_num_seqs=2, max_model_len=12)
    reqs = [Request(0, [1, 2, 3, 4], 8), Request(1, [5, 6, 7, 8], 8), Request(2, [9, 9], 2)]
    seqs = {r.seq_id: Sequence(r.seq_id, list(r.prompt_token_ids), r.output_len) for r in reqs}
    for s in seqs.values(): sched.add(s)
    for _ in range(3): run_step(sched, model)                             # 0 and 1 run; 2 waits (max_num_seqs)
    assert [s.seq_id for s in sched.running] == [0, 1] and [s.seq_id for s in sched.waiting] == [2]
    generated = list(seqs[1].output_token_ids)
    assert len(generated) == 3
    step = sched.schedule()                                               # 0 needs a 4th block: none free
    assert step.preempted_seq_ids == [1]
    assert [s.seq_id for s in sched.waiting] == [1, 2], "the preempted request must go to the front"
    assert seqs[1].output_token_ids == generated and seqs[1].num_computed_tokens == 0
    assert seqs[1].status is SequenceStatus.WAITING and 1 not in sched.block_manager
    assert seqs[1].num_preemptions == 1 and sched.num_preemptions == 1
    assert [s.seq_id for s in step.seqs] == [0]
    sched.update(step, model.step(step))
    done = drain(sched, model)
    assert {i: s.output_token_ids for i, s in done.items()} == roomy_outputs(reqs)
    assert 0 < done[1].num_recomputed_tokens <= done[1].max_computed_tokens
    if not prefix: assert done[1].num_recomputed_tokens == 4 + 3 - 1   # prompt + tokens computed before


def test_f_abort_in_every_state_returns_blocks_at_once():
    "(f) Abort while waiting, mid-prefill, in decode, between schedule() and update(), and after preemption."
    sched, model = tiny(num_blocks=16, block_size=4)
    bm = sched.block_manager

    def held_by_others(): return len({b for s in sched.running for b in bm.block_table(s.seq_id)})

    def check_abort(i, state):
        assert sched.seqs[i].status is state
        seq = sched.abort(i)
        assert seq.finish_reason == "abort" and seq.status is SequenceStatus.FINISHED
        assert i not in bm and i not in sched.seqs
        assert bm.num_free_blocks == bm.num_blocks - held_by_others()
        assert sched.abort(i) is None
        sched.check_invariants()

    for i, n in enumerate((12, 3, 5, 6, 7)): sched.add(Sequence(i, list(range(10 * i, 10 * i + n)), max_tokens=5))
    step = sched.schedule(); sched.update(step, model.step(step))       # 0 computed 8 of 12; the rest wait
    assert sched.seqs[0].num_computed_tokens == 8
    check_abort(1, SequenceStatus.WAITING)
    check_abort(0, SequenceStatus.RUNNING)                                # mid-prefill
    assert bm.num_free_blocks == 16
    step = sched.schedule(); sched.update(step, model.step(step))       # 2 (5 tokens) and 3 (3 of 6) run
    step = sched.schedule(); sched.update(step, model.step(step))
    assert sched.seqs[2].num_uncomputed_tokens == 1                       # in decode
    check_abort(2, SequenceStatus.RUNNING)
    step = sched.schedule()                                               # pending step includes 3
    assert 3 in [s.seq_id for s in step.seqs]
    out3 = list(sched.seqs[3].output_token_ids)
    seq3 = sched.seqs[3]
    check_abort(3, SequenceStatus.RUNNING)                                # between schedule and update
    finished = sched.update(step, model.step(step))
    assert seq3 not in finished and seq3.output_token_ids == out3 and seq3.finish_reason == "abort"
    assert 3 not in sched.seqs and 3 not in bm
    sched.check_invariants()
    # the id of a request aborted between schedule() and update() is reused before update(): the newcomer is
    # not the sequence that was scheduled, and update() must leave it alone
    step = sched.schedule()
    assert [s.seq_id for s in step.seqs] == [4]
    sched.abort(4)
    newcomer = Sequence(4, [1, 2, 3], max_tokens=2)
    sched.add(newcomer)
    assert sched.update(step, model.step(step)) == []
    assert newcomer.status is SequenceStatus.WAITING and newcomer.num_computed_tokens == 0
    assert newcomer.output_token_ids == [] and 4 not in bm
    sched.check_invariants()
    done = drain(sched, model)
    assert list(done) == [4] and done[4] is newcomer and len(newcomer.output_token_ids) == 2
    assert bm.num_free_blocks == 16
    # a preempted request (waiting, holding no blocks, with tokens) aborts cleanly too
    sched, model = tiny(num_blocks=6, block_size=2, prefix=False, max_num_seqs=2, max_model_len=12)
    for i in range(2): sched.add(Sequence(i, [1, 2, 3, i], max_tokens=8))
    while not sched.num_preemptions: run_step(sched, model)
    victim = sched.waiting[0]
    assert victim.num_preemptions == 1 and victim.output_token_ids
    free = sched.block_manager.num_free_blocks
    assert sched.abort(victim.seq_id) is victim and sched.block_manager.num_free_blocks == free
    assert victim.seq_id not in sched.block_manager
    drain(sched, model)
    assert sched.block_manager.num_free_blocks == 6


def test_g_static_admits_only_into_an_empty_batch():
    "(g) Static batching: a new batch starts only when the running batch is empty."
    trace = Trace()
    sched, model = tiny(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=16, policy="static",
                        static_batch_size=2, trace=trace)
    outs = [2, 8, 3, 3, 1]
    seqs = [Sequence(i, [i, i + 1, i + 2], max_tokens=m) for i, m in enumerate(outs)]
    for seq in seqs: sched.add(seq)
    batches = []
    while sched.has_unfinished():
        running_before = [s.seq_id for s in sched.running]
        waiting_before = [s.seq_id for s in sched.waiting]
        n_admits = len(trace.of("admit"))
        run_step(sched, model)
        admitted = [e["seq"] for e in trace.of("admit")[n_admits:]]
        if running_before: assert not admitted, f"admitted {admitted} beside {running_before}"
        elif waiting_before:
            assert admitted == waiting_before[:2]
            batches.append(admitted)
    assert batches == [[0, 1], [2, 3], [4]]
    assert any(e["reason"] == "static_batch" and e["seq"] == 2 for e in trace.of("wait"))
    reqs = [Request(i, [i, i + 1, i + 2], m) for i, m in enumerate(outs)]
    assert {s.seq_id: s.output_token_ids for s in seqs} == roomy_outputs(reqs)


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_h_no_partial_prefill_when_chunked_prefill_is_off(policy):
    """With enable_chunked_prefill=False every prefill computes all of a sequence's uncomputed tokens in one step.

    Regression (found by the random walks, in 5 of 5,000 walks, all static + chunking off): the
    static policy admitted a request into the batch without scheduling it (it did not fit the budget left in
    that step), and in the next step part 2 of `schedule()` ("running sequences still in prefill") handed it
    min(uncomputed, budget left after the decodes) tokens, ignoring enable_chunked_prefill: request 2's 15-token
    prompt below was computed as [0, 14) then [14, 15)."""
    cfg = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=16,
                          enable_chunked_prefill=False, policy=policy)
    sched = Scheduler(cfg, BlockManager(num_blocks=64, block_size=4, watermark=0.0))
    model = FakeModel(64, 4, check_kv=True)
    sched.add(Sequence(0, [1], max_tokens=8))
    sched.add(Sequence(1, [2], max_tokens=8))
    sched.add(Sequence(2, list(range(15)), max_tokens=1))
    chunks = []
    while sched.has_unfinished():
        step = sched.schedule()
        chunks += [(s.start_pos, s.num_tokens) for s in step.seqs if s.seq_id == 2]
        sched.update(step, model.step(step))
    assert chunks == [(0, 15)], f"request 2's prompt was computed in chunks {chunks} with chunked prefill off"


@pytest.mark.parametrize("mode", [1, 2])
def test_i_cancelled_steps_are_scheduled_again(mode):
    "A cancelled step (model failure; mode 2: after the kernels wrote K/V) is redone: same tokens, no leak."
    reqs = [Request(0, [1, 2, 3, 4], 8), Request(1, [1, 2, 3, 5], 8), Request(2, [9, 9], 2)]
    sched, model = tiny(num_blocks=6, block_size=2, prefix=True, max_num_seqs=2, max_model_len=12)
    seqs = {r.seq_id: Sequence(r.seq_id, list(r.prompt_token_ids), r.output_len) for r in reqs}
    for seq in seqs.values(): sched.add(seq)
    n = 0
    while sched.has_unfinished():
        run_step(sched, model, cancel=mode if n % 3 == 1 else 0)   # every third step fails once
        n += 1
        assert n < 200
    assert {i: s.output_token_ids for i, s in seqs.items()} == roomy_outputs(reqs)
    assert sched.block_manager.num_free_blocks == 6 and sched.num_preemptions > 0


def test_j_cancel_does_not_count_recompute_twice():
    """num_recomputed_tokens counts tokens computed again after a preemption; a cancelled step computed nothing.

    Bug: `_chunk` adds to num_recomputed_tokens when the step is scheduled, and cancel() does not take it back,
    so a re-admitted request whose first recompute step is cancelled counts that recompute twice. Below: request 1
    is preempted with 6 tokens computed, its recompute step is cancelled once, and it ends with
    num_recomputed_tokens 12, although only 6 tokens were ever computed again (and max_computed_tokens is 11)."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=12),
                      BlockManager(6, 2, enable_prefix_caching=False, watermark=0.0))
    model = FakeModel(6, 2, check_kv=True)
    for i in range(2): sched.add(Sequence(i, [1, 2, 3, i], max_tokens=8))
    while not sched.num_preemptions:
        step = sched.schedule(); sched.update(step, model.step(step))
    victim = sched.waiting[0]
    computed_before = victim.max_computed_tokens
    assert (victim.seq_id, computed_before) == (1, 6)
    cancelled = False
    while sched.has_unfinished():
        step = sched.schedule()
        if not cancelled and victim.seq_id in [s.seq_id for s in step.seqs]:
            sched.cancel(step); cancelled = True
            continue
        sched.update(step, model.step(step))
    assert cancelled
    assert victim.num_recomputed_tokens == computed_before, \
        f"recomputed {computed_before} tokens, counted {victim.num_recomputed_tokens}"


# == 4. forks: n choices of one prompt =======================================================================
@st.composite
def fork_workloads(draw):
    "Groups of 1-4 choices of one prompt (choices 1.. fork choice 0), some aborted, on a pool that preempts."
    bs = draw(st.sampled_from([1, 2, 4, 4, 16]), label="block_size")
    reqs = []
    for _ in range(draw(st.integers(1, 4), label="groups")):
        plen = draw(st.integers(1, 40))
        prompt = draw(st.lists(st.integers(0, 2), min_size=plen, max_size=plen))
        arrival, parent = draw(st.integers(0, 6)), len(reqs)
        for j in range(draw(st.integers(2, 4) | st.just(1), label="n")):
            reqs.append(Request(len(reqs), list(prompt), draw(st.integers(1, 20)),
                                arrival_step=arrival + (j and draw(st.integers(0, 2))),
                                abort_step=draw(st.none() | st.none() | st.integers(0, 30)),
                                fork_of=parent if j else None, cache_prefix=j > 0 or draw(st.booleans())))
    longest = max(len(r.prompt_token_ids) + r.output_len for r in reqs)
    max_num_seqs = draw(st.integers(2, 6) | st.just(1))
    chunked = draw(st.booleans())
    budget = draw(st.integers(max_num_seqs, max_num_seqs + 40))
    if not chunked: budget = max(budget, longest)
    policy = draw(st.sampled_from(["continuous"] * 3 + ["static"]))
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=longest,
                          enable_chunked_prefill=chunked, policy=policy)
    tight = CacheConfig(ceil_div(longest, bs) + draw(st.integers(0, 6)), bs, draw(st.booleans()),
                        draw(st.sampled_from([0.0, 0.01, 0.2])))
    return reqs, cfg, tight


@settings(PROPS, max_examples=800)
@given(fork_workloads())
def test_forks_same_tokens_and_invariants(w):
    "Forked choices, under preemption and aborts: invariants every step, no hang, every choice's own tokens."
    reqs, cfg, tight = w
    res = simulate(reqs, cfg, tight, check_kv=True, check_invariants=True, max_steps=bound(reqs))
    for r in reqs:
        s, full = res.seqs[r.seq_id], full_outputs(reqs, r.seq_id)
        if s.finish_reason == "abort": assert s.output_token_ids == full[:len(s.output_token_ids)]
        else:
            assert s.output_token_ids == full
            assert s.num_prefill_tokens >= 1                     # it computed its last prompt token itself
            if not s.num_preemptions:                            # computed exactly what it did not share
                assert s.num_prefill_tokens == len(r.prompt_token_ids) - s.num_cached_tokens - s.num_shared_tokens
        if not r.cache_prefix: assert s.num_cached_tokens == 0 and s.num_shared_tokens == 0
        if s.num_shared_tokens: event("forked")
        if s.num_shared_tokens and s.num_preemptions: event("a forked choice was preempted")
    if res.num_preemptions: event("preempted")


@PROPS
@given(fork_workloads())
def test_forks_compute_the_prompt_once(w):
    "With room for everything (no preemption, no aborts), a child of a parent still running forks every full block."
    reqs, cfg, _ = w
    bs = 4
    for r in reqs: r.abort_step = None
    roomy = CacheConfig(sum(ceil_div(len(r.prompt_token_ids) + r.output_len, bs) for r in reqs) + 1, bs,
                        enable_prefix_caching=False, watermark=0.0)
    longest = max(len(r.prompt_token_ids) + r.output_len for r in reqs)
    cfg = SchedulerConfig(max_num_seqs=len(reqs), max_num_batched_tokens=max(len(reqs), longest), max_model_len=longest)
    res = simulate(reqs, cfg, roomy, check_kv=True, check_invariants=True, max_steps=bound(reqs))
    assert res.num_preemptions == 0
    for r in reqs:
        s = res.seqs[r.seq_id]
        full_blocks = (len(r.prompt_token_ids) - 1) // bs * bs
        if r.fork_of is not None and reqs[r.fork_of].output_len > 1 and full_blocks:
            parent = res.seqs[r.fork_of]
            if parent.finish_step > s.arrival_step:              # the parent was still there to fork from
                assert s.num_shared_tokens == full_blocks, (r, s.num_shared_tokens)
                assert s.num_prefill_tokens == len(r.prompt_token_ids) - full_blocks
                event("forked every full block")


def test_n8_on_a_1000_token_prompt_computes_it_once():
    reqs = [Request(i, list(range(1000)), 8, fork_of=0 if i else None) for i in range(8)]
    for prefix in (False, True):
        res = simulate(reqs, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=1024),
                       CacheConfig(600, 16, enable_prefix_caching=prefix), check_kv=True, check_invariants=True)
        assert sum(s.num_prefill_tokens for s in res.seqs.values()) == 1000 + 7 * (1000 % 16)
        assert len(set(map(tuple, res.outputs.values()))) == 1


@pytest.mark.parametrize("prefix", [False, True])
def test_fork_parent_aborted_between_schedule_and_update(prefix):
    "The step that forks the child: its parent is aborted before the step is applied; the child runs on alone."
    sched, _ = tiny(num_blocks=16, prefix=prefix, max_num_batched_tokens=16)
    model = FakeModel(16, 4, vocab_size=MODEL_VOCAB, check_kv=True)
    child = Sequence(1, list(range(10)), 6, fork_of=0)
    sched.add(Sequence(0, list(range(10)), 6)); sched.add(child)
    step = sched.schedule(); sched.update(step, model.step(step))           # the parent's prefill; the child waits
    step = sched.schedule()                                                  # the child forks
    assert child.num_shared_tokens == 8 and [s.seq_id for s in step.seqs] == [0, 1]
    sched.abort(0)
    sched.check_invariants()
    sched.update(step, model.step(step))
    for _ in range(100):
        sched.check_invariants()
        if not sched.has_unfinished(): break
        step = sched.schedule(); sched.update(step, model.step(step))
    assert not sched.has_unfinished() and sched.block_manager.num_free_blocks == 16
    assert child.output_token_ids == oracle_tokens(list(range(10)), 6, frozenset())
    assert child.num_prefill_tokens == 2


@pytest.mark.parametrize("prefix", [False, True])
def test_child_of_a_preempted_parent_never_hangs(prefix):
    "An older request grows through the pool, preempting the parent and its child; all run to their own tokens."
    sched, _ = tiny(num_blocks=8, prefix=prefix, max_num_batched_tokens=8, max_model_len=32, trace=Trace())
    model = FakeModel(8, 4, vocab_size=MODEL_VOCAB, check_kv=True)
    specs = {0: (list(range(5, 14)), 20, None), 1: (list(range(9)), 8, None), 2: (list(range(9)), 8, 1),
             3: (list(range(9)), 6, 1)}
    seqs = {i: Sequence(i, list(p), m, fork_of=f) for i, (p, m, f) in specs.items()}
    for seq in seqs.values(): sched.add(seq)
    for _ in range(300):
        if not sched.has_unfinished(): break
        step = sched.schedule(); sched.update(step, model.step(step)); sched.check_invariants()
    assert not sched.has_unfinished() and sched.num_preemptions > 0
    assert "parent" in {e["reason"] for e in sched.trace.of("wait") if e["seq"] == 2}
    for i, (p, m, _) in specs.items(): assert seqs[i].output_token_ids == oracle_tokens(p, m, frozenset())


def test_fork_requests_that_are_refused():
    sched, _ = tiny()
    sched.add(Sequence(0, [1, 2, 3], 2))
    with pytest.raises(ValueError, match="prompts differ"): sched.add(Sequence(1, [1, 2], 2, fork_of=0))
    with pytest.raises(ValueError, match="cannot fork itself"): sched.add(Sequence(1, [1, 2], 2, fork_of=1))
    sched.add(Sequence(1, [1, 2], 2, fork_of=99))                    # an unknown parent: admitted normally
    while sched.has_unfinished():
        step = sched.schedule(); sched.update(step, [1] * len(step.sample_seq_ids))
    sched.check_invariants()
