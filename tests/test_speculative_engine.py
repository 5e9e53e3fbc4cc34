"""Speculative decoding in the engine, on the CPU: with prompt lookup on, every request gets exactly the tokens it
gets with it off (greedy and seeded sampling, in the scheduler's regimes: chunked prefill, preemption, prefix hits,
forks, stop tokens, max_tokens at every offset), drafts are really verified and kept, no block leaks, and what
cannot speculate (extras, grammars) decodes as before."""
from types import SimpleNamespace

import pytest
import torch

from nanoserve.bench import build_parser as bench_parser, engine_kwargs_from_args
from nanoserve.engine import LLM, SamplingParams
from nanoserve.graphs import graph_batch_sizes, graph_token_sizes
from nanoserve.server import ServerMetrics, build_parser as serve_parser, engine_kwargs
from nanoserve.speculative import SpeculativeConfig
from nanoserve.tokenizer import default_model, ensure_default_model
from nanoserve.train import draft_model_dir

MODEL = default_model()            # the trained tiny model: it repeats code, so prompt lookup's drafts often hold
PROMPTS = ["import os\nimport sys\nimport os\n", "def f(x):\n    return x\n\ndef g(x):\n    return", "Hello",
           "for i in range(10):\n    print(i)\nfor i in range(10):\n", "class A:\n    pass\n\n\nclass B", "x = 1\n" * 9]
MAX_TOKENS = (40, 33, 7, 48, 1, 26)


def _run(speculative, params, num_kv_blocks=96, max_num_batched_tokens=64, max_num_seqs=4, prompts=PROMPTS,
         async_scheduling=False):
    "Outputs of `prompts`, stepping by hand with every invariant checked after each step; the engine too."
    llm = LLM(MODEL, dtype="float32", num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_num_batched_tokens, speculative=speculative, async_scheduling=async_scheduling)
    for p, sp in zip(prompts, params): llm.add_request(p, sp, stream=False)
    outs, drafts, steps = {}, {}, 0
    while llm.has_unfinished_requests():
        for o in llm.step():
            if not o.finished: continue
            outs[(o.request_id, o.index)] = (o.token_ids, o.finish_reason, o.num_preemptions)
            drafts[(o.request_id, o.index)] = (o.num_draft_tokens, o.num_accepted_tokens)
        llm.scheduler.check_invariants()
        steps += 1
    assert llm.block_manager.num_used_blocks == 0 and not llm.scheduler.seqs     # nothing leaked
    llm.per_request_drafts = [drafts[k] for k in sorted(drafts)]                   # (drafted, kept) of each request
    return [outs[k] for k in sorted(outs)], steps, llm


def _greedy(max_tokens=MAX_TOKENS, **kw):
    return [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, **kw) for m in max_tokens]


