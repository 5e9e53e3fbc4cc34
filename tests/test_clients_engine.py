"""What clients ask of the engine, on the CPU: log-probabilities against transformers, n forks that share the
prompt, best_of, penalties, logit bias, min_tokens, grammars, and every one of them the same under async
scheduling (where a penalised row's last output token is a placeholder until the device resolves it) and under
preemption."""
import json
import math

import pytest
import torch

from helpers import (assert_all_free, build_tokenizer_source, hf_logits, make_checkpoint, quiet_transformers,
                     random_prompt, torch_threads)
from nanoserve.engine import LLM, SamplingParams
from nanoserve.sampler import LogitsProcessors, SamplingMetadata, apply_penalties, reset_slots, sample
from nanoserve.structured import StructuredOutputs


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    src = build_tokenizer_source(tmp_path_factory.mktemp("tokenizer"))
    folder = tmp_path_factory.mktemp("random-qwen2")
    hf = make_checkpoint(folder, seed=5, tokenizer_from=src)
    return folder, hf


@pytest.fixture(scope="module")
def engines(ckpt):
    "The same checkpoint, synchronous and async, fp32 on the CPU."
    folder, _ = ckpt
    return {mode: LLM(folder, dtype="float32", device="cpu", async_scheduling=mode == "async", max_num_seqs=8,
                      max_num_batched_tokens=64) for mode in ("sync", "async")}


def both(engines, prompts, params):
    "Generate on both engines; they must agree on every token and text; returns the sync outputs."
    outs = {m: e.generate(prompts, params) for m, e in engines.items()}
    assert [o.token_ids for o in outs["sync"]] == [o.token_ids for o in outs["async"]]
    assert [o.text for o in outs["sync"]] == [o.text for o in outs["async"]]
    for e in engines.values(): assert_all_free(e)
    return outs["sync"]


def test_logprobs_are_transformers_log_softmax(ckpt, engines):
    folder, hf = ckpt
    ids = random_prompt(20, 3072, seed=1)
    o = both(engines, [ids], SamplingParams(max_tokens=6, temperature=0, logprobs=5, prompt_logprobs=3))[0]
    full = ids + o.token_ids
    ref = hf_logits(hf, full).double().log_softmax(-1)                                     # [T, V]
    for k, entry in enumerate(o.logprobs):
        pos = len(ids) - 1 + k
        assert entry.token_id == o.token_ids[k]
        assert math.isclose(entry.logprob, ref[pos, entry.token_id].item(), abs_tol=2e-4)
        top = ref[pos].topk(5)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert entry.rank == 1                                      # greedy: the most likely
    assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(ids)
    for p in range(1, len(ids)):
        e = o.prompt_logprobs[p]
        assert e.token_id == ids[p]
        assert math.isclose(e.logprob, ref[p - 1, ids[p]].item(), abs_tol=2e-4)
        assert e.rank == int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1
        assert len(e.top) == 3
    assert math.isclose(o.cumulative_logprob, sum(x.logprob for x in o.logprobs), abs_tol=1e-6)


def test_prompt_logprobs_ignore_the_prefix_cache(engines):
    "A second request with the same prompt still scores every prompt position (no prefix-cache hits for it)."
    ids = random_prompt(40, 3072, seed=2)
    e = engines["sync"]
    e.generate([ids], SamplingParams(max_tokens=1))                   # caches the prompt's blocks
    a = e.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    b = e.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert a.num_cached_tokens == 0 and a.num_prefill_tokens == len(ids)
    assert [x.logprob for x in a.prompt_logprobs[1:]] == pytest.approx([x.logprob for x in b.prompt_logprobs[1:]], abs=1e-5)


