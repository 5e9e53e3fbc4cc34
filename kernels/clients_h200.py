"""Issue 26's targets (what real clients send) on the H200, the 0.5B shape with random weights.

Run on the device machine from the repo root:
    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/clients_h200.py --out $OUT [--parts check,penalties,...]
Writes clients_h200.json (raw numbers, git sha, GPU, versions, date, the command) to --out after every part.

Parts, each checked before it is timed, A and B interleaved (each round alternates which goes first):
0. check: one fp32 batch that asks for every client feature (penalties with logprobs, seeded top-p with min-p,
   n = 4, logit bias with min_tokens, a JSON schema, prompt logprobs with the top 20, repetition, top-k with a
   frequency penalty) through an eager synchronous engine, a graphed asynchronous one, and the same with the
   sampler run eagerly: the same tokens and logprobs (within 1e-3) from all three.
1. penalties: ms per `LLM.step()` in steady decode with presence 0.5 + frequency 0.5 + repetition 1.1 penalties
   and logprobs=5 on every row, against the same requests without them (temperature 1, EOS ignored), at batch 64
   and batch 1; the ratio against the targets (at most 1.10 at batch 64, 1.15 at batch 1), with the sampler of
   replayed steps as a CUDA graph (the default) and run eagerly (`sampler_graphs=False`, the control): four cells
   interleaved. The check: every row's new token came back with its logprob and a top 5.
2. structured: JSON-schema constrained decoding at batch 64 against unconstrained on the same 64 seeded prompts,
   each unconstrained request asked for exactly as many tokens as its constrained run produced (EOS ignored), so
   both sides generate the same tokens in the same batch shapes: output tokens/s end to end (the target: at most
   15% fewer), and over the decode steps that ran the full batch; the time in the matchers' token advance.
   grammar: llguidance's mask fill and token advance for 64 rows alone, on the machine's CPU, by thread-pool size.
   profile: cProfile of steady decode at batch 64, plain, penalised with logprobs, and under a JSON schema.
   Time to first token of one request on an idle engine with no schema, with a schema compiled before (cached)
   and with a new typical schema each time (distinct property names): targets, cached adds nothing measurable, new
   adds at most 20 ms. The check: every constrained token is one the grammar accepts, and every output that closed
   parses as JSON with the schema's required keys.
3. fork: n = 8 on a 1,000-token prompt: the prompt tokens computed (RequestOutput.num_prefill_tokens, summed over
   the 8 choices, and the step ledger's count) against 8,000 (each choice computing it) and 1,000 (once); the
   forks share the prompt's full KV blocks, so each of the 7 children may compute the last partial block again
   (1000 % 16 = 8 tokens each: 1,056 in all), which the JSON says apart from "computed_exactly_once".
4. server: the benchmark chapter's offline lognormal workload (128 requests) through `python -m nanoserve.server`
   over HTTP (nanoserve.endpoint, the server warmed first) against the engine alone in a fresh process
   (nanoserve.bench), same engine settings, interleaved, twice each, offline (every request at once: the server
   saturated) and with Poisson arrivals at 12 requests/s (the server issue's measurement): the throughput ratios
   (target, as in the server issue: within 10% at that rate).

`--smoke`: every part on the built-in tiny model on the CPU under the Triton interpreter (fp32, a few steps, tiny
batches), written only to a temporary folder (tests/test_lab_smoke.py runs it).
"""
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import (LLM, SamplingParams, StepLedger, WorkloadSpec, checkpoint, device_or_skip, drain,  # noqa: E402
                 dtype_of, exit_if_failed, free, is_smoke, median, model_config, parser, run_parts, run_benchmark, saver,
                 sync, warm)

from nanoserve.bench import model_limits                                                   # noqa: E402

import json, os, random, re, subprocess, tempfile, time                                      # noqa: E402

from nanoserve.endpoint import endpoint_runner                                             # noqa: E402
from nanoserve.structured import StructuredOutputs                                         # noqa: E402

