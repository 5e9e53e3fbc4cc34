"""nanoserve.engine.LLM end to end on the CPU: input validation, streaming, aborts, stop conditions, chat, timings.

Two engines: the built-in tiny model (`LLM()`, built on first use into a per-session NANOSERVE_CACHE, never
~/.cache) and a random transformers checkpoint with the built-in tokenizer, whose greedy text is varied enough to
pick stop strings from.
"""
import dataclasses
import json
import math
import shutil

import pytest
import torch

from helpers import (assert_all_free, build_tokenizer_source, make_checkpoint, quiet_transformers, random_prompt,
                     torch_threads)
from nanoserve.engine import LLM, RequestOutput, SamplingParams
from nanoserve.tokenizer import IM_END, IM_START, TINY_MODEL_NAME, is_model_folder, shipped_model_dir

GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    "NANOSERVE_CACHE for the whole session: the built-in model is built here, not in ~/.cache."
    path = tmp_path_factory.mktemp("nanoserve-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOSERVE_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def builtin(cache_dir):
    quiet_transformers()
    return LLM()


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory, cache_dir):
    src = build_tokenizer_source(tmp_path_factory.mktemp("tokenizer"))
    folder = tmp_path_factory.mktemp("random-qwen2")
    make_checkpoint(folder, seed=3, tokenizer_from=src)
    return folder


@pytest.fixture(scope="module")
def rnd(ckpt_dir):
    "A random checkpoint (vocab 3072, context 256) through the engine, fp32 on the CPU."
    return LLM(ckpt_dir, dtype="float32", device="cpu")


@pytest.fixture
def fresh(ckpt_dir):
    "An engine of its own, for tests that could leave an engine broken (so that they break no other test)."
    return LLM(ckpt_dir, dtype="float32", device="cpu")


@pytest.fixture(params=["builtin", "rnd"])
def llm(request):
    return request.getfixturevalue(request.param)