def test_n_forks_compute_the_prompt_once(engines):
    ids = random_prompt(50, 3072, seed=3)
    outs = both(engines, [ids, ids[:7]], SamplingParams(n=3, max_tokens=5, seed=9))
    assert [o.index for o in outs] == [0, 1, 2, 0, 1, 2]
    assert [o.num_prefill_tokens for o in outs[:3]] == [50, 50 % 16, 50 % 16]
    assert len({tuple(o.token_ids) for o in outs[:3]}) == 3
    alone = engines["sync"].generate([ids], SamplingParams(n=3, max_tokens=5, seed=9))
    assert [o.token_ids for o in alone] == [o.token_ids for o in outs[:3]]


def test_best_of_returns_the_most_likely(engines):
    ids = random_prompt(12, 3072, seed=4)
    best = both(engines, [ids], SamplingParams(n=2, best_of=5, max_tokens=4, seed=1))
    every = engines["sync"].generate([ids], SamplingParams(n=5, max_tokens=4, seed=1, logprobs=0))
    ranked = sorted(every, key=lambda o: -o.cumulative_logprob)[:2]
    assert [o.token_ids for o in best] == [o.token_ids for o in ranked]
    assert [o.index for o in best] == [0, 1] and best[-1].request_finished


def test_penalties_match_the_formula_under_async(engines):
    "Penalties count every output token, the in-flight one too: async (placeholders) and sync agree."
    ids = random_prompt(10, 3072, seed=5)
    for p in (dict(frequency_penalty=1.5), dict(presence_penalty=-1.0), dict(repetition_penalty=1.3),
              dict(frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=0.8, temperature=0.9, seed=3)):
        plain = both(engines, [ids], SamplingParams(max_tokens=12, temperature=p.pop("temperature", 0), seed=p.get("seed")))
        pen = both(engines, [ids, ids[:5]], SamplingParams(max_tokens=12, temperature=0.9 if "seed" in p else 0, **p))
        assert len(pen) == 2


def test_penalties_formula():
    torch.manual_seed(0)
    logits = torch.randn(3, 40)
    out_ids = [[1, 1, 5], [], [7]]
    prompt_ids = [[2], [3, 4], []]
    pen = torch.tensor([[0.3, 0.7, 1.5], [0.0, 0.0, 2.0], [-0.5, 1.0, 1.0]])
    counts = torch.zeros(4, 40)                               # slots 0-2 and the scratch slot
    slots = torch.tensor([2, 0, 1])                           # the rows' slots, in another order
    rows = [slots[j].item() for j, o in enumerate(out_ids) for _ in o] + [slots[j].item() for j, o in enumerate(prompt_ids) for _ in o]
    values = [1.0] * sum(map(len, out_ids)) + [0.5] * sum(map(len, prompt_ids))
    reset_slots(counts, slots, torch.tensor(rows), torch.tensor(sum(out_ids, []) + sum(prompt_ids, [])), torch.tensor(values))
    p = LogitsProcessors(penalties=pen.T.contiguous(), counts=counts, slots=slots)
    got = apply_penalties(logits.clone(), p)
    ref = logits.clone()
    for j in range(3):
        presence, frequency, rep = pen[j].tolist()
        for t in set(out_ids[j]) | set(prompt_ids[j]):
            ref[j, t] = ref[j, t] / rep if ref[j, t] > 0 else ref[j, t] * rep
        for t in set(out_ids[j]):
            ref[j, t] -= frequency * out_ids[j].count(t) + presence
    torch.testing.assert_close(got, ref)


def test_logit_bias_min_tokens_and_vocab(engines):
    e = engines["sync"]
    ids = random_prompt(8, 3072, seed=6)
    assert both(engines, [ids], SamplingParams(max_tokens=3, temperature=0, logit_bias={17: 100}))[0].token_ids == [17] * 3
    forced_eos = SamplingParams(max_tokens=6, min_tokens=4, temperature=0, logit_bias={t: 100 for t in e.eos_token_ids})
    o = both(engines, [ids], forced_eos)[0]
    assert len(o.token_ids) == 5 and o.finish_reason == "stop"            # 4 held back, then the EOS
    with pytest.raises(ValueError, match="logit_bias"): e.generate([ids], SamplingParams(logit_bias={10**6: 1}))
    with pytest.raises(ValueError, match="stop_token_ids"): e.generate([ids], SamplingParams(stop_token_ids=[10**6]))
    assert_all_free(e)


