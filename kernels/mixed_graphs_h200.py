"""Mixed-step CUDA graphs on the H200 (the CUDA-graphs chapter's `MixedGraphs`; issues 5 and 6).

Run on the device machine from the repo root:
    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/mixed_graphs_h200.py --out $OUT [--parts check,steps,offline,nanovllm]
Writes mixed_graphs_h200.json (raw numbers, git sha, GPU, versions, date) to --out after every part; copy it to
figures/data/.

Random weights of the Qwen2.5-0.5B shape. Side by side in one run, `mixed_step_graphs=False` as the control
(decode graphs on in both):
1. check: the logits of one mixed step (decodes + a fresh prompt + a chunk after a cached prefix) replayed
   against the eager step, fp32 and bf16; greedy tokens with mixed graphs on and off on a run with arrivals
   (fp32 and bf16: identical sequences reported);
2. steps: ms per `LLM.step()` of a step that admits one prompt of P tokens next to b decodes, P in 16..2000,
   b in 1 and 32 (a warm-up before every row, timed twice, >15% disagreement flagged), and device kernels per
   step with the GPU's busy share from one profiled window of the same configuration;
3. offline: the benchmark chapter's lognormal workload (128 requests, the settings of kernels/bench_h200.sh),
   continuous batching with mixed graphs on and off and static batching at 32, each twice, each run in a fresh
   process (numerator: output tokens actually generated);
4. nanovllm: nano-vllm's workload (256 requests, uniform 100..1024 in and out, EOS ignored), twice.
In the tutorials' order: check (asserted: the replayed logits match the eager step's, fp32 greedy tokens are
identical), then time, then write (after every part, through kernels/lab.py). `--smoke`: every part on the built-in
tiny model on the CPU under the Triton interpreter (fp32, short prompts; the check runs the mixed step's static
buffers without capture, the other parts' CPU engines eagerly), written only to a temporary folder.
"""
import random, statistics, sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import (LLM, OFFLINE_COMMON, OFFLINE_SPEC, SMOKE_COMMON, SMOKE_SPEC, SamplingParams, agreeing_prefix,  # noqa: E402
                 checkpoint, device_or_skip, disagree, drain, dtype_of, free, greedy_with_arrivals, is_cuda, is_smoke,
                 nanovllm, offline, parser, rel_err, run_parts, saver, steady_decode, sync, warm)

import torch                                                                               # noqa: E402

from nanoserve.graphs import graph_batch_sizes, graph_token_sizes                          # noqa: E402
from nanoserve.measure import busy_share, count_device_kernels, profile_run                # noqa: E402
from nanoserve.runner import eager_inputs                                                  # noqa: E402

# (decoding prompts, a fresh prompt that fits the step, a prompt the budget cuts, the step's token budget)
MIXED_STEP = ((300, 17, 900, 64, 5), 200, 3000, 2048)
SMOKE_MIXED_STEP = ((30, 17, 90, 6, 5), 20, 300, 64)


def mixed_engine(model_dir, dtype, smoke: bool):
    """The engine of the logits check. On a CPU (--smoke) the Triton backend with the mixed-step graphs' static
    buffers set up without capture (`enable_graphs(capture=False)`): the replay path, run eagerly."""
    budget = (SMOKE_MIXED_STEP if smoke else MIXED_STEP)[3]
    kw = dict(attention_backend="triton", num_kv_blocks=128) if smoke else dict(num_kv_blocks=2048)
    llm = LLM(model_dir, dtype=dtype, max_num_seqs=32, max_num_batched_tokens=budget, **kw)
    if not is_cuda(llm.device):
        llm.runner.enable_graphs(graph_batch_sizes(32), llm.max_model_len, capture=False,
                                 token_sizes=graph_token_sizes(budget))
    return llm


def mixed_step_logits(model_dir, dtype, smoke=False):
    "One scheduled mixed step run eagerly and replayed on the same cache: the sampled rows' logits."
    decodes, fresh, cut, _ = SMOKE_MIXED_STEP if smoke else MIXED_STEP
    llm = mixed_engine(model_dir, dtype, smoke)
    g = random.Random(0)
    ids = lambda n: [g.randrange(llm.config.vocab_size) for _ in range(n)]
    sp = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for n in decodes:                                    # five decoding sequences
        llm.add_request(ids(n), sp, stream=False)
    while any(r.seq.num_computed_tokens < r.seq.num_prompt_tokens for r in llm._requests.values()): llm.step()
    llm.add_request(ids(fresh), sp, stream=False)          # a fresh prompt that fits the step
    llm.add_request(ids(cut), sp, stream=False)            # a prompt the budget cuts: its chunk is not sampled
    step = llm.scheduler.schedule()
    runner = llm.runner
    sampling = [(0.0, 1.0, 0, 0, 0)] * sum(s.sample for s in step.seqs)
    before = runner.kv_cache.clone()
    with torch.inference_mode():
        mixed, runner.mixed_graphs = runner.mixed_graphs, None   # this runner alone, for one eager packing
        x = runner.pack(step, sampling)                      # the eager packing
        dev_i, _ = runner._to_device(x.ints, x.floats)
        i, p, meta, rows = eager_inputs(x, dev_i)
        eager = llm.model.compute_logits(llm.model(i, p, runner.kv_caches, meta)[rows]).clone()
        cache_eager = runner.kv_cache.clone()
        runner.kv_cache.copy_(before)
        sync(llm.device)                                     # the pinned staging buffer is about to be reused
        runner.mixed_graphs = mixed
        x = runner.pack(step, sampling)
        assert x.mixed_bucket is not None, "the step did not go to a mixed graph"
        dev_i, _ = runner._to_device(x.ints, x.floats)
        replay = mixed.run(dev_i[:x.num_step_ints], x.mixed_bucket, x.num_seqs, x.width)[:x.num_sampled].clone()
        sync(llm.device)
    out = {"dtype": dtype, "num_tokens": step.num_tokens, "num_seqs": len(step.seqs), "bucket": x.mixed_bucket,
           "sampled_rows": x.num_sampled, "logits_rel_err": rel_err(replay, eager),
           "max_abs_diff": (replay - eager).abs().max().item(),
           "argmax_agree": (replay.argmax(-1) == eager.argmax(-1)).float().mean().item(),
           "cache_rel_err": rel_err(runner.kv_cache, cache_eager), "any_nan": bool(replay.isnan().any())}
    drain(llm)
    del llm, before, cache_eager; free()
    return out