def _stream(llm, prompts, params):
    """Drive requests through add_request + step(). Returns, per request, its reports as
    (new_token_ids, new_text, text, token_ids) tuples copied when reported, and its final RequestOutput."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    rids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    reports = {r: [] for r in rids}
    finals = {}
    steps = 0
    while llm.has_unfinished_requests():
        for o in llm.step():
            assert isinstance(o, RequestOutput) and o.request_id not in finals
            reports[o.request_id].append((list(o.new_token_ids), o.new_text, o.text, list(o.token_ids)))
            if o.finished: finals[o.request_id] = o
        steps += 1
        assert steps < 10_000
    return [reports[r] for r in rids], [finals[r] for r in rids]


def _token_pieces(llm, prompt, n):
    "Greedy output ids and the text each token adds (from streaming without stop strings)."
    reports, (final,) = _stream(llm, [prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    (reports,) = reports
    assert all(len(r[0]) == 1 for r in reports)
    pieces = [r[1] for r in reports]
    assert "".join(pieces) == final.text
    return final.token_ids, pieces, final.text


# -- the built-in model ------------------------------------------------------------------------------------------

def test_builtin_model_is_the_shipped_trained_one(builtin, cache_dir):
    assert builtin.model_dir == shipped_model_dir() and is_model_folder(builtin.model_dir)
    assert not (cache_dir / TINY_MODEL_NAME).exists()          # the random fallback is not built when not needed
    assert builtin.config.vocab_size == 3072 and builtin.dtype == torch.float32
    assert builtin.eos_token_ids >= {builtin.tokenizer.convert_tokens_to_ids(IM_END)}


def test_greedy_is_deterministic(builtin, rnd, ckpt_dir, cache_dir):
    prompts = ["def fibonacci(n):", "import os\n" * 6, "Hello", "x"]
    for llm in (builtin, rnd):
        first = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert all(len(t) >= 1 for t in first)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == first
        assert [llm.generate(p, GREEDY)[0].token_ids for p in prompts] == first        # alone = in a batch
        assert [o.token_ids for o in llm.generate(prompts[::-1], GREEDY)][::-1] == first
    other = LLM(ckpt_dir, dtype="float32", device="cpu", block_size=8, max_num_batched_tokens=16, max_num_seqs=4)
    assert [o.token_ids for o in other.generate(prompts, GREEDY)] == [o.token_ids for o in rnd.generate(prompts, GREEDY)]


# -- validation: bad input is a ValueError before anything is queued ----------------------------------------------

def _bad_requests(llm):
    "(description, call) pairs that must raise ValueError without queueing anything."
    V, ctx = llm.config.vocab_size, llm.max_model_len
    ok = SamplingParams(max_tokens=4, temperature=0)
    return [
        ("empty string", lambda: llm.generate("", ok)),
        ("empty token list", lambda: llm.generate([[]], ok)),
        ("empty prompt in a batch", lambda: llm.generate(["fine", ""], ok)),
        ("token id == vocab size", lambda: llm.generate([[1, V]], ok)),
        ("token id huge", lambda: llm.generate([10**9], ok)),
        ("negative token id", lambda: llm.generate([[1, -2]], ok)),
        ("float token ids", lambda: llm.generate([[1.0, 2.0]], ok)),
        ("bool token ids", lambda: llm.generate([[True, 2]], ok)),
        ("str token ids", lambda: llm.generate([["a", "b"]], ok)),
        ("prompt is a float", lambda: llm.generate(3.5, ok)),
        ("prompt is None", lambda: llm.generate(None, ok)),
        ("prompt is a dict", lambda: llm.generate({"prompt": "hi"}, ok)),
        ("prompts contain a float", lambda: llm.generate(["hi", 2.5], ok)),
        ("prompt as long as the context", lambda: llm.generate([[1] * ctx], ok)),
        ("prompt longer than the context", lambda: llm.generate([[1] * (ctx + 5)], ok)),
        ("long text prompt", lambda: llm.generate("x " * (4 * ctx), ok)),
        ("prompt + max_tokens over the context",
         lambda: llm.generate([[1] * (ctx - 3)], SamplingParams(max_tokens=4, temperature=0))),
        ("max_tokens over the context", lambda: llm.generate("hi", SamplingParams(max_tokens=10**6))),
        ("fewer params than prompts", lambda: llm.generate(["a", "b", "c"], [ok, ok])),
        ("more params than prompts", lambda: llm.generate(["a", "b"], [ok, ok, ok])),
        ("params for a single prompt", lambda: llm.generate("a", [ok, ok])),
        ("last prompt too long", lambda: llm.generate(["a", "b", [1] * (ctx + 1)], ok)),
        ("add_request empty", lambda: llm.add_request("", ok)),
        ("add_request bad id", lambda: llm.add_request([V + 1], ok)),
        ("add_request over context", lambda: llm.add_request([1] * (ctx - 1), SamplingParams(max_tokens=2))),
        ("add_request wrong type", lambda: llm.add_request(12, ok)),
    ]


BAD_PARAMS = [dict(max_tokens=0), dict(max_tokens=-1), dict(max_tokens=2.5), dict(max_tokens="8"),
              dict(max_tokens=True), dict(max_tokens=None), dict(temperature=-0.5), dict(temperature=math.nan),
              dict(temperature=math.inf), dict(temperature="hot"), dict(top_p=0), dict(top_p=-0.1), dict(top_p=1.01),
              dict(top_p=math.nan), dict(top_p="0.5"), dict(top_k=-1), dict(top_k=2.0), dict(top_k=True),
              dict(seed="x"), dict(seed=1.5), dict(stop=[""]), dict(stop=[3]), dict(stop_token_ids=[-1]),
              dict(stop_token_ids=["a"]), dict(stop_token_ids=[1.0])]


@pytest.mark.parametrize("kw", BAD_PARAMS, ids=lambda kw: "-".join(f"{k}={v!r}" for k, v in kw.items()))
def test_bad_sampling_params(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_bad_input_is_refused_and_the_engine_stays_usable(llm):
    before = [o.token_ids for o in llm.generate(["Hello", "abc"], GREEDY)]
    assert_all_free(llm)
    for what, call in _bad_requests(llm):
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"{what}: no ValueError")
        assert not llm.has_unfinished_requests(), what
        assert_all_free(llm)
    assert [o.token_ids for o in llm.generate(["Hello", "abc"], GREEDY)] == before
    assert llm.generate([], GREEDY) == []
    assert_all_free(llm)


def test_limits_exactly_at_the_context_are_accepted(rnd):
    ctx = rnd.max_model_len
    o = rnd.generate([[5] * (ctx - 2)], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0]
    assert len(o.token_ids) == 2 and o.finish_reason == "length"
    assert_all_free(rnd)


@pytest.mark.parametrize("params", [{"max_tokens": 4}, "greedy", 4, None], ids=["dict", "str", "int", "None-in-list"])
def test_sampling_params_of_the_wrong_type_are_a_value_error(rnd, params):
    "Passing something that is not a SamplingParams must be a ValueError up front, not an AttributeError."
    with pytest.raises(ValueError):
        if params is None: rnd.generate(["a", "b"], [GREEDY, None])
        else: rnd.generate("a", params)
    with pytest.raises(ValueError):
        rnd.add_request("a", params if params is not None else [GREEDY])
    assert_all_free(rnd)


def test_empty_params_list_is_a_length_mismatch(rnd):
    "generate(two prompts, []) must not silently fall back to the default SamplingParams."
    with pytest.raises(ValueError):
        rnd.generate(["a", "b"], [])
    assert_all_free(rnd)


@pytest.mark.parametrize("kw", [dict(seed=2**63), dict(seed=-2**63 - 1), dict(seed=2**64 + 5), dict(top_k=2**63, seed=0)],
                         ids=["seed-2^63", "seed-below-int64", "seed-2^64+5", "top_k-2^63"])
def test_out_of_int64_range_is_refused_and_the_engine_stays_usable(fresh, kw):
    """An integer the int64 device tensors cannot hold: either refused up front with a ValueError, or accepted and
    used (reproducibly); never a failure half-way through a step that leaves the engine unable to schedule."""
    good = fresh.generate("Hello", GREEDY)[0].token_ids
    def run():
        return fresh.generate("Hello", SamplingParams(max_tokens=3, temperature=0.8, **kw))[0].token_ids
    try:
        sp = SamplingParams(max_tokens=3, temperature=0.8, **kw)
    except ValueError:
        sp = None                                          # refused up front: fine
    if sp is not None:
        try:
            first = run()
        except ValueError:
            first = None                                   # refused by generate: fine, if the engine is intact
        assert_all_free(fresh)
        assert fresh.generate("Hello", GREEDY)[0].token_ids == good, "the engine is broken after the bad request"
        if first is not None: assert run() == first
    assert_all_free(fresh)


def test_engine_recovers_from_an_interrupted_generate(fresh, monkeypatch):
    "The notebook: 'if anything interrupts it, its requests are aborted so the engine stays clean'."
    good = [o.token_ids for o in fresh.generate(["Hello", "abc"], GREEDY)]
    real, calls = fresh.runner.launch, []
    def flaky(x, *rest, **kw):
        calls.append(1)
        if len(calls) == 3: raise KeyboardInterrupt
        return real(x, *rest, **kw)
    monkeypatch.setattr(fresh.runner, "launch", flaky)
    with pytest.raises(KeyboardInterrupt):
        fresh.generate(["Hello", "abc"], GREEDY)
    monkeypatch.setattr(fresh.runner, "launch", real)
    assert_all_free(fresh)
    assert [o.token_ids for o in fresh.generate(["Hello", "abc"], GREEDY)] == good


# -- streaming ---------------------------------------------------------------------------------------------------

def test_streaming_deltas_add_up(llm):
    prompts = ["Hello, world!", "def f(x):\n    return", [5, 6, 7], "x" * 40]
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=["\x00never", "~~~~~~~~"])]
    prompts.append(prompts[0])   # the same greedy request again, with stop strings that never match
    reports, finals = _stream(llm, prompts, params)
    for rep, final, sp in zip(reports, finals, params):
        assert final.finished and final.finish_reason == "length"
        assert [t for r in rep for t in r[0]] == final.token_ids
        assert "".join(r[1] for r in rep) == final.text
        assert len(rep) == sp.max_tokens and all(len(r[0]) == 1 for r in rep)   # one token per report
        sofar = ""
        for i, (_, new_text, text, ids) in enumerate(rep):                     # each report: text so far
            sofar += new_text
            assert len(ids) == i + 1 and text == sofar and final.text.startswith(text)
    # stop strings that never match hold text back while streaming, but the final text is complete
    assert finals[4].token_ids == finals[0].token_ids and finals[4].text == finals[0].text
    # the same tokens and text as generate()
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [f.token_ids for f in finals]
    assert [o.text for o in outs] == [f.text for f in finals]
    assert [o.text for o in outs] == [llm.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outs]
    assert_all_free(llm)


def test_generate_beside_requests_already_running(fresh):
    "`generate` returns its own outputs when a request added before it finishes first; that one's stays in step()."
    short = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    early = fresh.add_request(random_prompt(6, 3072, 3), short, stream=False)
    fresh.step()                                            # its prefill: it finishes after the next step
    out = fresh.generate([random_prompt(30, 3072, 4)], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(out) == 1 and out[0].request_id != early and len(out[0].token_ids) == 8
    assert out[0].token_ids == fresh.generate([random_prompt(30, 3072, 4)], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids
    assert not fresh.has_unfinished_requests()


def test_step_with_nothing_to_do(rnd):
    assert rnd.step() == []
    assert not rnd.has_unfinished_requests()


# -- abort -----------------------------------------------------------------------------------------------------------

def test_abort_waiting_and_running(ckpt_dir):
    llm = LLM(ckpt_dir, dtype="float32", device="cpu", max_num_seqs=1, max_num_batched_tokens=16, block_size=4)
    bm = llm.block_manager
    long = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    a = llm.add_request(random_prompt(40, 3072, 1), long)     # 40 tokens: three 16-token prefill chunks
    b = llm.add_request(random_prompt(10, 3072, 2), long)
    reports = llm.step()
    assert reports == []                                     # a is mid-prefill: nothing sampled yet
    assert bm.num_used_blocks == 10 and a in bm and b not in bm
    assert [s.seq_id for s in llm.scheduler.waiting] == [b]
    assert llm.abort_request(b)                              # waiting
    assert not llm.scheduler.waiting and bm.num_used_blocks == 10
    assert llm.abort_request(a)                              # running, in the middle of its prefill
    assert bm.num_used_blocks == 0 and not llm.scheduler.running
    assert_all_free(llm)
    assert not llm.abort_request(a) and not llm.abort_request(12345)
    # running and decoding, with its output object in hand
    c = llm.add_request("Hello", long)
    while True:
        outs = llm.step()
        if outs and len(outs[0].token_ids) >= 3: break
    out = outs[0]
    assert out.request_id == c and not out.finished and bm.num_used_blocks > 0
    assert llm.abort_request(c)
    assert bm.num_used_blocks == 0
    assert c not in llm._requests and not llm.has_unfinished_requests()   # reports are snapshots: gone, not mutated
    assert_all_free(llm)
    assert llm.step() == []
    # the engine carries on
    o = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(o.token_ids) >= 1
    assert_all_free(llm)


# -- stop conditions -----------------------------------------------------------------------------------------------

def _boundary_stop(pieces, text, min_k=2):
    "A 2-character stop string across the boundary of tokens k-1 and k that first occurs there; returns (s, k, cut)."
    cum = [0]
    for p in pieces: cum.append(cum[-1] + len(p))
    for k in range(min_k, len(pieces)):
        a, b = pieces[k - 1], pieces[k]
        if not a or not b or "\ufffd" in a + b: continue
        s = a[-1] + b[0]
        if text.find(s) == cum[k] - 1: return s, k, cum[k] - 1
    raise AssertionError(f"no usable token boundary in {pieces}")


def test_stop_string_inside_one_token(rnd):
    prompt = random_prompt(10, 3072, 1)
    ids, pieces, text = _token_pieces(rnd, prompt, 24)
    k = next(k for k in range(3, len(pieces)) if len(pieces[k]) >= 2 and "\ufffd" not in pieces[k]
             and text.find(pieces[k]) == sum(map(len, pieces[:k])))
    stop = pieces[k]
    o = rnd.generate(prompt, SamplingParams(max_tokens=24, temperature=0, stop=stop, ignore_eos=True))[0]
    assert (o.finish_reason, o.text) == ("stop", text[:text.find(stop)])
    assert o.token_ids == ids[:k + 1]
    assert stop not in o.text
    assert_all_free(rnd)


def test_stop_string_split_across_two_tokens(rnd):
    prompt = random_prompt(10, 3072, 1)
    ids, pieces, text = _token_pieces(rnd, prompt, 24)
    s, k, cut = _boundary_stop(pieces, text)
    sp = SamplingParams(max_tokens=24, temperature=0, stop=["never-there", s], ignore_eos=True)
    o = rnd.generate(prompt, sp)[0]
    assert (o.finish_reason, o.text) == ("stop", text[:cut])
    assert o.token_ids == ids[:k + 1]                     # it stopped at the token that completed the string
    # streamed: the deltas add up to the final text and never show the stop string's first half
    (rep,), (final,) = _stream(rnd, [prompt], sp)
    assert "".join(r[1] for r in rep) == final.text == text[:cut]
    assert all(len(r[2]) <= cut and s not in r[2] for r in rep)
    assert_all_free(rnd)


def test_earliest_of_several_stop_strings_wins(rnd):
    prompt = random_prompt(10, 3072, 1)
    ids, pieces, text = _token_pieces(rnd, prompt, 24)
    late, early = text[-6:-3], text[8:10]
    first = min(i for i in (text.find(late), text.find(early)) if i >= 0)
    o = rnd.generate(prompt, SamplingParams(max_tokens=24, temperature=0, stop=[late, early], ignore_eos=True))[0]
    assert (o.finish_reason, o.text) == ("stop", text[:first])


def test_stop_string_completed_by_the_last_token(rnd):
    """A stop string that the max_tokens-th token completes still stops the text before it, as vLLM does
    (finish_reason 'stop'); the docs: stop strings end the output *before* the stop string."""
    prompt = random_prompt(10, 3072, 1)
    ids, pieces, text = _token_pieces(rnd, prompt, 24)
    s, k, cut = _boundary_stop(pieces, text)
    o = rnd.generate(prompt, SamplingParams(max_tokens=k + 1, temperature=0, stop=s, ignore_eos=True))[0]
    assert o.token_ids == ids[:k + 1]
    assert (o.finish_reason, o.text) == ("stop", text[:cut]), f"stop string {s!r} left in: {o.text[-10:]!r}"


def test_stop_token_ids(rnd):
    prompt = random_prompt(10, 3072, 2)
    ids, pieces, text = _token_pieces(rnd, prompt, 20)
    i = 6
    stop_id = ids[i]
    first = ids.index(stop_id)
    o = rnd.generate(prompt, SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_id]))[0]
    assert (o.finish_reason, o.token_ids) == ("stop", ids[:first + 1])   # the stop token is in token_ids ...
    assert o.text == "".join(pieces[:first])                             # ... but adds no text
    assert_all_free(rnd)


def test_eos_and_ignore_eos(ckpt_dir, tmp_path):
    "The checkpoint's EOS (config.json / generation_config.json) stops a request unless ignore_eos is set."
    probe = LLM(ckpt_dir, dtype="float32", device="cpu")
    prompt = random_prompt(10, 3072, 2)
    ids = probe.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].token_ids
    eos = ids[5]
    first = ids.index(eos)
    for where in ("config.json", "generation_config.json"):
        folder = tmp_path / where
        shutil.copytree(ckpt_dir, folder)
        path = folder / where
        d = json.loads(path.read_text()) if path.is_file() else {}
        d["eos_token_id"] = [eos] if where == "config.json" else [3069, eos]
        path.write_text(json.dumps(d))
        llm = LLM(folder, dtype="float32", device="cpu")
        assert eos in llm.eos_token_ids
        o = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0))[0]
        assert (o.finish_reason, o.token_ids) == ("stop", ids[:first + 1]), where
        o = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
        assert (o.finish_reason, o.token_ids) == ("length", ids), where
        # explicit stop_token_ids still apply with ignore_eos
        o = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                stop_token_ids=[ids[first]]))[0]
        assert o.finish_reason == "stop" and o.token_ids == ids[:first + 1]
        assert_all_free(llm)


# -- chat ------------------------------------------------------------------------------------------------------------

def test_chat_uses_the_chat_template(builtin):
    conv = [{"role": "user", "content": "What is a KV cache?"}]
    (o,) = builtin.chat(conv, SamplingParams(max_tokens=6, temperature=0))
    assert o.prompt.endswith(f"{IM_START}assistant\n")
    assert f"{IM_START}user\nWhat is a KV cache?{IM_END}" in o.prompt
    assert f"{IM_START}system\n" in o.prompt                     # the template's default system message
    im_start = builtin.tokenizer.convert_tokens_to_ids(IM_START)
    assert o.prompt_token_ids.count(im_start) == 3              # special tokens are single ids, not spelled out
    assert 1 <= len(o.token_ids) <= 6
    # several conversations at once, in order, and the same reply as a plain generate of the templated prompt
    convs = [conv, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]]
    outs = builtin.chat(convs, SamplingParams(max_tokens=6, temperature=0))
    assert len(outs) == 2 and outs[0].token_ids == o.token_ids
    assert outs[1].prompt.count(f"{IM_START}system\n") == 1 and "Be brief." in outs[1].prompt
    assert builtin.generate(outs[1].prompt, SamplingParams(max_tokens=6, temperature=0))[0].token_ids == outs[1].token_ids
    assert_all_free(builtin)


# -- timings ---------------------------------------------------------------------------------------------------------

def test_request_timings_are_ordered(llm):
    prompts = ["Hello", "a much longer prompt " * 5, [1, 2, 3]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    for o in outs:
        assert o.finished and o.first_token_time is not None and o.finish_time is not None
        assert o.arrival_time <= o.first_token_time <= o.finish_time
        assert o.ttft > 0 and o.ttft == o.first_token_time - o.arrival_time
    one = llm.generate("Hello", SamplingParams(max_tokens=1, temperature=0))[0]
    assert one.arrival_time <= one.first_token_time <= one.finish_time and one.ttft > 0


def test_pdl_is_off_on_a_cpu_and_refused_when_asked(ckpt_dir):
    "Programmatic dependent launch needs a Hopper GPU: off by default on a CPU, and `pdl=True` is a clear error."
    from nanoserve.runtime import launch_options, pdl_supported
    assert not pdl_supported(torch.device("cpu")) and launch_options(False) == {}
    assert launch_options(True) == {"launch_pdl": True}
    llm = LLM(ckpt_dir, dtype="float32", device="cpu", attention_backend="triton", fused_kernels=True)
    assert llm.pdl is False
    assert not any(getattr(m, "pdl", False) for m in llm.model.modules())
    llm.model.set_kernels(dataclasses.replace(llm.model.kernels, pdl=True))   # one table every layer reads
    assert llm.model.kernels.pdl is True and llm.model.kernels.add_rmsnorm is not None
    with pytest.raises(ValueError, match="compute capability 9.0"):
        LLM(ckpt_dir, dtype="float32", device="cpu", pdl=True)