def test_min_p_and_seed_batch_invariance(engines):
    ids = random_prompt(8, 3072, seed=7)
    params = SamplingParams(max_tokens=8, temperature=1.2, min_p=0.05, seed=11, presence_penalty=0.4, logprobs=2)
    alone = engines["sync"].generate([ids], params)[0].token_ids
    crowd = both(engines, [random_prompt(5, 3072, seed=8), ids, random_prompt(9, 3072, seed=9)],
                 [SamplingParams(max_tokens=8, temperature=0.7, seed=1), params, SamplingParams(max_tokens=8, seed=5)])
    assert crowd[1].token_ids == alone


def test_grammars_constrain_and_finish(engines):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 4}},
              "required": ["n", "s"], "additionalProperties": False}
    specs = [StructuredOutputs(json=schema), StructuredOutputs(regex=r"[a-c]{2,5}x"), StructuredOutputs(choice=("alpha", "beta")),
             StructuredOutputs(json_object=True)]
    ids = random_prompt(6, 3072, seed=10)
    outs = both(engines, [ids] * 4, [SamplingParams(max_tokens=40, temperature=0.8, seed=s, structured_outputs=spec)
                                     for s, spec in enumerate(specs)])
    for o in outs[:3]: assert o.finish_reason == "stop", o
    doc = json.loads(outs[0].text)
    assert set(doc) == {"n", "s"} and isinstance(doc["n"], int) and len(doc["s"]) <= 4
    import re
    assert re.fullmatch(r"[a-c]{2,5}x", outs[1].text)
    assert outs[2].text in ("alpha", "beta")
    if outs[3].finish_reason == "stop": assert isinstance(json.loads(outs[3].text), dict)
    else: assert outs[3].text.startswith("{")


def test_constrained_steps_pipeline_as_sync_does(engines):
    """Async scheduling queues the step after a constrained one behind its sampler (the masks filled on a thread):
    constrained rows beside plain ones, with penalties and logprobs, more requests than rows (admissions mid-run),
    give sync's tokens, and nothing stays queued after."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 6}}, "required": ["a"]}
    prompts = [random_prompt(4 + i, 3072, seed=20 + i) for i in range(12)]
    params = [SamplingParams(max_tokens=5 + i % 7, temperature=0.9, seed=i, frequency_penalty=0.5 * (i % 3 == 0),
                             logprobs=2 if i % 4 == 1 else None,
                             structured_outputs=StructuredOutputs(json=schema) if i % 2 else None) for i in range(12)]
    outs = both(engines, prompts, params)
    assert all(json.loads(o.text)["a"] is not None for o in outs[1::2] if o.finish_reason == "stop")
    e = engines["async"]
    assert e._launched is None and e._inflight is None and not e.has_unfinished_requests()


def streamed(e, prompts, params) -> dict:
    "Every report `step()` hands out, per request (in order) and choice: (token ids, new text, text, finished, reason)."
    order = {e.add_request(p, sp): k for k, (p, sp) in enumerate(zip(prompts, params))}
    got = {}
    while e.has_unfinished_requests():
        for o in e.step():
            got.setdefault((order[o.request_id], o.index), []).append((o.token_ids, o.new_text, o.text, o.finished, o.finish_reason))
    assert_all_free(e)
    return got


def test_constrained_streams_report_as_sync_does(engines):
    """A constrained step's reports come after the next step is queued (read before it advances): streamed reports,
    stop strings (an abort two steps ahead of the reports), best_of and n under a grammar give sync's reports."""
    prompts = [random_prompt(5 + i, 3072, seed=40 + i) for i in range(10)]
    regex = StructuredOutputs(regex="[a-e ]{4,40}")
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=1.0, seed=i, structured_outputs=regex,
                             stop=["a", "b c"] if i % 3 == 0 else None, n=2 if i == 4 else 1,
                             best_of=3 if i == 7 else None, logprobs=1 if i % 2 else None,
                             presence_penalty=0.4 * (i % 4 == 1)) for i in range(10)]
    got = {m: streamed(e, prompts, params) for m, e in engines.items()}
    assert got["sync"] == got["async"]
    reasons = [r[-1][4] for r in got["sync"].values()]
    assert "stop" in reasons and sum(len(r) for r in got["sync"].values()) > 3 * len(reasons)   # streamed, some stopped
    for reports in got["sync"].values():
        assert all(ids == [t for t in ids if t >= 0] for ids, *_ in reports)     # never a placeholder
        assert [r[3] for r in reports].count(True) == 1 and reports[-1][3]