def check(model_dir, res, smoke=False):
    dtypes = ("float32",) if smoke else ("float32", "bfloat16")
    res["logits"] = [mixed_step_logits(model_dir, d, smoke) for d in dtypes]
    for r in res["logits"]:
        print("logits", r, flush=True)
        assert not r["any_nan"] and r["logits_rel_err"] < (1e-3 if r["dtype"] == "float32" else 5e-2), r
    par = {}
    for dtype in dtypes:
        (off, r_off), (on, r_on) = greedy_with_arrivals(model_dir, dtype, False), greedy_with_arrivals(model_dir, dtype, True)
        par[dtype] = {"sequences": len(off), "identical": sum(a == b for a, b in zip(off, on)),
                      "agreeing_prefixes": [agreeing_prefix(a, b) for a, b in zip(off, on)],
                      "lengths": [len(a) for a in off], "replays_off": r_off, "replays_on": r_on}
        print("parity", dtype, par[dtype], flush=True)
    assert par["float32"]["identical"] == par["float32"]["sequences"], par["float32"]
    res["greedy_parity"] = par


def timed_admissions(llm, num_decodes, prompt_len, reps, g):
    "ms of each step that admits one `prompt_len`-token prompt (max_tokens=1) next to `num_decodes` decodes."
    out = []
    for _ in range(reps):
        llm.add_request([g.randrange(llm.config.vocab_size) for _ in range(prompt_len)],
                        SamplingParams(max_tokens=1, ignore_eos=True), stream=False)
        t0 = time.perf_counter()
        llm.step()
        out.append((time.perf_counter() - t0) * 1e3)
        llm.step()                                   # one decode-only step between admissions
    return out


def steps(model_dir, res, smoke=False, dtype="bfloat16"):
    decodes, prompts, reps = ((1, 2), (16, 64), 2) if smoke else ((1, 32), (16, 128, 512, 2000), 10)
    rows = []
    for mixed in (False, True):
        llm = LLM(model_dir, dtype=dtype, num_kv_blocks=512 if smoke else 16384, max_num_seqs=64,
                  max_num_batched_tokens=2048, mixed_step_graphs=mixed)
        g = random.Random(5)
        for b in decodes:
            for P in prompts:
                steady_decode(llm, b, prompt_len=16 if smoke else 256)
                warm(llm.device, 1.0)
                timed_admissions(llm, b, P, 1 if smoke else 3, g)       # warm-up of this shape
                t1 = timed_admissions(llm, b, P, reps, g)
                t2 = timed_admissions(llm, b, P, reps, g)
                m1, m2 = statistics.median(t1), statistics.median(t2)
                row = {"mixed_graphs": mixed, "decodes": b, "prompt_len": P, "ms_per_step": [m1, m2],
                       "median_ms": statistics.median(t1 + t2), "disagree": disagree(m1, m2)}
                if P == prompts[1]:                                 # kernels and busy share of admission steps
                    with profile_run(llm.device) as run:
                        timed_admissions(llm, b, P, 4, g)
                    row["kernels_per_admission_pair"] = count_device_kernels(run.events) / 4
                    row["gpu_busy"] = busy_share(run) if is_cuda(llm.device) else None
                print("step", row, flush=True)
                rows.append(row)
        if mixed and llm.runner.mixed_graphs:
            res["mixed_graph_capture"] = {"seconds": llm.runner.mixed_graphs.capture_s,
                                          "memory_mib": llm.runner.mixed_graphs.memory_bytes / 2**20,
                                          "buckets": llm.runner.mixed_graphs.token_sizes,
                                          "decode_capture_s": llm.runner.graphs.capture_s}
        drain(llm)
        del llm; free()
    res["admission_steps"] = rows


OFFLINE_CONFIGS = [("continuous", "continuous", {}),
                   ("continuous, mixed steps eager", "continuous", {"mixed_step_graphs": False}),
                   ("static:32", "static:32", {})]


def main():
    args = parser(__doc__, parts="check,steps,offline,nanovllm").parse_args()
    device_or_skip(args)
    smoke, dtype = is_smoke(args), dtype_of(args)
    res = {}
    d05, _ = checkpoint("0.5B", args)
    offline_kw = dict(repeats=1, configs=OFFLINE_CONFIGS[:2], common=SMOKE_COMMON, spec=SMOKE_SPEC, timeout=240) \
        if smoke else dict(configs=OFFLINE_CONFIGS, common=OFFLINE_COMMON, spec=OFFLINE_SPEC)
    parts = {"check": lambda: check(d05, res, smoke), "steps": lambda: steps(d05, res, smoke, dtype),
             "offline": lambda: offline(d05, res, **offline_kw),
             "nanovllm": lambda: nanovllm(d05, res, 1 if smoke else 2, smoke, dtype)}
    run_parts(parts, args.parts, saver("mixed_graphs_h200.json", res, args), res.setdefault("part_seconds", {}))


if __name__ == "__main__":
    main()