@pytest.mark.parametrize("regime", ["plain", "chunked", "preempt"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_tokens_are_plain_decodings(regime, temperature):
    kw = {"plain": {}, "chunked": {"max_num_batched_tokens": 16}, "preempt": {"num_kv_blocks": 7}}[regime]
    params = [SamplingParams(max_tokens=m, temperature=temperature, seed=i, ignore_eos=True)
              for i, m in enumerate(MAX_TOKENS)]
    plain, plain_steps, _ = _run(None, params, **kw)
    spec, spec_steps, llm = _run(SpeculativeConfig(), params, **kw)
    assert [t for t, _, _ in spec] == [t for t, _, _ in plain]
    assert [r for _, r, _ in spec] == [r for _, r, _ in plain]
    assert llm.num_accepted_tokens > 0 and llm.num_draft_tokens >= llm.num_accepted_tokens
    drafted, accepted = map(sum, zip(*llm.per_request_drafts))       # each request's counts add up to the engine's
    assert (drafted, accepted) == (llm.num_draft_tokens, llm.num_accepted_tokens)
    if regime == "preempt": assert sum(p for _, _, p in spec) > 0               # 7 blocks of 16: preemption happens
    if regime == "plain" and temperature == 0: assert spec_steps < plain_steps


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_adaptive_k_changes_drafts_not_tokens(temperature):
    params = [SamplingParams(max_tokens=m, temperature=temperature, seed=i, ignore_eos=True)
              for i, m in enumerate(MAX_TOKENS)]
    fixed, _, fixed_llm = _run(SpeculativeConfig(num_speculative_tokens=6), params)
    adaptive, _, llm = _run(SpeculativeConfig(num_speculative_tokens=6, adaptive_k=True), params)
    assert [t for t, _, _ in adaptive] == [t for t, _, _ in fixed]
    assert 0 < llm.num_accepted_tokens <= llm.num_draft_tokens < fixed_llm.num_draft_tokens   # fewer drafts wasted
    assert llm.num_draft_tokens - llm.num_accepted_tokens < fixed_llm.num_draft_tokens - fixed_llm.num_accepted_tokens


def test_backs_off_where_lookup_finds_nothing():
    # suffixes of 3 tokens rarely recur in short outputs: drafting steps often find nothing and the engine backs off
    params = _greedy()
    plain, _, _ = _run(None, params, async_scheduling=True)
    spec = SpeculativeConfig(prompt_lookup_min=3, backoff_after=2, backoff_steps=5)
    llm = LLM(MODEL, dtype="float32", num_kv_blocks=96, max_num_seqs=4, max_num_batched_tokens=64, speculative=spec)
    for p, sp in zip(PROMPTS, params): llm.add_request(p, sp, stream=False)
    outs, backing_off, resumed = {}, 0, 0
    while llm.has_unfinished_requests():
        resumed += backing_off > 0 and llm._speculates()          # a step that may draft after a back-off
        assert not (llm._backoff_left > 1 and llm._speculates())   # none while backing off (the step counts one down)
        for o in llm.step():
            if o.finished: outs[o.request_id] = o.token_ids
        backing_off += llm._backoff_left > 0
        llm.scheduler.check_invariants()
    assert [outs[k] for k in sorted(outs)] == [t for t, _, _ in plain]
    assert backing_off > 0 and resumed > 0 and llm.num_draft_tokens > 0     # it backs off, then drafts again
    assert llm.block_manager.num_used_blocks == 0


def test_stop_tokens_and_eos_mid_draft():
    "A stop token among the accepted drafts ends the request there, as it would one token at a time."
    full, _, _ = _run(None, _greedy())
    stops = [toks[len(toks) // 2] if len(toks) > 2 else 0 for toks, _, _ in full]
    params = [SamplingParams(max_tokens=m, temperature=0, stop_token_ids=[t]) for m, t in zip(MAX_TOKENS, stops)]
    plain, _, _ = _run(None, params)
    spec, _, llm = _run(SpeculativeConfig(num_speculative_tokens=8), params)
    assert spec == plain and sum(r == "stop" for _, r, _ in spec) >= 3
    assert llm.num_accepted_tokens > 0


def test_stop_strings_end_where_they_would():
    "A request with stop strings decodes one token at a time: its tokens and text are plain decoding's."
    full, _, llm = _run(None, _greedy())
    texts = [llm.tokenizer.decode(t) for t, _, _ in full]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, stop=[x[len(x) // 2:len(x) // 2 + 2]])
              if len(x) > 6 else SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
              for m, x in zip(MAX_TOKENS, texts)]
    params = [p if i % 2 else SamplingParams(max_tokens=p.max_tokens, temperature=0, ignore_eos=True)
              for i, p in enumerate(params)]                                  # every other request has a string
    plain, _, _ = _run(None, params)
    spec, _, llm = _run(SpeculativeConfig(), params)
    assert spec == plain and sum(r == "stop" for _, r, _ in spec) >= 2 and llm.num_accepted_tokens > 0
    assert all(drafted == 0 for (drafted, _), p in zip(llm.per_request_drafts, params) if p.stop)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
def test_max_tokens_at_every_offset(max_tokens):
    "Drafts are capped so that a step never passes max_tokens."
    params = _greedy([max_tokens] * len(PROMPTS))
    plain, _, _ = _run(None, params)
    spec, _, _ = _run(SpeculativeConfig(num_speculative_tokens=4), params)
    assert spec == plain and all(len(t) == max_tokens for t, _, _ in spec)


def test_prefix_hits_and_forks():
    "A repeated prompt hits the prefix cache (only accepted tokens are named), and n choices fork their prompt."
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[3]]
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
              SamplingParams(n=3, max_tokens=20, temperature=0.9, seed=5, ignore_eos=True)]
    plain, _, _ = _run(None, params, prompts=prompts, max_num_seqs=2)
    spec, _, llm = _run(SpeculativeConfig(), params, prompts=prompts, max_num_seqs=2)
    assert spec == plain and llm.block_manager.num_hit_tokens > 0 and llm.num_accepted_tokens > 0


def test_requests_with_extras_decode_one_token_at_a_time():
    "While a live request asks for logprobs, nobody drafts; the tokens are unchanged either way."
    params = _greedy()
    params[0] = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)
    plain, _, _ = _run(None, params, max_num_seqs=8)
    spec, _, llm = _run(SpeculativeConfig(), params, max_num_seqs=8)
    assert spec == plain
    alone, _, lone = _run(SpeculativeConfig(), params[:1], prompts=PROMPTS[:1])
    assert alone == plain[:1] and lone.num_draft_tokens == 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_async_scheduling_between_drafting_steps(temperature):
    """Under async scheduling the engine steps ahead while the batch is too wide to draft (here more than 2
    sequences), settles the step in flight before a drafting step, and gives plain decoding's tokens throughout."""
    params = [SamplingParams(max_tokens=m, temperature=temperature, seed=i, ignore_eos=True)
              for i, m in enumerate(MAX_TOKENS)]
    plain, _, _ = _run(None, params, async_scheduling=True)
    spec, _, llm = _run(SpeculativeConfig(max_num_seqs=2), params, async_scheduling=True)
    assert spec == plain and llm.async_scheduling and llm.num_draft_tokens > 0
    if temperature == 0: assert llm.num_accepted_tokens > 0


def test_configuration_is_checked():
    with pytest.raises(ValueError, match="method's name"):
        LLM(MODEL, speculative=3.5)
    with pytest.raises(ValueError, match="must be one of"):
        LLM(MODEL, speculative="eagle")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(MODEL, speculative=SpeculativeConfig(), tensor_parallel_size=2)
    llm = LLM(MODEL, num_kv_blocks=16, speculative=SpeculativeConfig(num_speculative_tokens=2))
    assert "speculative=SpeculativeConfig(" in str(llm.engine_config)


def test_verify_steps_replay_in_the_mixed_step_graphs():
    "Verify rows run in the token-bucket graphs (here their static buffers, without capture): the eager tokens."
    tiny = ensure_default_model()       # the random tiny model: the Triton interpreter runs every kernel

    def run(speculative, graphs):
        llm = LLM(tiny, dtype="float32", attention_backend="triton", enforce_eager=True, num_kv_blocks=12,
                  max_num_seqs=4, max_num_batched_tokens=64, speculative=speculative)
        if graphs:
            llm.runner.enable_graphs(graph_batch_sizes(4), llm.max_model_len, capture=False,
                                     token_sizes=graph_token_sizes(64), max_rows=llm.max_draws)
        rng = torch.Generator().manual_seed(1)
        lengths = torch.randint(1, 30, (6,), generator=rng)
        prompts = [torch.randint(0, 50, (int(n),), generator=rng).tolist() for n in lengths]
        outs = llm.generate(prompts, [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
                                      for m in (5, 17, 9, 30, 2, 12)])
        return [o.token_ids for o in outs], llm

    plain, _ = run(None, False)
    spec, llm = run(SpeculativeConfig(), True)
    assert spec == plain
    assert llm.num_accepted_tokens > 0 and llm.runner.mixed_graphs.num_replays > 5
    assert llm.max_draws == 4 + 4 * 8 and llm.runner.graphs.logits.shape[0] == llm.max_draws


def test_command_lines_and_metrics():
    "`bench` and `serve` take --speculative; the engine's counts reach /metrics."
    argv = ["--speculative", "ngram", "--num-speculative-tokens", "3"]
    kw = engine_kwargs_from_args(bench_parser().parse_args(argv))
    assert kw["speculative"] == {"method": "ngram", "num_speculative_tokens": 3, "adaptive_k": False}
    adaptive = engine_kwargs(serve_parser().parse_args(argv + ["--speculative-adaptive-k"]))["speculative"]
    assert adaptive == {**kw["speculative"], "adaptive_k": True}
    bench_adaptive = engine_kwargs_from_args(bench_parser().parse_args(argv + ["--speculative-adaptive-k"]))
    assert bench_adaptive["speculative"] == adaptive
    served = engine_kwargs(serve_parser().parse_args(argv))
    assert served["speculative"] == kw["speculative"]
    assert engine_kwargs(serve_parser().parse_args([]))["speculative"] is None
    llm = LLM(MODEL, dtype="float32", num_kv_blocks=64, speculative=served["speculative"])
    assert llm.engine_config.speculative == SpeculativeConfig(num_speculative_tokens=3)
    outs = llm.generate(PROMPTS[:2], _greedy((30, 30)))
    metrics = ServerMetrics(llm.num_kv_blocks)
    metrics.update(llm, 0, [(SimpleNamespace(arrival_time=o.arrival_time), o) for o in outs], ["length"] * 2)
    text = metrics.render()
    verified = [o for o in outs if o.num_verify_steps]
    assert verified and f"nanoserve_spec_accepted_per_verify_step_count {len(verified)}" in text
    mean = sum(o.num_accepted_tokens / o.num_verify_steps for o in verified)
    assert f"nanoserve_spec_accepted_per_verify_step_sum {mean!r}" in text
    assert f"nanoserve_spec_draft_tokens_total {llm.num_draft_tokens}" in text and llm.num_draft_tokens > 0
    assert f"nanoserve_spec_accepted_tokens_total {llm.num_accepted_tokens}" in text


@pytest.mark.parametrize("regime", ["plain", "preempt"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_draft_model_gives_plain_decodings(regime, temperature):
    """The shipped draft proposing: every request gets its tokens without speculation (greedy and seeded, with and
    without preemption: 7 blocks, and the draft's own cache small enough to preempt too), drafts are kept, fewer steps;
    the draft engine holds no block once its drafts are made."""
    kw = {"plain": {}, "preempt": {"num_kv_blocks": 7}}[regime]
    params = [SamplingParams(max_tokens=m, temperature=temperature, seed=i, ignore_eos=True)
              for i, m in enumerate(MAX_TOKENS)]
    plain, plain_steps, _ = _run(None, params, **kw)
    spec, spec_steps, llm = _run(SpeculativeConfig("draft"), params, **kw)
    assert [t for t, _, _ in spec] == [t for t, _, _ in plain] and [r for _, r, _ in spec] == [r for _, r, _ in plain]
    assert llm.drafter.engine.model_dir == draft_model_dir() and llm.drafter.engine.block_manager.num_used_blocks == 0
    assert 0 < llm.num_accepted_tokens <= llm.num_draft_tokens
    if temperature == 0: assert spec_steps < plain_steps


def test_the_target_as_its_own_draft_keeps_its_drafts():
    "A draft that is the target itself proposes the target's greedy tokens: (nearly) every draft is kept."
    spec, _, llm = _run(SpeculativeConfig("draft", str(MODEL)), _greedy())
    assert spec == _run(None, _greedy())[0]
    assert llm.num_draft_tokens > 50 and llm.num_accepted_tokens >= 0.9 * llm.num_draft_tokens


def test_draft_model_drafts_within_its_context(monkeypatch):
    """The draft engine shares the target's context length; a sequence that fills it gets no drafts, one near it fewer.
    It keeps the target's CPU threads (without OMP_NUM_THREADS an engine would pick half the cores)."""
    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        llm = LLM(MODEL, dtype="float32", num_kv_blocks=8, max_model_len=64, speculative=SpeculativeConfig("draft"),
                  num_threads=2)
        assert torch.get_num_threads() == 2                                   # the draft kept the target's threads
    finally:
        torch.set_num_threads(threads)
    d = llm.drafter
    assert d.engine.max_model_len == 64 and d.engine.block_size == llm.block_size
    assert d.propose({1: (list(range(5, 69)), 4)}) == {}                      # 64 tokens: the context is full
    got = d.propose({1: (list(range(5, 67)), 4), 2: ([5, 6, 7], 4)})
    assert (len(got[1]), len(got[2])) == (2, 4)                               # 62 tokens: room for 2


def test_a_draft_of_a_shorter_context_drafts_where_it_can(tmp_path):
    """A draft whose context is shorter than the target's serves its own; a sequence past it gets no drafts, and
    every request still gets its plain tokens."""
    import json, shutil
    folder = tmp_path / "draft"
    shutil.copytree(draft_model_dir(), folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 48}))
    prompts = ["x = 1\n" * 9, "Hello"]              # 45 and 3 tokens, 40 more each: the first passes 48 on the way
    params = _greedy((40, 40))
    plain, _, _ = _run(None, params, prompts=prompts)
    spec, _, llm = _run(SpeculativeConfig("draft", str(folder)), params, prompts=prompts)
    assert spec == plain and llm.drafter.engine.max_model_len == 48 < llm.max_model_len
    assert llm.num_accepted_tokens > 0


def test_a_draft_over_another_tokenizer_is_refused(tmp_path):
    import json, shutil
    folder = tmp_path / "draft"
    shutil.copytree(draft_model_dir(), folder)
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]                                   # two ids swapped: another tokenizer
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="its tokenizer is not the target's"):
        LLM(MODEL, dtype="float32", num_kv_blocks=16, speculative=SpeculativeConfig("draft", str(folder)))


def test_command_lines_take_a_draft_model():
    argv = ["--speculative", "draft", "--speculative-draft-model", "some/draft"]
    want = {"method": "draft", "adaptive_k": False, "draft_model": "some/draft"}
    assert engine_kwargs_from_args(bench_parser().parse_args(argv))["speculative"] == want
    assert engine_kwargs(serve_parser().parse_args(argv))["speculative"] == want
