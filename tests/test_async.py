"Async scheduling (step N+1 scheduled while step N runs) gives what the synchronous engine gives, on the CPU."
import pytest
import torch

from nanoserve.block_manager import BlockManager
from nanoserve.engine import LLM, SamplingParams
from nanoserve.scheduler import Scheduler, SchedulerConfig, Sequence
from nanoserve.tokenizer import ensure_default_model

TINY = ensure_default_model()
LENGTHS = (3, 20, 9, 33, 14, 5, 27, 40, 2)
MAX_TOKENS = (11, 4, 23, 9, 16, 30, 2, 1, 12)


def _prompts(vocab_size):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in LENGTHS]


def _generate(async_scheduling, num_kv_blocks=64, params=None, temperature=0.0, **kw):
    llm = LLM(TINY, dtype="float32", num_kv_blocks=num_kv_blocks, max_num_seqs=5, max_num_batched_tokens=48,
              async_scheduling=async_scheduling, **kw)
    params = params or [SamplingParams(max_tokens=m, temperature=temperature, seed=i, ignore_eos=True)
                        for i, m in enumerate(MAX_TOKENS)]
    outs = llm.generate(_prompts(llm.config.vocab_size), params)
    llm.scheduler.check_invariants()
    assert llm.block_manager.num_free_blocks == llm.num_kv_blocks and not llm.scheduler.seqs
    return [(o.token_ids, o.finish_reason, o.text) for o in outs], sum(o.num_preemptions for o in outs)


@pytest.mark.parametrize("num_kv_blocks,temperature", [(64, 0.0), (64, 0.9), (6, 0.0), (6, 0.9)])
def test_async_gives_the_synchronous_tokens(num_kv_blocks, temperature):
    sync, pre_sync = _generate(False, num_kv_blocks, temperature=temperature)
    asyn, pre_async = _generate(True, num_kv_blocks, temperature=temperature)
    assert asyn == sync
    assert pre_async == pre_sync and (num_kv_blocks == 64 or pre_sync > 0)     # 6 blocks: preemptions happen


def test_stop_tokens_and_strings_end_at_the_same_place():
    "A stop token sampled in step N is only seen after step N+1 was launched: its extra token is dropped."
    full, _ = _generate(False)
    stop_ids = [toks[len(toks) // 2] if len(toks) > 2 else 0 for toks, _, _ in full]
    stop_texts = [text[len(text) // 2:len(text) // 2 + 2] if len(text) > 6 else None for _, _, text in full]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, stop_token_ids=[t], stop=st)
              for m, t, st in zip(MAX_TOKENS, stop_ids, stop_texts)]
    sync, _ = _generate(False, params=params)
    asyn, _ = _generate(True, params=params)
    assert asyn == sync
    assert sum(reason == "stop" for _, reason, _ in sync) >= 4


def test_streamed_reports_match():
    "Every request's stream of (new tokens, finished) is the same; the async one is one call later."
    streams = []
    for async_scheduling in (False, True):
        llm = LLM(TINY, dtype="float32", num_kv_blocks=32, max_num_seqs=3, max_num_batched_tokens=32,
                  async_scheduling=async_scheduling)
        for p, m in zip(_prompts(llm.config.vocab_size), MAX_TOKENS):
            llm.add_request(p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
        got = {}
        while llm.has_unfinished_requests():
            for out in llm.step():
                got.setdefault(out.request_id, []).append((tuple(out.new_token_ids), out.finished))
        assert all(t >= 0 for s in got.values() for new, _ in s for t in new)
        streams.append(got)
    assert streams[0] == streams[1]


def test_abort_while_a_step_is_in_flight():
    llm = LLM(TINY, dtype="float32", num_kv_blocks=32, max_num_seqs=4, async_scheduling=True)
    ids = [llm.add_request(p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
           for p in _prompts(llm.config.vocab_size)[:3]]
    for _ in range(4): llm.step()
    assert llm._inflight is not None
    assert llm.abort_request(ids[1])
    outs = []
    while llm.has_unfinished_requests(): outs += llm.step()
    done = {o.request_id: o for o in outs if o.finished}
    assert set(done) == {ids[0], ids[2]} and all(len(o.token_ids) == 20 for o in done.values())
    llm.step()                                      # resolves whatever is left in flight
    assert llm._inflight is None and llm.block_manager.num_free_blocks == 32


def test_scheduler_advance_and_resolve():
    "Placeholders -(1 + j) stand for the in-flight step's samples; max_tokens ends a sequence at advance."
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), BlockManager(8, 4))
    sched.add(Sequence(0, [5, 6, 7], max_tokens=3, stop_token_ids=frozenset({99})))
    sched.add(Sequence(1, [8, 9], max_tokens=1))
    step = sched.schedule()
    sched.advance(step)
    a, b = sched.seqs[0], sched.seqs[1]
    assert a.output_token_ids == [-1] and b.output_token_ids == [-2]
    assert b in sched.finishing and b not in sched.running and 1 not in sched.block_manager
    with pytest.raises(RuntimeError, match="resolve"):
        sched.advance(sched.schedule())
    nxt = sched._pending_step                     # scheduled while step 0 is in flight: a decode of the placeholder
    assert [s.token_ids for s in nxt.seqs] == [[-1]]
    with pytest.raises(ValueError, match="advance"):
        sched.resolve(nxt, [1])
    finished = sched.resolve(step, [99, 42])      # 99 is a stop token: a finishes too, at its first token
    assert {s.seq_id for s in finished} == {0, 1}
    assert a.output_token_ids == [99] and a.finish_reason == "stop" and b.finish_reason == "length"
    sched.advance(nxt)                             # a is gone: nothing to apply
    assert sched.resolve(nxt, [7]) == [] and not sched.seqs
    sched.check_invariants()
    assert sched.block_manager.num_free_blocks == 8


def test_resolve_leaves_a_reused_id_alone():
    "A request aborted while its step is in flight, its id reused at once: the newcomer gets no token."
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), BlockManager(8, 4))
    sched.add(Sequence(0, [5, 6, 7], max_tokens=3))
    step = sched.schedule()
    sched.advance(step)
    sched.abort(0)
    newcomer = Sequence(0, [1, 2], max_tokens=2)
    sched.add(newcomer)
    assert sched.resolve(step, [42]) == [] and newcomer.output_token_ids == []
    sched.check_invariants()
