"""Recorded schedules replay event for event.

`tests/data/*.jsonl` are traces of tricky schedules (preemption, prefix-cache hits, chunked prefill, aborts via
`Request.abort_step`, the static policy), recorded with `simulate(..., trace=Trace())` and `Trace.to_jsonl`. Each
test re-runs the recorded workload with `replay(path)` and requires the same decisions, so any change to the
scheduler's behaviour shows up here with the first event that differs.

The recipes are below; after an intended change of behaviour, regenerate the files with
`python tests/test_replay.py` and review the diff.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from nanoserve.block_manager import CacheConfig
from nanoserve.scheduler import Request, SchedulerConfig, Trace, lognormal_workload, replay, simulate

DATA = Path(__file__).resolve().parent / "data"


def preempt_prefix_chunked():
    "Continuous batching, 12-token budget, requests sharing a system prompt in a pool that preempts; one abort."
    reqs = lognormal_workload(14, seed=5, prompt_median=10, output_median=10, max_prompt_len=30, max_output_len=24,
                              shared_prefix_len=9, arrival_rate=1.5, vocab_size=50)
    reqs[3].abort_step = reqs[3].arrival_step + 4
    return reqs, SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=12, max_model_len=64), \
        CacheConfig(num_blocks=22, block_size=4, enable_prefix_caching=True, watermark=0.0)


def static_policy():
    "Static batches of 3 under a tight pool (preemption inside a batch), chunked prefill, prefix hits, an abort."
    reqs = lognormal_workload(10, seed=8, prompt_median=8, output_median=12, max_prompt_len=24, max_output_len=30,
                              shared_prefix_len=6, arrival_rate=2.0, vocab_size=50)
    reqs[4].abort_step = reqs[4].arrival_step + 2
    return reqs, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10, max_model_len=64, policy="static",
                                 static_batch_size=3), \
        CacheConfig(num_blocks=16, block_size=4, enable_prefix_caching=True, watermark=0.0)


def giant_and_aborts():
    "A request needing the whole pool beside others, a watermark, whole-prompt prefill, aborts in several states."
    reqs = [Request(0, list(range(100, 112)), 20, arrival_step=1)]                       # 32 tokens: 8 blocks
    reqs += [Request(i, [7, 7, 7, 7, 7, i], 6 + i, arrival_step=i // 2) for i in range(1, 7)]
    reqs[3].abort_step = 3          # in decode
    reqs[5].abort_step = 9          # waiting, never admitted
    reqs[6].abort_step = 25         # waiting again after a preemption
    return reqs, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32,
                                 enable_chunked_prefill=False), \
        CacheConfig(num_blocks=8, block_size=4, enable_prefix_caching=True, watermark=0.2)


RECIPES = {f.__name__: f for f in (preempt_prefix_chunked, static_policy, giant_and_aborts)}


def record(name: str) -> Trace:
    reqs, sched_cfg, cache_cfg = RECIPES[name]()
    trace = Trace()
    simulate(reqs, sched_cfg, cache_cfg, check_kv=True, check_invariants=True, trace=trace)
    return trace


def first_difference(a: list[dict], b: list[dict]) -> str | None:
    "None if equal, else a message naming the first differing event and both versions of it."
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y: return f"event {i} differs:\n  recorded: {json.dumps(x)}\n  replayed: {json.dumps(y)}"
    if len(a) != len(b):
        i = min(len(a), len(b))
        extra = ("recorded", a) if len(a) > len(b) else ("replayed", b)
        return (f"recorded {len(a)} events, replayed {len(b)}; first extra event {i} ({extra[0]}): "
                f"{json.dumps(extra[1][i])}")
    return None


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_replay_matches_recording(name):
    path = DATA / f"{name}.jsonl"
    assert path.stat().st_size < 200_000
    recorded, replayed = replay(path)
    diff = first_difference(recorded.events, replayed.events)
    assert diff is None, f"{path.name}: the scheduler's decisions changed; {diff}"


def test_recordings_are_what_the_recipes_make():
    "The committed files were made by the recipes above (their configs and workloads are the same)."
    for name in RECIPES:
        reqs, sched_cfg, cache_cfg = RECIPES[name]()
        cfg = Trace.from_jsonl(DATA / f"{name}.jsonl").events[0]
        assert cfg["event"] == "config"
        assert SchedulerConfig(**cfg["scheduler"]) == sched_cfg and CacheConfig(**cfg["cache"]) == cache_cfg
        assert [Request(**r) for r in cfg["requests"]] == reqs


def features(events: list[dict]) -> set[str]:
    got = set()
    for e in events:
        if e["event"] == "preempt": got.add("preemption")
        if e["event"] == "admit" and e["cached"]: got.add("prefix hit")
        if e["event"] == "admit" and e["recompute"]: got.add("re-admission")
        if e["event"] == "finish" and e["reason"] == "abort": got.add("abort")
        if e["event"] == "finish" and e["reason"] == "abort" and e["preemptions"]: got.add("abort after preemption")
        if e["event"] == "step" and any(start > 0 and start % 4 for _, start, _ in e["prefill"]):
            got.add("chunk continuing mid-block")
        if e["event"] == "wait": got.add(f"wait:{e['reason']}")
    return got


@pytest.mark.parametrize("name, needed", [
    ("preempt_prefix_chunked", {"preemption", "prefix hit", "re-admission", "abort", "chunk continuing mid-block",
                                "wait:budget", "wait:preempted"}),
    ("static_policy", {"preemption", "prefix hit", "abort", "wait:static_batch"}),
    ("giant_and_aborts", {"preemption", "abort", "prefix hit", "wait:blocks", "abort after preemption"}),
])
def test_recordings_cover_the_tricky_cases(name, needed):
    events = Trace.from_jsonl(DATA / f"{name}.jsonl").events
    assert needed <= features(events), f"{name} lacks {needed - features(events)}"
    if name == "static_policy": assert events[0]["scheduler"]["policy"] == "static"


def test_replay_notices_a_changed_decision(tmp_path):
    "A recorded decision that the scheduler would not take is reported, with its index."
    events = Trace.from_jsonl(DATA / "preempt_prefix_chunked.jsonl").events
    i = next(k for k, e in enumerate(events) if e["event"] == "step" and e["step"] == 5)
    events[i] = {**events[i], "num_tokens": events[i]["num_tokens"] + 1}
    t = Trace(); t.events = events
    t.to_jsonl(tmp_path / "changed.jsonl")
    recorded, replayed = replay(tmp_path / "changed.jsonl")
    diff = first_difference(recorded.events, replayed.events)
    assert diff is not None and diff.startswith(f"event {i} differs")
    assert first_difference(events, events[:-1]).startswith(f"recorded {len(events)} events, replayed")


def test_replay_rejects_a_file_not_starting_with_the_config(tmp_path):
    events = Trace.from_jsonl(DATA / "giant_and_aborts.jsonl").events
    path = tmp_path / "no_config.jsonl"
    t = Trace(); t.events = events[1:] + events[:1]          # the config is there, but not first
    t.to_jsonl(path)
    with pytest.raises(ValueError, match="first event must be the config"):
        replay(path)


if __name__ == "__main__":   # regenerate the recordings: python tests/test_replay.py
    DATA.mkdir(exist_ok=True)
    for name in (sys.argv[1:] or RECIPES):
        trace = record(name)
        trace.to_jsonl(DATA / f"{name}.jsonl")
        print(name, len(trace.events), "events", (DATA / f"{name}.jsonl").stat().st_size, "bytes",
              sorted(features(trace.events)))