def test_bad_grammar_is_a_value_error(engines):
    e = engines["sync"]
    with pytest.raises(ValueError, match="regex|invalid"):
        e.generate([[1, 2]], SamplingParams(structured_outputs=StructuredOutputs(regex="(unclosed")))
    assert_all_free(e)


def test_forks_and_logprobs_survive_preemption(ckpt):
    "A cache too small for everyone: forks, prompt scoring and grammars are preempted and recomputed, all finish."
    folder, _ = ckpt
    for mode in (False, True):
        small = LLM(folder, dtype="float32", device="cpu", num_kv_blocks=12, max_num_seqs=6,
                    max_num_batched_tokens=64, async_scheduling=mode)
        ids = random_prompt(40, 3072, seed=12)
        outs = small.generate([ids, random_prompt(30, 3072, seed=13)],
                              [SamplingParams(n=3, max_tokens=30, seed=2, prompt_logprobs=1, ignore_eos=True),
                               SamplingParams(max_tokens=30, temperature=0, logprobs=1, ignore_eos=True,
                                              frequency_penalty=0.3)])
        assert [len(o.token_ids) for o in outs] == [30] * 4
        assert sum(o.num_preemptions for o in outs) > 0
        assert len(outs[0].prompt_logprobs) == 40 and len(outs[3].logprobs) == 30
        assert_all_free(small)


def test_abort_a_forked_request(engines):
    e = engines["sync"]
    rid = e.add_request(random_prompt(30, 3072, seed=14), SamplingParams(n=4, max_tokens=20))
    e.step(); e.step()
    assert e.abort_request(rid) and not e.abort_request(rid)
    assert_all_free(e)


def test_grammar_holds_when_the_vocab_outgrows_the_tokenizer(tmp_path):
    """The model's vocabulary (151,936, Qwen2.5's) far past the tokenizer's 3,072: every sampled token stays inside
    the grammar. (The sampler's noise once reached u = 1.0 in fp32: infinite Gumbel noise against a -inf logit is a
    NaN, which the arg-max picked, about once per hundred rows at this vocabulary.)"""
    src = build_tokenizer_source(tmp_path / "tokenizer")
    make_checkpoint(tmp_path / "m", seed=1, tokenizer_from=src, vocab_size=151936)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "tags"]}
    spec = StructuredOutputs(json=schema)
    llm = LLM(tmp_path / "m", dtype="float32", device="cpu", max_num_seqs=16, max_num_batched_tokens=128)
    outs = llm.generate([random_prompt(12, 3072, seed=i) for i in range(16)],
                        SamplingParams(max_tokens=30, temperature=1.0, seed=4, structured_outputs=spec))
    grammar = llm.grammar_compiler.compile(spec)
    for o in outs:
        m = grammar.matcher()
        assert all(m.accept(t) for t in o.token_ids if t not in llm.eos_token_ids), o.text