PENALIZED = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1, logprobs=5)
POISSON_RATE = 12.0     # requests/s: the server issue's measurement of the server's overhead
THROUGHPUT_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                                      "tags": {"type": "array", "items": {"type": "string"}}},
                     "required": ["name", "city", "tags"]}


def typical_schema(i) -> dict:
    "A typical client's schema (a record of six mixed fields, one nested), its property names made distinct by `i`."
    return {"type": "object", "additionalProperties": False, "required": [f"id_{i}", f"name_{i}", f"address_{i}"],
            "properties": {f"id_{i}": {"type": "integer"}, f"name_{i}": {"type": "string"},
                           f"active_{i}": {"type": "boolean"},
                           f"tags_{i}": {"type": "array", "items": {"type": "string"}},
                           f"kind_{i}": {"enum": ["person", "company", "other"]},
                           f"address_{i}": {"type": "object", "required": ["city"],
                                            "properties": {"city": {"type": "string"},
                                                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}


class Settings:
    "The run's sizes: the H200's, or tiny ones under --smoke."
    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.batches = (4, 1) if smoke else (64, 1)
        self.steps, self.rounds = (3, 2) if smoke else (100, 4)
        self.prompt_len, self.max_tokens = (16, 64) if smoke else (128, 1024)
        self.ttft_rounds, self.fork_prompt = (2, 100) if smoke else (10, 1000)
        self.warm_s = 0.0 if smoke else 1.0
        self.engine = dict(max_num_seqs=max(self.batches), max_num_batched_tokens=256 if smoke else 2048,
                           num_kv_blocks=256 if smoke else 8192)
        self.spec = (WorkloadSpec(kind="lognormal", num_requests=6, prompt_median=16, output_median=4, prompt_max=32,
                                  output_max=8) if smoke else
                     WorkloadSpec(kind="lognormal", num_requests=128, prompt_median=256, output_median=128,
                                  prompt_max=1024, output_max=512))
        self.server_engine = (dict(max_num_seqs=4, max_num_batched_tokens=256, num_kv_blocks=256) if smoke else
                              dict(max_num_seqs=64, max_num_batched_tokens=2048, num_kv_blocks=8192))


def random_prompts(llm, count: int, length: int, seed: int) -> list[list[int]]:
    g = random.Random(seed)
    return [[g.randrange(llm.config.vocab_size) for _ in range(length)] for _ in range(count)]


def steady(llm, prompts, params) -> None:
    "Abort everything, add `prompts` with `params`, run their prefill: steady decode from here."
    drain(llm)
    for p in prompts: llm.add_request(p, params)
    while any(r.seq.num_computed_tokens < r.seq.num_prompt_tokens for r in llm._requests.values()): llm.step()


def timed_steps(llm, steps: int) -> tuple[float, list]:
    "ms per `LLM.step()` over `steps` back-to-back steps (one sync at each end), and the last step's outputs."
    sync(llm.device); t0 = time.perf_counter()
    for _ in range(steps): outs = llm.step()
    sync(llm.device)
    return (time.perf_counter() - t0) / steps * 1e3, outs


# ---- 0. correctness on the GPU ------------------------------------------------------------------------------------
def check_requests(llm, s: Settings) -> tuple[list, list]:
    "One batch that asks for every client feature: (prompts, params)."
    prompts = random_prompts(llm, 8, s.prompt_len // 4, seed=3)
    n = 8 if s.smoke else 24
    spec = StructuredOutputs(json=json.dumps(THROUGHPUT_SCHEMA))
    params = [SamplingParams(max_tokens=n, temperature=0.8, seed=1, ignore_eos=True, **PENALIZED),
              SamplingParams(max_tokens=n, temperature=1.0, top_p=0.9, min_p=0.05, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=n, temperature=1.0, n=4, seed=3, ignore_eos=True, logprobs=0),
              SamplingParams(max_tokens=n, temperature=0.0, logit_bias={7: 5.0, 9: -100.0}, min_tokens=n // 2),
              SamplingParams(max_tokens=n, temperature=1.0, seed=4, structured_outputs=spec),
              SamplingParams(max_tokens=n, temperature=0.0, prompt_logprobs=2, logprobs=20),
              SamplingParams(max_tokens=n, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(max_tokens=n, temperature=0.7, top_k=20, frequency_penalty=1.0, seed=5, ignore_eos=True)]
    return prompts, params


def check(model_dir, s: Settings, res: dict, dtype: str) -> None:
    "Every client feature in one batch, fp32: eager and synchronous, graphed and asynchronous (the sampler graphed or not)."
    engines = {"eager_sync": dict(enforce_eager=True, async_scheduling=False), "graphs_async": {},
               "graphs_async_eager_sampler": dict(sampler_graphs=False)}
    outs = {}
    for name, kw in engines.items():
        llm = LLM(model_dir, dtype="float32", **s.engine, **kw)
        prompts, params = check_requests(llm, s)
        outs[name] = [(o.token_ids, [(lp.token_id, lp.logprob) for lp in o.logprobs or []],
                       [lp.logprob for lp in (o.prompt_logprobs or [])[1:]]) for o in llm.generate(prompts, params)]
        replays = llm.runner.sampler_graphs.graphs if llm.runner.sampler_graphs else {}
        res.setdefault("check", {})[name + "_sampler_graphs_captured"] = len(replays)
        drain(llm); del llm; free()
    ref = outs["eager_sync"]
    rows = {}
    for name in ("graphs_async", "graphs_async_eager_sampler"):
        same_tokens = sum(a[0] == b[0] for a, b in zip(outs[name], ref))
        lp_err = max([abs(x[1] - y[1]) for a, b in zip(outs[name], ref) for x, y in zip(a[1], b[1])] +
                     [abs(x - y) for a, b in zip(outs[name], ref) for x, y in zip(a[2], b[2])] + [0.0])
        rows[name] = {"outputs": len(ref), "same_tokens": same_tokens, "max_logprob_abs_err": lp_err}
        assert same_tokens == len(ref) and lp_err < 1e-3, (name, rows[name])
    res["check"].update(rows=rows, dtype="float32")
    print("check", rows, flush=True)


# ---- 1. penalties and logprobs -----------------------------------------------------------------------------------
def penalties(model_dir, s: Settings, res: dict, dtype: str) -> None:
    """Plain against penalised steps, with the sampler replayed as a graph (the default) and run eagerly (a control),
    and text made through the window detokenizer instead of byte-level BPE's table (another)."""
    engines = {"sampler_graphs": LLM(model_dir, dtype=dtype, **s.engine),
               "eager_sampler": LLM(model_dir, dtype=dtype, sampler_graphs=False, **s.engine),
               "window_detok": LLM(model_dir, dtype=dtype, **s.engine)}
    engines["window_detok"]._byte_table = None     # the lab's variant: text through the window, not the byte table
    plain = SamplingParams(max_tokens=s.max_tokens, temperature=1.0, ignore_eos=True)
    configs = {"plain": plain, "penalties_logprobs5": replace(plain, **PENALIZED)}
    cells = [(e, c) for e in engines for c in configs]
    rows = []
    for b in s.batches:
        prompts = random_prompts(engines["sampler_graphs"], b, s.prompt_len, seed=b)
        for llm in engines.values():
            steady(llm, prompts, configs["penalties_logprobs5"])            # check: logprobs and a top 5 on every row
            _, outs = timed_steps(llm, 2)
            assert len(outs) == b and all(o.logprobs and len(o.logprobs[-1].top) == 5 for o in outs), outs[:1]
        times = {f"{e}/{c}": [] for e, c in cells}
        for r in range(s.rounds):
            for e, c in (cells if r % 2 == 0 else cells[::-1]):
                llm = engines[e]
                steady(llm, prompts, configs[c]); warm(llm.device, s.warm_s)
                timed_steps(llm, s.steps)                                   # the pipeline full, then timed
                times[f"{e}/{c}"].append(timed_steps(llm, s.steps)[0])
            for llm in engines.values(): drain(llm)
        ledgers = {}
        for e, c in cells:                  # where a step's time goes: the ledger's phases, in steps not timed above
            llm = engines[e]
            steady(llm, prompts, configs[c]); timed_steps(llm, s.steps)
            llm.ledger = StepLedger(); timed_steps(llm, s.steps); ledgers[f"{e}/{c}"] = llm.ledger.summary(decode_only=True)
            llm.ledger = None; drain(llm)
        med = {k: median(v) for k, v in times.items()}
        ratio = med["sampler_graphs/penalties_logprobs5"] / med["sampler_graphs/plain"]
        target = 1.10 if b >= 64 else 1.15
        rows.append({"batch": b, "ms_per_step": times, "median_ms": med, "ratio": ratio, "ledger": ledgers,
                     "ratio_eager_sampler": med["eager_sampler/penalties_logprobs5"] / med["eager_sampler/plain"],
                     "plain_graphs_over_eager": med["sampler_graphs/plain"] / med["eager_sampler/plain"],
                     "penalised_graphs_over_eager": med["sampler_graphs/penalties_logprobs5"]
                     / med["eager_sampler/penalties_logprobs5"],
                     "table_over_window_detok": {c: med[f"sampler_graphs/{c}"] / med[f"window_detok/{c}"] for c in configs},
                     "target_ratio": target, "meets_target": ratio <= target})
        print("penalties", {k: v for k, v in rows[-1].items() if k not in ("ms_per_step", "ledger")}, flush=True)
        print("ledger ms", {k: {p: round(v * 1e3, 3) for p, v in L.items() if p not in ("steps", "tokens_per_step")}
                            for k, L in ledgers.items()}, flush=True)
    res["penalties"] = {"params": PENALIZED, "temperature": 1.0, "prompt_len": s.prompt_len, "steps": s.steps,
                        "rounds": s.rounds, "rows": rows}
    for llm in engines.values(): drain(llm)
    del engines, llm; free()


def host_profile(model_dir, s: Settings, res: dict, dtype: str) -> None:
    """Where the host's time goes in steady decode at batch 64, plain against penalised with logprobs (the sampler
    graphed) and a JSON schema: cProfile's top functions by own time, per step, nanoserve's and the builtins they
    call. A lead for the next change, not a figure: the profiler slows Python down."""
    import cProfile, pstats
    llm = LLM(model_dir, dtype=dtype, **s.engine)
    b = s.batches[0]
    prompts = random_prompts(llm, b, s.prompt_len, seed=21)
    plain = SamplingParams(max_tokens=s.max_tokens, temperature=1.0, ignore_eos=True)
    spec = StructuredOutputs(json=json.dumps(THROUGHPUT_SCHEMA))
    configs = {"plain": plain, "penalties_logprobs5": replace(plain, **PENALIZED),
               "json_schema": SamplingParams(max_tokens=s.max_tokens, temperature=1.0, structured_outputs=spec)}
    out = {}
    for name, params in configs.items():
        steady(llm, prompts, params); timed_steps(llm, s.steps)
        prof = cProfile.Profile(); prof.enable()
        ms, _ = timed_steps(llm, s.steps)
        prof.disable()
        stats = pstats.Stats(prof).stats                      # (file, line, name) -> (calls, ncalls, tottime, cumtime, _)
        top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:30]
        out[name] = {"ms_per_step_profiled": ms, "top": [{"fn": f"{Path(k[0]).name}:{k[1]}({k[2]})", "calls_per_step": v[1] / s.steps,
                                                         "own_us_per_step": v[2] / s.steps * 1e6,
                                                         "cum_us_per_step": v[3] / s.steps * 1e6} for k, v in top]}
        print("profile", name, f"{ms:.2f} ms a step;", ", ".join(f"{t['fn']} {t['own_us_per_step']:.0f}us" for t in out[name]["top"][:12]), flush=True)
        drain(llm)
    res["host_profile"] = {"batch": b, "steps": s.steps, "configs": out}
    del llm; free()


# ---- 2. structured output ----------------------------------------------------------------------------------------
def full_batch_rate(llm, b: int) -> dict:
    "Output tokens/s over the ledger's decode-only steps that ran all `b` rows, and how many there were."
    rows = [r for r in llm.ledger.rows if r["decode_only"] and r["num_tokens"] == b]
    secs = sum(r["total"] for r in rows)
    return {"steps": len(rows), "tokens_per_s": b * len(rows) / secs if secs > 0 else None}


def constrained_run(llm, prompts, params) -> tuple[dict, list]:
    "One batch to the end, the ledger fresh: (full-batch decode rate and end-to-end rate, outputs)."
    drain(llm); llm.reset_prefix_cache(); llm.ledger = StepLedger()
    sync(llm.device); t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync(llm.device); dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    return full_batch_rate(llm, len(prompts)) | {"output_tokens": n, "seconds": dt, "end_to_end_tokens_per_s": n / dt}, outs


def first_token_s(llm, prompt, params) -> float:
    "Seconds from `add_request` (a schema compiles there) to the request's first token, on an idle engine."
    drain(llm)
    t0 = time.perf_counter()
    rid = llm.add_request(prompt, params, stream=False)
    while not any(o.request_id == rid and o.token_ids for o in llm.step()): pass
    t = time.perf_counter() - t0
    drain(llm)
    return t


def timed_grammar(llm) -> dict:
    """Seconds in the grammar compiler's token advance (on the engine's thread), counted on this engine's compiler.
    The mask fill runs on a thread of its own under async scheduling, beside other host work: the grammar part
    times it alone."""
    spent, g = {"accept_tokens": 0.0, "calls": 0}, llm.grammar_compiler
    fn = g.accept_tokens
    def timed(*a):
        t0 = time.perf_counter(); out = fn(*a); spent["accept_tokens"] += time.perf_counter() - t0; spent["calls"] += 1
        return out
    g.accept_tokens = timed                  # on this instance only: the lab's stopwatch, not a switch
    return spent


def structured(model_dir, s: Settings, res: dict, dtype: str) -> None:
    """64 seeded requests under a JSON schema, then the same 64 unconstrained with each request's max_tokens set to
    the length its constrained run produced (EOS ignored): the same requests, the same tokens generated."""
    llm = LLM(model_dir, dtype=dtype, **s.engine)
    b = s.batches[0]
    prompts = random_prompts(llm, b, s.prompt_len, seed=7)
    spec = StructuredOutputs(json=json.dumps(THROUGHPUT_SCHEMA))
    constrained = [SamplingParams(max_tokens=s.max_tokens, temperature=1.0, seed=i, structured_outputs=spec)
                   for i in range(b)]
    llm.generate(prompts[:2], constrained[:2])                           # the schema compiled before the clock
    _, outs = constrained_run(llm, prompts, constrained)                 # the lengths (seeded: the same every run)
    lengths = [len(o.token_ids) for o in outs]
    configs = {"json_schema": constrained,
               "unconstrained": [SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True)
                                 for i, n in enumerate(lengths)]}
    spent = timed_grammar(llm)
    runs = {k: [] for k in configs}
    for r in range(s.rounds):
        for name in (list(configs) if r % 2 == 0 else list(configs)[::-1]):
            warm(llm.device, s.warm_s)
            before = dict(spent)
            run, outs = constrained_run(llm, prompts, configs[name])
            run["ledger"] = llm.ledger.summary(decode_only=True)
            if name == "json_schema":       # check: every token the grammar's, a closed output JSON of the schema
                grammar = llm.grammar_compiler.compile(spec)
                for o in outs:
                    m = grammar.matcher()
                    assert all(m.accept(t) for t in o.token_ids if t not in llm.eos_token_ids), o.text[:200]
                closed = [json.loads(o.text) for o in outs if o.finish_reason == "stop"]
                assert all(set(THROUGHPUT_SCHEMA["required"]) <= set(d) for d in closed), closed[:2]
                run["same_lengths"] = [len(o.token_ids) for o in outs] == lengths     # seeded, prefix cache emptied
                run["closed_json"] = len(closed)
                run["grammar_s"] = {k: spent[k] - before[k] for k in spent}
            else: assert [len(o.token_ids) for o in outs] == lengths
            runs[name].append(run)
            print("structured", name, {k: v for k, v in run.items() if k != "ledger"}, flush=True)
    rate = lambda name, key: median([x[key] for x in runs[name] if x[key] is not None] or [float("nan")])
    ratio = rate("json_schema", "end_to_end_tokens_per_s") / rate("unconstrained", "end_to_end_tokens_per_s")
    res["structured_throughput"] = {"batch": b, "schema": THROUGHPUT_SCHEMA, "lengths": lengths, "runs": runs,
                                    "ratio_end_to_end": ratio,
                                    "ratio_full_batch": rate("json_schema", "tokens_per_s") / rate("unconstrained", "tokens_per_s"),
                                    "target_ratio": 0.85, "meets_target": ratio >= 0.85}
    print("structured ratio", ratio, "full batch", res["structured_throughput"]["ratio_full_batch"], flush=True)
    ttft(llm, s, res)
    drain(llm); del llm; free()


def grammar_threads(model_dir, s: Settings, res: dict) -> None:
    """llguidance's batch calls at batch 64 on this machine's CPU, by the size of its thread pool: ms per step of the
    mask fill and of the token advance over a random walk through the schema (each row a random allowed token),
    the first 30 steps (lexer states still built) apart from the rest. No GPU work."""
    import torch
    import numpy as np
    from nanoserve.structured import GrammarCompiler
    from nanoserve.tokenizer import load_tokenizer
    tok = load_tokenizer(model_dir)
    b, steps = s.batches[0], (40 if s.smoke else 230)
    rows = {}
    for threads in (1, 2, 4, 8, None):
        g = GrammarCompiler(tok, model_config(model_dir)["vocab_size"], eos_token_ids=[tok.eos_token_id],
                            num_threads=threads)             # None: llguidance's default, a thread per core
        grammar = g.compile(StructuredOutputs(json=json.dumps(THROUGHPUT_SCHEMA)))
        matchers, mask, rng = [grammar.matcher() for _ in range(b)], torch.empty(b, g.bitmask_width, dtype=torch.int32), np.random.default_rng(0)
        fill, accept = [], []
        for _ in range(steps):
            t0 = time.perf_counter(); g.fill_bitmasks(list(enumerate(matchers)), mask); t1 = time.perf_counter()
            bits = np.unpackbits(mask[:, :(len(tok) + 31) // 32].numpy().view(np.uint8), bitorder="little", axis=1)
            tokens = [int(rng.choice(np.flatnonzero(r[:len(tok)]))) for r in bits]
            t2 = time.perf_counter(); g.accept_tokens(list(zip(matchers, tokens))); t3 = time.perf_counter()
            fill.append(t1 - t0); accept.append(t3 - t2)
            matchers = [grammar.matcher() if m.is_terminated() or m.is_error() else m for m in matchers]
        ms = lambda xs: sum(xs) / len(xs) * 1e3
        rows[str(threads or "default")] = {"fill_ms_first30": ms(fill[:30]), "fill_ms": ms(fill[30:]),
                                           "accept_ms_first30": ms(accept[:30]), "accept_ms": ms(accept[30:])}
        print("grammar threads", threads or "default", rows[str(threads or "default")], flush=True)
    res["grammar_threads"] = {"batch": b, "steps": steps, "cpus": os.cpu_count(), "rows": rows}


def ttft(llm, s: Settings, res: dict) -> None:
    "Time to first token: no schema, a cached schema, a new typical schema each time; interleaved, rotated."
    prompt = random_prompts(llm, 1, s.prompt_len, seed=11)[0]
    base = SamplingParams(max_tokens=1, temperature=1.0)
    cached = replace(base, structured_outputs=StructuredOutputs(json=json.dumps(typical_schema("cached"))))
    first_token_s(llm, prompt, cached); first_token_s(llm, prompt, base)   # compiled, and the shapes warm
    fresh = iter(range(10 ** 6))
    make = {"none": lambda: base, "cached": lambda: cached,
            "new": lambda: replace(base, structured_outputs=StructuredOutputs(json=json.dumps(typical_schema(next(fresh)))))}
    times = {k: [] for k in make}
    for r in range(s.ttft_rounds):
        names = list(make)[r % 3:] + list(make)[:r % 3]
        for name in names: times[name].append(first_token_s(llm, prompt, make[name]()) * 1e3)
    t0 = time.perf_counter()
    llm.grammar_compiler.compile(StructuredOutputs(json=json.dumps(typical_schema("compile-only"))))
    compile_ms = (time.perf_counter() - t0) * 1e3
    med = {k: median(v) for k, v in times.items()}
    res["structured_ttft"] = {"ms": times, "median_ms": med, "cached_minus_none_ms": med["cached"] - med["none"],
                              "new_minus_none_ms": med["new"] - med["none"], "compile_only_ms": compile_ms,
                              "target_new_ms": 20.0, "meets_target": med["new"] - med["none"] <= 20.0,
                              "prompt_len": s.prompt_len, "example_schema": typical_schema(0)}
    print("ttft", res["structured_ttft"]["median_ms"], f"compile {compile_ms:.1f} ms", flush=True)


# ---- 3. n = 8 forks ----------------------------------------------------------------------------------------------
def fork(model_dir, s: Settings, res: dict, dtype: str) -> None:
    llm = LLM(model_dir, dtype=dtype, **s.engine)
    prompt = random_prompts(llm, 1, s.fork_prompt, seed=5)[0]
    llm.generate(random_prompts(llm, 1, 32, seed=6), SamplingParams(max_tokens=2, n=2))   # warm, another prompt
    llm.ledger = StepLedger()
    t0 = time.perf_counter()
    outs = llm.generate([prompt], SamplingParams(n=8, max_tokens=16, temperature=1.0, ignore_eos=True))
    sync(llm.device); dt = time.perf_counter() - t0
    assert len(outs) == 8 and sorted(o.index for o in outs) == list(range(8)), [o.index for o in outs]
    assert all(len(o.token_ids) == 16 for o in outs)
    computed = sum(o.num_prefill_tokens for o in outs)
    ledger_tokens = sum(r["num_tokens"] for r in llm.ledger.rows)     # every token the steps computed
    L, decode_tokens = len(prompt), 8 * (16 - 1)                      # each choice's first token from the prefill
    res["fork"] = {"prompt_tokens": L, "n": 8, "max_tokens": 16, "prefill_tokens_computed": computed,
                   "per_choice": [o.num_prefill_tokens for o in outs], "if_each_choice_computed_it": 8 * L,
                   "computed_once": L, "ledger_tokens_computed": ledger_tokens,
                   "ledger_tokens_less_decode": ledger_tokens - decode_tokens, "seconds": dt,
                   "block_size": llm.block_size, "computed_exactly_once": computed == L,
                   # the forks share the prompt's full blocks; each computes its own copy of the last partial block
                   "meets_target": computed <= L + 7 * (llm.block_size - 1)}
    print("fork", res["fork"], flush=True)
    drain(llm); del llm; free()


# ---- 4. the server against the engine alone ----------------------------------------------------------------------
def start_server(model_dir, kw: dict, dtype: str, device: str, log: Path, extra: tuple = (),
                 python_args: tuple = ("-m", "nanoserve.server")):
    """`python -m nanoserve.server` (with `extra` options; `python_args` another way to run it, such as `-c` code
    calling `nanoserve.server.main` under a profiler) on a free loopback port: (process, URL)."""
    args = [sys.executable, *python_args, "--model", str(model_dir), "--port", "0", "--no-access-log",
            "--log-level", "warning", "--served-model-name", "clients", "--dtype", dtype, "--device", device,
            "--max-num-seqs", str(kw["max_num_seqs"]), "--max-num-batched-tokens", str(kw["max_num_batched_tokens"]),
            "--num-kv-blocks", str(kw["num_kv_blocks"]), *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("NANOSERVE_API_KEY", None)
    proc = subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while not (m := re.search(r"serving \S+ at (http://127\.0\.0\.1:\d+)", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill(); proc.wait(); raise RuntimeError(f"the server did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return proc, m.group(1)


def one_run(model_dir, s: Settings, engine_kw: dict, run_one=None, rate: float | None = None) -> dict:
    "One run of the workload (a fresh engine process, or over HTTP with `run_one`), offline or at `rate`: its summary."
    out = run_benchmark(model_dir, s.spec, ["endpoint" if run_one else "continuous"], engine_kwargs=engine_kw,
                        rates=None if rate is None else [rate],
                        repeats=1, warmup_s=3.0 if s.warm_s else 0.0, progress=False, profile_steps=0,
                        run_one=run_one, limits=model_limits(model_dir, engine_kw))   # the same requests both ways
    run = out["runs"][0]
    if "error" in run: raise RuntimeError(run["error"])
    return run["reps"][0]["summary"]


def server(model_dir, s: Settings, res: dict, dtype: str, device: str) -> None:
    engine_kw = dict(s.server_engine, dtype=dtype, device=device)
    log = Path(tempfile.mkdtemp(prefix="clients-server-")) / "server.log"
    proc, url = start_server(model_dir, s.server_engine, dtype, device, log)
    try:
        http = endpoint_runner({"url": url, "model": "clients"})
        one_run(model_dir, s, engine_kw, http)                               # warm the server, unmeasured
        runs = {"engine": [], "server": [], "engine_poisson": [], "server_poisson": []}
        for r in range(2):      # offline (saturated), and Poisson arrivals at the server issue's rate (12 req/s)
            for name in (["engine", "server"] if r == 0 else ["server", "engine"]):
                for rate, key in ((None, name), (POISSON_RATE, name + "_poisson")):
                    summary = one_run(model_dir, s, engine_kw, http if name == "server" else None, rate)
                    runs[key].append(summary)
                    print("server", key, {k: summary[k] for k in ("output_tokens", "output_tokens_per_s", "ttft_p50_s")},
                          flush=True)
    finally:
        proc.send_signal(2)
        try: proc.wait(60)
        except subprocess.TimeoutExpired: proc.kill(); proc.wait()
    tps = {k: median([x["output_tokens_per_s"] for x in v]) for k, v in runs.items()}
    ratio = tps["server"] / tps["engine"]
    poisson = tps["server_poisson"] / tps["engine_poisson"]
    res["server_overhead"] = {"workload": s.spec.__dict__, "engine_kwargs": engine_kw, "runs": runs,
                              "median_output_tokens_per_s": tps, "ratio_offline": ratio, "poisson_rate": POISSON_RATE,
                              "ratio_poisson": poisson, "target_ratio": 0.90, "meets_target": poisson >= 0.90,
                              "server_log_tail": log.read_text()[-2000:]}
    print("server ratio offline", ratio, "poisson", poisson, flush=True)


def main():
    args = parser(__doc__, parts="check,penalties,structured,grammar,profile,fork,server").parse_args()
    device = device_or_skip(args)
    smoke, dtype = is_smoke(args), dtype_of(args)
    s = Settings(smoke)
    model_dir, shape = checkpoint("0.5B", args)
    res = {"shape": shape, "dtype": dtype, "device": str(device)}
    parts = {"check": lambda: check(model_dir, s, res, dtype),
             "penalties": lambda: penalties(model_dir, s, res, dtype),
             "structured": lambda: structured(model_dir, s, res, dtype),
             "grammar": lambda: grammar_threads(model_dir, s, res),
             "profile": lambda: host_profile(model_dir, s, res, dtype),
             "fork": lambda: fork(model_dir, s, res, dtype),
             "server": lambda: server(model_dir, s, res, dtype, device.type)}
    run_parts(parts, args.parts, saver("clients_h200.json", res, args), res.setdefault("part_seconds", {}))
    exit_if_failed(res)


if __name__ == "__main__":
    main()
