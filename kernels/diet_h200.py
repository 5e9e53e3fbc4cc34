"""Where a steady decode step's time goes, kernel by kernel and phase by phase (issue 6's overhead diet).

Run on the device machine from the repo root:
    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/diet_h200.py --out $OUT [--parts profile,...]
Writes diet_h200.json (raw numbers, git sha, GPU, versions, date) to --out after every part; copy it to
figures/data/.

Random weights of the 0.5B shape, bf16, the GPU defaults (CUDA graphs, fused kernels, async scheduling):
1. profile: at batch 1 and 64 in steady decode, for each configuration (the defaults and each control of
   `--controls`), one profiled window of 32 steps: each kernel name's count and
   device microseconds per step, its share of the step's chain (`marginal_us_by_name`: kernels in start order, each
   credited with how far its end moves the latest end so far; under programmatic dependent launch spans overlap, and
   these shares add up to the step), the sum of kernel time, the wall time per step, and the step ledger's host phases
   from a separate un-profiled window (the ledger's own events are left out of the kernel window); then a second
   window of 32 steps profiled with device activity only (`profile_run(host_ops=False)`): its busy share; and,
   with no profiler, in each of the two timed passes, the share of the window the steps' device spans cover
   (`runner.step_spans`, `span_busy_share`);
2. parity: greedy tokens with the engine's defaults against the plain path (`enforce_eager=True`, fused kernels
   off, synchronous) in fp32 and bf16 (agreement reported), and the decode-attention kernel against its
   reference at split counts 1..16;
3. gemv: the one-row projections of the 0.5B and 7B shapes, cuBLAS against the fused-kernels chapter's `gemv`
   (its rule, candidate blocks, split counts), each timed in CUDA graphs over weight copies that defeat L2; the
   best per shape is recorded (a proposal for the package's table, which the script never changes);
4. splits: the decode-attention kernel alone for batch x context cases and split counts 1..16 (CUDA graphs
   over KV-cache copies), against the split the package's rule picks;
6. nanovllm: nano-vllm's workload (256 requests, uniform 100..1024 in and out, EOS ignored), three runs;
5. rate / rate256 / rate7b: ms per step (back to back, one sync per pass, two passes) with the defaults and with
   the control (`--control row_gemv`: `row_gemv=False`, cuBLAS; `--control pdl`: `pdl=False`, no programmatic
   dependent launch), 0.5B at batch 1, 8, 64 and 7B at batch 1; rate7bq: the 7B at batch 1 quantized, INT8 and
   INT4, with the defaults and the control, and with the LM head quantized too;
7. gemvpdl: the one-row projections' `gemv` (the tuned configs) timed back to back in CUDA graphs with and without
   programmatic dependent launch;
8. qrow: the 7B quantized projections at one row, the GEMV against the tensor-core GEMM.
9. profileb1: the profile at batch 1 alone, for the defaults and each control; profile7bq: the 7B at batch 1, bf16,
   INT4, and INT4 with the LM head quantized; gemv05: the gemv sweep for the 0.5B
   shapes only (1024-wide K tiles tried first); gemvfam: the same for Qwen3-0.6B; gemvfam2: for Qwen3-1.7B,
   Llama-3.2-1B and Llama-3.1-8B (whose projections are Mistral-7B's); splitsq3: the splits sweep at Qwen3-0.6B's
   heads (16 query, 8 KV, head dim 128), under "splits_qwen3"; profile256q3: profile256's profile for Qwen3-0.6B at
   256, 64 and 16 rows from 600-token prompts (its workload's wide, middle and narrow steps); profileq3: the
   profile of Qwen3-0.6B at batch 1; profile256: the profile at 256 rows from 1,000-token contexts (nano-vllm's
   workload at its widest), under "long"; rate1b / rate7bb: as rate / rate7b, under "rate_after";
10. ab / ab7b: an interleaved A/B: the defaults and a control (`--before`: a configuration name whose phrases
   are engine overrides, e.g. "rope_cache, torch argmax" or "norm kernel, fp32 logits, loads apart") both built first, then timed in
   alternating passes, new sequences each round (0.5B: batch 1 and 64, prompts of 128 and 2,000; 7B: batch 1).
   Parity also checks the decode kernel with RoPE inside against `rope_cache` + the decode kernel, and
   `argmax_rows` against torch. Controls of the sixth round: `rope` ("rope_cache"), `argmax` ("torch argmax"),
   `both`.
In the tutorials' order: parity checks (asserted where they must hold: fp32 greedy tokens identical, the decode
kernel within bf16 rounding of its reference, RoPE inside the decode kernel identical to `rope_cache`, the norm
taken into `gemv` identical, `argmax_rows` identical to torch's), then the timings, then the data (written after
every part, through kernels/lab.py). The 7B weights are `nanoserve.bench.random_checkpoint("7B")`. `--smoke`:
the parts without quantization or PDL (parity, profile, gemv, splits, rate, ab, nanovllm_ab, logits) on the
built-in tiny model and tiny kernel shapes on the CPU under the Triton interpreter, written only to a temp folder.
"""
import random, sys, time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import (LLM, SMOKE_ARGV, SamplingParams, StepLedger, agreeing_prefix, checkpoint, copies_for_l2,  # noqa: E402
                 device_or_skip, drain, free, graph_bench, is_cuda, is_smoke, model_config,
                 nanovllm, nanovllm_requests, operand_copies, parser, run_parts, saver, steady_decode, step_rates,
                 sync, timed_generate, tiny_model, warm)

import torch                                                 # noqa: E402
import torch.nn.functional as F                              # noqa: E402

from nanoserve.attention import (choose_num_splits, decode_attention, decode_attention_ref, rope_cache,  # noqa: E402
                                 tile_n)
from nanoserve.fused import add_rmsnorm, argmax_rows, gemv, gemv_config, silu_mul   # noqa: E402
from nanoserve.measure import busy_share, event_record, is_device_kernel, profile_run, span_busy_share  # noqa: E402
from nanoserve.model import SHAPES                           # noqa: E402
from nanoserve.quant import quant_gemm, quant_gemv, quantize_int4, quantize_int8   # noqa: E402
from nanoserve.runner import SamplingMetadata, sample         # noqa: E402
from nanoserve.runtime import num_sms                        # noqa: E402

DEVICE = torch.device("cpu" if SMOKE_ARGV else "cuda")      # the kernels' operands: the GPU, or the CPU of --smoke
KDTYPE = torch.float32 if SMOKE_ARGV else torch.bfloat16    # the kernels' dtype (the interpreter has no bf16)
# The sizes of a run: the GPU's, or the tiny ones of --smoke (the same code, seconds on a CPU under the interpreter).
RUN = (dict(dtype="float32", kv_blocks=512, prompt_len=16, long_prompt=64, warm_steps=2, steps=2, rounds=2,
            vocab=3072, hidden=64, parity_prompts=(7, 33, 64, 100), parity_tokens=8,
            decode_cases=((1, 17), (3, 40)), splits=(1, 2), rope_cases=((1, 17, 1), (3, 40, 2)),
            norm_shapes=((192, 64), (352, 64)), argmax_rows=(1, 8, 20), logits_rows=(1, 20),
            split_cases=((1, 64), (2, 32)), split_cases_q3=((2, 32),)) if SMOKE_ARGV else
       dict(dtype="bfloat16", kv_blocks=16384, prompt_len=128, long_prompt=2000, warm_steps=20, steps=200, rounds=None,
            vocab=151936, hidden=896, parity_prompts=(7, 33, 64, 100, 130, 257, 1000, 1500), parity_tokens=48,
            decode_cases=((1, 17), (3, 700), (64, 129), (8, 4000)), splits=(1, 2, 4, 8, 16),
            rope_cases=((1, 17, 1), (1, 1000, 16), (3, 700, 8), (64, 129, 4), (256, 1024, 1)),
            norm_shapes=((1152, 896), (9728, 896), (4608, 3584), (37888, 3584)), argmax_rows=(1, 8, 64, 256),
            logits_rows=(1, 16, 64, 256),
            split_cases=((1, 1024), (1, 4096), (8, 1024), (32, 1024), (64, 1024), (128, 1024), (256, 1024),
                         (64, 256)),
            split_cases_q3=((1, 256), (1, 1024), (8, 1024), (16, 1024), (32, 1024), (64, 512), (64, 1024),
                            (64, 2048), (128, 1024))))

# The controls a configuration's name asks for, as engine overrides (`LLM(..., **controls(name))`): each phrase in
# the name turns one of the engine's kernel fields to its control value.
CONTROL_PHRASES = (("fp32 logits", "fp32_logits", True),        # an fp32 logits buffer, the LM head cast into it
                   ("loads apart", "load_step_kernel", False),  # two copies and `apply_feed` before a replay
                   ("rope_cache", "rope_in_decode", False),     # `rope_cache` before the decode kernel
                   ("torch argmax", "fast_argmax", False),      # torch's argmax in the sampler
                   ("norm kernel", "norm_in_gemv", False))      # `add_rmsnorm`'s own launch before `gemv`


def controls(cname: str) -> dict:
    "The `LLM` keyword overrides of the controls named in `cname` (none for the defaults)."
    return {field: value for phrase, field, value in CONTROL_PHRASES if phrase in cname}



def rates(model_dir, res, shape, batches, configs, key="rate", **kw_rates):
    "`lab.step_rates` per configuration, its named controls passed to the engine; rows under `key`."
    for cname, kw in configs:
        step_rates(model_dir, res, shape, batches, [(cname, {**kw, **controls(cname)})], key, dtype=RUN["dtype"],
                   **kw_rates)


def profile(model_dir, res, batches=(1, 64), steps=32, rate_steps=200, configs=(("defaults", {}),)):
    "`configs`: (name, LLM keyword arguments); the controls the name gives are passed to the engine too."
    for cname, kw in configs:
        profile_config(model_dir, res.setdefault("profile", {}).setdefault(cname, {}), batches, steps, rate_steps,
                       cname, {**kw, **controls(cname)})


def profile_long(model_dir, res, batch=256, prompt_len=1000, steps=16, rate_steps=100):
    "The decode step of `batch` rows at `prompt_len`-token contexts and longer (nano-vllm's workload at its widest)."
    saved = dict(RUN)
    RUN.update(prompt_len=prompt_len, kv_blocks=max(RUN["kv_blocks"], batch * (prompt_len + 3 * rate_steps + 4 * steps) // 16 + batch))
    try: profile(model_dir, res.setdefault("long", {}), batches=(batch,), steps=steps, rate_steps=rate_steps)
    finally: RUN.clear(); RUN.update(saved)


def profile_config(model_dir, out, batches, steps, rate_steps, cname, kw):
    llm = LLM(model_dir, dtype=RUN["dtype"], num_kv_blocks=RUN["kv_blocks"], max_num_seqs=max(batches), **kw)
    unprofiled = {}
    for b in batches:        # first, before any profiler in the process (once started, it slows the host for good)
        steady_decode(llm, b, RUN["prompt_len"])
        warm(llm.device, 1.0)
        for _ in range(RUN["warm_steps"]): llm.step()
        times, span_share, span_ms = [], [], []
        for _ in range(2):            # the step rate, twice, un-profiled, no ledger; each step's device span by events
            llm.runner.step_spans = []
            sync(DEVICE); t0 = time.perf_counter()
            for _ in range(rate_steps): llm.step()
            sync(DEVICE); times.append((time.perf_counter() - t0) / rate_steps * 1e3)
            sp, llm.runner.step_spans = llm.runner.step_spans, None
            span_share.append(span_busy_share(sp) if sp else None)     # no device spans on a CPU
            span_ms.append(sum(a.elapsed_time(e) for a, e in sp) / len(sp) if sp else None)
        unprofiled[b] = times, span_share, span_ms
    for b in batches:
        steady_decode(llm, b, RUN["prompt_len"])
        warm(llm.device, 1.0)
        for _ in range(RUN["warm_steps"]): llm.step()
        times, span_share, span_ms = unprofiled[b]
        llm.ledger = StepLedger()                            # host phases (the ledger adds two events per step)
        for _ in range(rate_steps): llm.step()
        ledger = llm.ledger.summary()
        llm.ledger = None
        with profile_run(llm.device) as run:
            for _ in range(steps): llm.step()
            sync(DEVICE)
        try:                                                   # device activity only: the host as unprofiled
            with profile_run(llm.device, host_ops=False) as drun:
                for _ in range(steps): llm.step()
                sync(DEVICE)
            device_only = {"busy_share_device_only": busy_share(drun),
                           "device_only_wall_ms_per_step": drun.wall_s * 1e3 / steps,
                           "device_only_kernels_per_step": drun.num_kernels / steps}
        except Exception as e:                                 # first used in this script: keep the rest of the row
            device_only = {"device_only_error": repr(e)[:300]}
        by_name, count = defaultdict(float), defaultdict(int)
        spans = []
        for e in run.events:
            if not is_device_kernel(e): continue
            r = event_record(e)
            by_name[r["name"][:90]] += r["end_us"] - r["start_us"]
            count[r["name"][:90]] += 1
            spans.append((r["start_us"], r["end_us"]))
        named = sorted((event_record(e) for e in run.events if is_device_kernel(e)), key=lambda r: r["start_us"])
        marginal, last_end = defaultdict(float), None    # what each kernel adds to the end of the chain so far
        for r in named:
            if last_end is not None and r["start_us"] - last_end < 20:   # inside a step (not the gap between steps)
                marginal[r["name"][:90]] += max(0.0, r["end_us"] - last_end)
            last_end = r["end_us"] if last_end is None else max(last_end, r["end_us"])
        spans.sort()
        gaps = [b0 - a1 for (_, a1), (b0, _) in zip(spans, spans[1:])]
        gaps_small = [g for g in gaps if 0 <= g < 20]        # between kernels of one graph (a step's gaps are larger)
        row = {"batch": b, "ms_per_step": times, "span_busy_share": span_share, "span_ms_per_step": span_ms,
               "busy_share": busy_share(run) if is_cuda(llm.device) else None, "disagree": abs(times[0] - times[1]) > 0.15 * min(times),
               "profiled_wall_ms_per_step": run.wall_s * 1e3 / steps,
               **device_only,
               "kernels_per_step": len(spans) / steps,
               "kernel_us_per_step": sum(by_name.values()) / steps,
               "gap_us_under_20_per_step": sum(gaps_small) / steps, "num_gaps_under_20": len(gaps_small) / steps,
               "gap_us_over_20_per_step": sum(g for g in gaps if g >= 20) / steps,
               "marginal_us_by_name": {k: v / steps for k, v in sorted(marginal.items(), key=lambda kv: -kv[1])},
               "by_name": {k: {"count": count[k] / steps, "us": v / steps} for k, v in
                           sorted(by_name.items(), key=lambda kv: -kv[1])},
               "ledger_ms": {k: v * 1e3 if isinstance(v, float) else v for k, v in ledger.items()}}
        print("profile", cname, b, device_only, {k: row[k] for k in ("ms_per_step", "span_busy_share", "span_ms_per_step",
                                                 "busy_share", "profiled_wall_ms_per_step",
                                                 "kernels_per_step", "kernel_us_per_step",
                                                 "gap_us_under_20_per_step", "gap_us_over_20_per_step")}, flush=True)
        print("  ledger", {k: round(v, 3) for k, v in row["ledger_ms"].items()}, flush=True)
        print("  top", [(k[:40], round(v["us"], 1)) for k, v in list(row["by_name"].items())[:12]], flush=True)
        print("  marginal", [(k[:40], round(v, 1)) for k, v in list(row["marginal_us_by_name"].items())[:14]],
              flush=True)
        out[b] = row
    drain(llm)
    del llm; free()


def parity(model_dir, res):
    "Greedy tokens, GPU defaults against enforce_eager (fp32 identical; bf16 reported); decode kernel vs reference."
    g = random.Random(5)
    prompts = [[g.randrange(RUN["vocab"]) for _ in range(n)] for n in RUN["parity_prompts"]]
    sp = SamplingParams(max_tokens=RUN["parity_tokens"], temperature=0, ignore_eos=True)
    out = {}
    for dtype in ("float32", RUN["dtype"]) if RUN["dtype"] != "float32" else ("float32",):
        toks = {}
        for name, kw in (("eager", dict(enforce_eager=True, async_scheduling=False, fused_kernels=False)),
                         ("defaults", {})):
            llm = LLM(model_dir, dtype=dtype, num_kv_blocks=2048, max_num_seqs=8, **kw)
            toks[name] = [o.token_ids for o in llm.generate(prompts, sp)]
            drain(llm); del llm; free()
        a, b = toks["eager"], toks["defaults"]
        out[dtype] = {"sequences": len(a), "identical": sum(x == y for x, y in zip(a, b)),
                      "agreeing_prefixes": [agreeing_prefix(x, y) for x, y in zip(a, b)]}
        print("parity", dtype, out[dtype], flush=True)
    assert out["float32"]["identical"] == out["float32"]["sequences"], out["float32"]
    rows = []
    torch.manual_seed(0)
    for B, ctx in RUN["decode_cases"]:
        H, KVH, D, bs = 14, 2, 64, 16
        nblk = (ctx + bs - 1) // bs
        k = torch.randn(B * nblk + 4, bs, KVH, D, device=DEVICE, dtype=KDTYPE)
        v = torch.randn_like(k)
        table = torch.randperm(B * nblk + 4, device=DEVICE)[:B * nblk].view(B, nblk)   # [B, nblk]
        lens = torch.randint(1, ctx + 1, (B,), device=DEVICE)
        q = torch.randn(B, H, D, device=DEVICE, dtype=KDTYPE)
        ref = decode_attention_ref(q.float(), k.float(), v.float(), table, lens, D ** -0.5)
        for splits in RUN["splits"]:
            for _ in range(3):                                                 # replays reuse the counters
                o = decode_attention(q, k, v, table, lens, D ** -0.5, bs, num_splits=splits)
            rows.append({"B": B, "ctx": ctx, "splits": splits,
                         "max_abs_err": (o.float() - ref).abs().max().item()})
    out["decode_kernel"] = rows
    print("decode kernel worst", max(r["max_abs_err"] for r in rows), flush=True)
    assert max(r["max_abs_err"] for r in rows) < 0.05, "the decode kernel strays from its reference"    # bf16 rounding
    out["rope_in_decode"] = rope_in_decode_parity()
    assert all(r["out_identical"] and r["caches_identical"] for r in out["rope_in_decode"]), out["rope_in_decode"]
    out["batch1"] = batch1_parity(model_dir, prompts[:4])
    assert all(v == out["batch1"]["float32"]["sequences"] for v in out["batch1"]["float32"].values()), out["batch1"]
    out["norm_gemv"] = norm_gemv_parity()
    exact = KDTYPE == torch.bfloat16     # bf16 outputs bit for bit; fp32 (--smoke) within its rounding
    assert all(r["residual_identical"] and (r["identical"] if exact else r["max_abs_diff"] <= 1e-6 * r["max_abs"])
               for r in out["norm_gemv"]), "the norm taken into gemv differs from add_rmsnorm then gemv"
    out["argmax_rows"] = []
    V = RUN["vocab"]
    for B in RUN["argmax_rows"]:
        x = torch.randn(B, V, device=DEVICE)
        x[0, 7] = x[0, V - 1936] = x[0].max() + 1                 # a tie: the first index wins
        out["argmax_rows"].append({"B": B, "identical": all(torch.equal(argmax_rows(x), x.argmax(-1)) for _ in range(3))})
    print("argmax_rows", out["argmax_rows"], flush=True)
    assert all(r["identical"] for r in out["argmax_rows"]), out["argmax_rows"]
    res["parity"] = out


def interleaved(model_dir, res, shape, batches=(1,), rounds=4, steps=200, prompt_lens=(128,), before="norm kernel"):
    """The engine's defaults against a control (the configuration named `before`, its controls passed to its engine:
    e.g. "norm kernel", "rope_cache, torch argmax"; each engine captured under its own settings), both built first, then timed in
    alternating passes (ABAB...) so that drift of the GPU or the host falls on both alike; every pass is kept.
    Every round starts new sequences (prompts of `prompt_lens`), so each pass decodes over the same contexts."""
    engines, cname = {}, {"defaults": "defaults", "before": before}
    for name in ("defaults", "before"):
        engines[name] = LLM(model_dir, dtype=RUN["dtype"], num_kv_blocks={"0.5B": 16384, "7B": 4096}.get(shape, 512),
                            max_num_seqs=max(batches), max_num_batched_tokens=2048, **controls(cname[name]))
    out = res.setdefault("interleaved", [])
    for b, plen in ((b, p) for p in prompt_lens for b in batches):
        row = {"shape": shape, "batch": b, "prompt_len": plen, "before": before, "ms_per_step": {n: [] for n in engines}}
        for _ in range(rounds):
            for name, llm in engines.items():                  # the same contexts every round (+ 220)
                steady_decode(llm, b, plen)
            for name, llm in engines.items():
                warm(llm.device, 0.3)
                for _ in range(RUN["warm_steps"]): llm.step()
                sync(DEVICE); t0 = time.perf_counter()
                for _ in range(steps): llm.step()
                sync(DEVICE)
                row["ms_per_step"][name].append((time.perf_counter() - t0) / steps * 1e3)
        med = {n: sorted(v)[len(v) // 2] for n, v in row["ms_per_step"].items()}
        row["median_ms"], row["ratio_before_over_defaults"] = med, med["before"] / med["defaults"]
        row["passes_disagree"] = {n: max(v) > 1.15 * min(v) for n, v in row["ms_per_step"].items()}
        print("interleaved", shape, b, plen, {n: [round(x, 3) for x in v] for n, v in row["ms_per_step"].items()},
              "median", {n: round(x, 3) for n, x in med.items()}, flush=True)
        out.append(row)
    for llm in engines.values(): drain(llm)
    del engines; free()


def nanovllm_ab(model_dir, res, rounds=3, before="fp32 logits", before_first=False, key="nanovllm_ab"):
    """nano-vllm's workload (256 requests, 100..1024 in and out, greedy, EOS ignored) on the defaults and on `before`,
    both engines built first (the same KV cache, 36,000 blocks: no preemption), then run in alternating passes, the
    order swapped every round (ABBAAB...)."""
    cname, engines = {"defaults": "defaults", "before": before}, {}
    for name in (reversed(list(cname)) if before_first else cname):          # `before_first`: built first
        engines[name] = LLM(model_dir, dtype=RUN["dtype"], num_kv_blocks=512 if SMOKE_ARGV else 36000,
                            max_num_seqs=256, max_num_batched_tokens=16384, **controls(cname[name]))
    llm = engines["defaults"]
    reqs, sp = nanovllm_requests(llm.config.vocab_size, llm.max_model_len, smoke=SMOKE_ARGV)
    tps = {n: [] for n in cname}
    for i in range(rounds):                                    # ABBA...: neither always runs first
        for name in (list(cname) if i % 2 == 0 else list(reversed(cname))):
            llm = engines[name]
            n, times, _ = timed_generate(llm, reqs, sp, 1, name, warm_s=0.0 if SMOKE_ARGV else 3.0)
            tps[name].append(n / times[0])
    med = {k: sorted(v)[len(v) // 2] for k, v in tps.items()}
    res[key] = {"before": before, "before_built_first": before_first, "output_tokens": n,
                "numerator": "output tokens actually generated", "output_tokens_per_s": tps, "median": med,
                "ratio_defaults_over_before": med["defaults"] / med["before"],
                "passes_disagree": {k: max(v) > 1.15 * min(v) for k, v in tps.items()}}
    print("nanovllm A/B", before, {k: [round(x) for x in v] for k, v in tps.items()}, flush=True)
    for llm in engines.values(): drain(llm)
    del engines, llm; free()


def greedy_metadata(rows: int) -> SamplingMetadata:
    "The sampler's parameters for `rows` greedy rows (temperature 0): `sample` then takes the engine's argmax."
    zeros = torch.zeros(rows, dtype=torch.int64, device=DEVICE)
    return SamplingMetadata(torch.zeros(rows, device=DEVICE), torch.ones(rows, device=DEVICE), zeros, zeros, zeros)


def us_per_call(f, reps: int) -> float:
    "Microseconds a call of `f` over `reps` back-to-back calls: one pair of CUDA events around them (the host's clock on a CPU)."
    if not is_cuda(DEVICE):
        t0 = time.perf_counter()
        for _ in range(reps): f()
        return (time.perf_counter() - t0) * 1e6 / reps
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps): f()
    b.record(); sync(DEVICE)
    return a.elapsed_time(b) * 1e3 / reps


def logits_micro(res, reps=50):
    """The LM head and greedy argmax of the 0.5B shape at 1, 16, 64 and 256 rows, each way round: bf16 logits written
    by the product (`torch.mm(out=)`, the defaults) against `F.linear` cast into an fp32 buffer (the control); us per
    call from CUDA events over `reps` calls, each way timed twice, alternating."""
    torch.manual_seed(3)
    V, H = RUN["vocab"], RUN["hidden"]
    w = torch.randn(V, H, device=DEVICE, dtype=KDTYPE) * 0.02
    rows = []
    for B in RUN["logits_rows"]:
        hid = torch.randn(B, H, device=DEVICE, dtype=KDTYPE)
        buf16 = torch.empty(B, V, device=DEVICE, dtype=KDTYPE)
        buf32 = torch.empty(B, V, device=DEVICE, dtype=torch.float32)
        m = greedy_metadata(B)            # the engine's greedy argmax (`fast_argmax`: argmax_rows up to 16 rows)
        ways = {"bf16 logits": lambda: sample(torch.mm(hid, w.t(), out=buf16), m, fast_argmax=True),
                "fp32 logits": lambda: sample(buf32.copy_(F.linear(hid, w)), m, fast_argmax=True)}
        assert torch.equal(ways["bf16 logits"](), ways["fp32 logits"]())
        us = {k: [] for k in ways}
        for _ in range(2):
            for k, f in ways.items():
                for _ in range(5): f()
                us[k].append(us_per_call(f, reps))
        rows.append({"rows": B, "us": us})
        print("logits", B, {k: [round(x, 1) for x in v] for k, v in us.items()}, flush=True)
    res["logits_micro"] = rows


def batch1_parity(model_dir, prompts):
    """Greedy tokens at batch 1 (one sequence at a time: every decode step takes the one-row path), the defaults
    against enforce_eager (fp32) and against the seventh round's control (fp32 and bf16)."""
    sp = SamplingParams(max_tokens=RUN["parity_tokens"], temperature=0, ignore_eos=True)
    out = {}
    for dtype in ("float32", RUN["dtype"]) if RUN["dtype"] != "float32" else ("float32",):
        toks = {}
        for name, kw in (("eager", dict(enforce_eager=True, async_scheduling=False, fused_kernels=False)),
                         ("defaults", {}), ("norm kernel, fp32 logits, loads apart", {})):
            if name == "eager" and dtype == "bfloat16": continue
            llm = LLM(model_dir, dtype=dtype, num_kv_blocks=2048, max_num_seqs=1, **kw, **controls(name))
            toks[name] = [o.token_ids for o in llm.generate(prompts, sp)]
            drain(llm); del llm; free()
        d = toks["defaults"]
        out[dtype] = {n: sum(x == y for x, y in zip(d, t)) for n, t in toks.items() if n != "defaults"}
        out[dtype]["sequences"] = len(d)
        print("batch-1 parity", dtype, out[dtype], flush=True)
    return out


def norm_gemv_parity():
    """`gemv` with the RMSNorm taken in against `add_rmsnorm` then `gemv`, bf16, the QKV and gate/up shapes of the
    0.5B and 7B models, with and without a residual: outputs and new residuals compared bit for bit."""
    rows = []
    torch.manual_seed(2)
    for j, (N, K) in enumerate(RUN["norm_shapes"]):       # (QKV, gate/up) of each model: the QKV ones with a bias
        w = torch.randn(N, K, device=DEVICE, dtype=KDTYPE) * 0.02
        b = torch.randn(N, device=DEVICE, dtype=KDTYPE) if j % 2 == 0 else None
        nw = torch.rand(K, device=DEVICE, dtype=KDTYPE) + 0.5
        for res in (False, True):
            for _ in range(3):
                x = torch.randn(1, K, device=DEVICE, dtype=KDTYPE) * 4
                r = torch.randn_like(x) * 4 if res else None
                h, want_r = add_rmsnorm(x, r, nw, 1e-6) if res else (add_rmsnorm(x, None, nw, 1e-6), x)
                want = gemv(h, w, b)
                got, got_r = gemv(x, w, b, norm=(nw, 1e-6), residual=r)
                rows.append({"N": N, "K": K, "residual": res, "identical": torch.equal(got, want),
                             "residual_identical": torch.equal(got_r, want_r),
                             "max_abs_diff": (got.float() - want.float()).abs().max().item(),
                             "max_abs": want.float().abs().max().item()})
    print("norm gemv parity: identical", sum(r["identical"] for r in rows), "of", len(rows), "residuals",
          sum(r["residual_identical"] for r in rows), "worst", max(r["max_abs_diff"] for r in rows), flush=True)
    return rows


def rope_in_decode_parity():
    "The decode kernel with RoPE and the cache write inside against `rope_cache` + the decode kernel, bf16."
    rows = []
    torch.manual_seed(1)
    H, KVH, D, bs = 14, 2, 64, 16
    for B, ctx, splits in RUN["rope_cases"]:
        nblk = (ctx + bs - 1) // bs
        kc = torch.randn(B * nblk + 4, bs, KVH, D, device=DEVICE, dtype=KDTYPE)
        vc = torch.randn_like(kc)
        table = torch.randperm(B * nblk + 4, device=DEVICE)[:B * nblk].view(B, nblk)   # [B, nblk]
        lens = torch.randint(1, ctx + 1, (B,), device=DEVICE)
        last = lens - 1
        slots = table[torch.arange(B, device=DEVICE), last // bs] * bs + last % bs
        qkv = torch.randn(B, (H + 2 * KVH) * D, device=DEVICE, dtype=KDTYPE)
        ang = torch.rand(B, D // 2, device=DEVICE) * 6
        cos, sin = torch.cat([ang.cos()] * 2, -1).to(KDTYPE), torch.cat([ang.sin()] * 2, -1).to(KDTYPE)
        k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        q = rope_cache(qkv, cos, sin, slots, k1, v1, H, KVH)
        a = decode_attention(q, k1, v1, table, lens, D ** -0.5, ctx, num_splits=splits)
        o = torch.empty_like(a)
        b = decode_attention(None, k2, v2, table, lens, D ** -0.5, ctx, num_splits=splits, out=o,
                             rope=(qkv, cos, sin, slots))
        rows.append({"B": B, "ctx": ctx, "splits": splits, "out_identical": torch.equal(a, b),
                     "max_abs_diff": (a.float() - b.float()).abs().max().item(),
                     "caches_identical": torch.equal(k1, k2) and torch.equal(v1, v2)})
    print("rope_in_decode", rows, flush=True)
    return rows


def layer_shapes(shape):
    "(name, N, K, act, bias) of one layer's projections, as `gemv` takes them (down_proj with the activation)."
    from nanoserve.model import ModelConfig
    c = ModelConfig.from_dict(SHAPES[shape] if shape in SHAPES else model_config(tiny_model()))   # "tiny": --smoke
    h, i, q, kv = c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return [("qkv_proj", q + 2 * kv, h, False, c.attention_bias), ("o_proj", h, q, False, False),
            ("gate_up_proj", 2 * i, h, False, False), ("down_proj", h, i, True, False)]


def layer_operands(N: int, K: int, act: bool, bias: bool, copies: bool = True):
    "Seeded random bf16 operands of one projection at one row, and (`copies`) enough weight copies for graph_bench."
    g = torch.Generator(device=DEVICE).manual_seed(0)
    w = torch.randn(N, K, device=DEVICE, dtype=KDTYPE, generator=g) * 0.02
    b = torch.randn(N, device=DEVICE, dtype=KDTYPE, generator=g) if bias else None
    x = torch.randn(1, 2 * K if act else K, device=DEVICE, dtype=KDTYPE, generator=g)
    nbytes = 2 * N * K
    return w, b, x, nbytes, [w] + [w.clone() for _ in range(copies_for_l2(nbytes) - 1 if copies else 0)]


def quantized_copies(w: torch.Tensor, method: str):
    "`w` quantized (INT4: groups of 128), copies of it for graph_bench, and the bytes of one quantized weight."
    q = quantize_int8(w) + (None,) if method == "int8" else quantize_int4(w, 128)
    qb = q[0].numel() * q[0].element_size()
    return q, operand_copies(q, qb), qb


def gemv_sweep(res, shapes=("0.5B", "7B"), budget_s=75.0, pdl=True):
    """One-row projections: cuBLAS (F.linear; down_proj: silu_mul + F.linear) against `gemv` with its rule and
    candidate blocks (the first, `{}`, is the package's own choice), each timed by graph_bench; the best config per
    shape is recorded, not applied (the package's table, nanoserve/tables/gemv.json, is data: a sweep proposes, a
    commit changes it). Also each shape's error against an fp32 reference."""
    sms = num_sms(DEVICE)
    out = res["gemv"] = {"timer": "graph_bench (us per call)", "rows": [], "chosen": {}, "pdl": pdl}
    cands = [{}] + [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w} for k in (1024, 512, 256, 128) for n in (8, 16, 32)
                    for w in (4, 8)]           # 1024 first: a whole 896-wide row in one tile, loaded before the wait
    t0 = time.perf_counter()
    layers = []
    for shape in shapes:
        for name, N, K, act, bias in layer_shapes(shape):
            w, b, x, nbytes, ws = layer_operands(N, K, act, bias)
            ref = F.linear(silu_mul(x).float() if act else x.float(), w.float(), None if b is None else b.float())
            err = ((gemv(x, w, b, act).float() - ref).abs().max() / ref.abs().max()).item()
            cub = (lambda i: (lambda: F.linear(silu_mul(x), ws[i], b))) if act else (lambda i: (lambda: F.linear(x, ws[i], b)))
            row = {"shape": shape, "layer": name, "N": N, "K": K, "act": act, "rel_err_vs_fp32": err,
                   "cublas_us": graph_bench(cub, nbytes)}
            layers.append((row, x, ws, b, act, nbytes))
            out["rows"].append(row)
    for row, x, ws, b, act, nbytes in layers:
        best = None
        for cfg in cands:
            if time.perf_counter() - t0 > budget_s and cfg: break
            us = min(graph_bench(lambda i: (lambda: gemv(x, ws[i], b, act, cfg, pdl=pdl)), nbytes))
            row.setdefault("gemv_us", []).append({**cfg, "us": us})
            if best is None or us < best[0]: best = (us, cfg)
        full = {k: v for k, v in gemv_config(row["N"], row["K"], sms, best[1]).items() if k != "tiles_per_split"}
        for sk in (1, 2, 4, 8, 16):                                    # the winner's blocks with other splits
            if sk == full["SPLIT_K"]: continue
            c = {**full, "SPLIT_K": sk}
            us = min(graph_bench(lambda i: (lambda: gemv(x, ws[i], b, act, c, pdl=pdl)), nbytes))
            row["gemv_us"].append({**c, "us": us})
            if us < best[0]: best = (us, c)
        chosen = {k: v for k, v in gemv_config(row["N"], row["K"], sms, best[1]).items() if k != "tiles_per_split"}
        out["chosen"][f"{row['N']}x{row['K']}"] = chosen
        row["chosen"], row["chosen_us"] = chosen, best[0]
        row["speedup_vs_cublas"] = min(row["cublas_us"]) / best[0]
        row["GBps"] = nbytes / (best[0] * 1e-6) / 1e9
        print("gemv", row["shape"], row["layer"], f"cublas {min(row['cublas_us']):.1f} us, gemv {best[0]:.1f} us",
              chosen, f"err {row['rel_err_vs_fp32']:.1e}", flush=True)
    del layers; free()


def gemv_pdl(res, shapes=("0.5B", "7B")):
    "Each one-row projection's `gemv` (tuned config) in CUDA graphs of back-to-back calls, PDL on and off."
    rows = res.setdefault("gemv_pdl", [])
    for shape in shapes:
        for name, N, K, act, bias in layer_shapes(shape):
            w, b, x, nbytes, ws = layer_operands(N, K, act, bias)
            same = torch.equal(gemv(x, w, b, act, pdl=True), gemv(x, w, b, act, pdl=False))
            row = {"shape": shape, "layer": name, "N": N, "K": K, "act": act, "identical": same}
            for pdl in (False, True):
                row[f"pdl={pdl}_us"] = graph_bench(lambda i: (lambda: gemv(x, ws[i], b, act, pdl=pdl)), nbytes)
            row["speedup"] = min(row["pdl=False_us"]) / min(row["pdl=True_us"])
            print("gemv_pdl", row, flush=True)
            rows.append(row)
            if shape == "7B":                                  # the quantized GEMV of the same layer
                for method in ("int8", "int4"):
                    _, qs, qb = quantized_copies(w, method)
                    xq = x[:, :K].contiguous()
                    qrow = {"shape": shape, "layer": name, "method": method}
                    for pdl in (False, True):
                        qrow[f"pdl={pdl}_us"] = graph_bench(
                            lambda i: (lambda: quant_gemv(xq, *qs[i], b, method, 128, pdl=pdl)), qb)
                    qrow["speedup"] = min(qrow["pdl=False_us"]) / min(qrow["pdl=True_us"])
                    print("quant_gemv_pdl", qrow, flush=True)
                    rows.append(qrow)
                    del qs
            del ws; free()


def quant_one_row(res, budget_s=60.0):
    "The 7B projections at one row, quantized: the FMA GEMV (tuned) against the tensor-core GEMM path (16-row tiles)."
    rows = res.setdefault("quant_one_row", [])
    t0 = time.perf_counter()
    cands = [{"BLOCK_M": 16, "BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": st}
             for n in (32, 64, 128) for k in (64, 128) for w in (4, 8) for st in (3, 4)]
    for name, N, K, act, bias in layer_shapes("7B"):
        w, b, x, _, _ = layer_operands(N, K, False, bias, copies=False)
        for method in ("int8", "int4"):
            q, qs, qb = quantized_copies(w, method)
            ref = quant_gemv(x, *q, b, method, 128).float()
            row = {"layer": name, "method": method, "gemv_us": min(graph_bench(
                lambda i: (lambda: quant_gemv(x, *qs[i], b, method, 128)), qb)), "gemm": []}
            for cfg in cands:
                if time.perf_counter() - t0 > budget_s: break
                try:
                    err = ((quant_gemm(x, *q, b, method, 128, config=cfg).float() - ref).abs().max()
                           / ref.abs().max()).item()
                    us = min(graph_bench(lambda i: (lambda: quant_gemm(x, *qs[i], b, method, 128, config=cfg)), qb))
                except Exception as e:                      # a config that does not compile (shared memory)
                    row["gemm"].append({**cfg, "error": str(e)[:80]}); continue
                row["gemm"].append({**cfg, "us": us, "rel_err": err})
            ok = [c for c in row["gemm"] if "us" in c]
            if ok:
                best = min(ok, key=lambda c: c["us"])
                row["best_gemm"], row["gemm_over_gemv"] = best, row["gemv_us"] / best["us"]
            print("quant_one_row", name, method, f"gemv {row['gemv_us']:.1f} us", "best gemm",
                  row.get("best_gemm"), flush=True)
            rows.append(row)
            del qs
        del w; free()


def split_sweep(res, cases=((1, 1024), (1, 4096), (8, 1024), (32, 1024), (64, 1024), (128, 1024), (256, 1024),
                             (64, 256)), splits=(1, 2, 4, 8, 16), heads=(14, 2, 64), key="splits"):
    """The decode kernel at `heads` (query heads, KV heads, head dim: the 0.5B shape's by default; blocks of 16) for
    batch x context cases and split counts, timed by graph_bench over KV-cache copies; with the split the package's
    rule picks. Written under `key`."""
    (H, KVH, D), bs = heads, 16
    rows = res[key] = []
    for B, ctx in cases:
        nblk = ctx // bs
        nbytes = 2 * B * ctx * KVH * D * 2                      # K and V bytes the step reads
        R = copies_for_l2(nbytes)
        caches = [(torch.randn(B * nblk, bs, KVH, D, device=DEVICE, dtype=KDTYPE),
                   torch.randn(B * nblk, bs, KVH, D, device=DEVICE, dtype=KDTYPE)) for _ in range(R)]
        table = torch.randperm(B * nblk, device=DEVICE).view(B, nblk)                      # [B, nblk]
        lens = torch.full((B,), ctx, device=DEVICE, dtype=torch.int64)
        q = torch.randn(B, H, D, device=DEVICE, dtype=KDTYPE)
        rule = choose_num_splits(B, KVH, ctx, tile_n(bs), num_sms(q.device), D)
        row = {"batch": B, "context": ctx, "rule": rule, "us": {}}
        for sp in splits:
            if sp > ctx // tile_n(bs): continue
            row["us"][sp] = min(graph_bench(lambda i: (lambda: decode_attention(q, caches[i][0], caches[i][1], table,
                                                                                   lens, D ** -0.5, ctx, num_splits=sp)),
                                              nbytes))
        row["best"] = min(row["us"], key=row["us"].get)
        print("splits", B, ctx, "rule", row["rule"], {k: round(v, 1) for k, v in row["us"].items()}, flush=True)
        rows.append(row)
        del caches; free()


def main():
    ap = parser(__doc__, parts="profile")
    ap.add_argument("--controls", default="row_gemv",
                    help="comma list of controls run beside the defaults: row_gemv, pdl, rope, argmax, both, norm, "
                         "logits, round7, loads, round7b (each an engine override; see CONTROL_PHRASES)")
    ap.add_argument("--before", default="norm kernel, fp32 logits",
                    help="ab, ab7b: the configuration the defaults are timed against; ab1: a ';' list of them")
    args = ap.parse_args()
    device_or_skip(args)
    smoke = is_smoke(args)
    if smoke and args.parts == "profile": args.parts = "parity,profile,gemv,splits,rate,ab,nanovllm_ab,logits"
    res = {"controls": args.controls, "before": args.before}
    d05, s05 = checkpoint("0.5B", args)
    seven = lambda: checkpoint("7B", args)[0]
    s7 = "tiny" if smoke else "7B"
    named = {"row_gemv": ("row_gemv=False", {"row_gemv": False}), "pdl": ("pdl=False", {"pdl": False}),
             "rope": ("rope_cache", {}), "argmax": ("torch argmax", {}),
             "both": ("rope_cache, torch argmax", {}), "norm": ("norm kernel", {}),
             "logits": ("fp32 logits", {}), "round7": ("norm kernel, fp32 logits", {}),
             "loads": ("loads apart", {}), "round7b": ("norm kernel, fp32 logits, loads apart", {})}
    both = (("defaults", {}),) + tuple(named[c] for c in args.controls.split(","))
    quant = tuple((f"{m} {c}", {**kw, "quantization": m}) for m in ("int8", "int4") for c, kw in both) + (
        ("int8 lm_head", {"quantization": "int8", "quantize_lm_head": True}),   # the LM head quantized too
        ("int4 lm_head", {"quantization": "int4", "quantize_lm_head": True}))
    quant05 = tuple((f"{m} defaults", {"quantization": m}) for m in ("int8", "int4"))
    tiny = dict(steps=2, rate_steps=4) if smoke else {}
    ab_kw = dict(batches=(1, 4), rounds=2, steps=4, prompt_lens=(16, 64)) if smoke else \
        dict(batches=(1, 64), rounds=6, prompt_lens=(128, 2000))
    b3 = [1, 4] if smoke else [1, 8, 64]
    rate_kw = dict(steps=4, prompt_len=16) if smoke else {}
    parts = {"gemv": lambda: gemv_sweep(res, **(dict(shapes=("tiny",), budget_s=0.0, pdl=False) if smoke else {})),
             "splits": lambda: split_sweep(res, RUN["split_cases"], RUN["splits"]),
             "splitsq3": lambda: split_sweep(res, RUN["split_cases_q3"], RUN["splits"], heads=(16, 8, 128),
                                             key="splits_qwen3"),
             "gemv05": lambda: gemv_sweep(res, shapes=("0.5B",), budget_s=120.0),
             "gemvfam": lambda: gemv_sweep(res, shapes=("qwen3-0.6B",), budget_s=120.0),
             "gemvfam2": lambda: gemv_sweep(res, shapes=("qwen3-1.7B", "llama3.2-1B", "llama3.1-8B"), budget_s=150.0),
             "profileq3": lambda: profile(checkpoint("qwen3-0.6B", args)[0], res, batches=(1,), **tiny),
             "profile256q3": lambda: [profile_long(checkpoint("qwen3-0.6B", args)[0], res, **(
                 dict(batch=b, prompt_len=32, steps=2, rate_steps=4) if smoke else dict(batch=b, prompt_len=600)))
                 for b in ((4,) if smoke else (256, 64, 16))],
             "ab": lambda: interleaved(d05, res, s05, **ab_kw, before=args.before.split(";")[0]),
             "ab1": lambda: [interleaved(d05, res, s05, batches=(1,), rounds=10, before=b)
                             for b in args.before.split(";")],
             "ab1long": lambda: [interleaved(d05, res, s05, batches=(1,), rounds=20, before=b)
                                 for b in args.before.split(";")],
             "ab7b": lambda: interleaved(seven(), res, s7, rounds=3, before=args.before.split(";")[0]),
             "profile": lambda: profile(d05, res, **({"batches": (1, 4)} if smoke else {}), **tiny, configs=both),
             "parity": lambda: parity(d05, res),
             "rate": lambda: rates(d05, res, s05, b3, both, **rate_kw),
             "rate1": lambda: rates(d05, res, s05, [1], both, **rate_kw),
             "rate1b": lambda: rates(d05, res, s05, b3, both, key="rate_after", **rate_kw),   # after a sweep
             "rate7bb": lambda: rates(seven(), res, s7, [1], both, key="rate_after", **rate_kw),
             "rate256": lambda: rates(d05, res, s05, [1, 8, 64, 256], both, **rate_kw),
             "profile1": lambda: profile(d05, res, **tiny),
             "profile256": lambda: profile_long(d05, res, **(dict(batch=4, prompt_len=32, steps=2, rate_steps=4)
                                                              if smoke else {})),
             "profileb1": lambda: profile(d05, res, batches=(1,), configs=both, **tiny),
             "nanovllm": lambda: nanovllm(d05, res, 1 if smoke else 3, smoke, RUN["dtype"]),
             "nanovllm_ab": lambda: nanovllm_ab(d05, res, rounds=2 if smoke else 6),
             "logits": lambda: logits_micro(res, **({"reps": 2} if smoke else {})),
             "nanovllm_ab2": lambda: (nanovllm_ab(d05, res, rounds=4, before="fp32 logits", before_first=True,
                                                  key="nanovllm_ab_logits"),
                                      nanovllm_ab(d05, res, rounds=4, before="norm kernel", key="nanovllm_ab_norm")),
             "rate7b": lambda: rates(seven(), res, s7, [1], both, **rate_kw),
             "rate7bq": lambda: rates(seven(), res, s7, [1], quant, **rate_kw),
             "gemvpdl": lambda: gemv_pdl(res), "qrow": lambda: quant_one_row(res),
             "rate05q": lambda: rates(d05, res, s05, [1], (("defaults", {}),) + quant05, **rate_kw),
             "profile7bq": lambda: profile(seven(), res, batches=(1,), **tiny, configs=(
                 ("bf16", {}), ("int4", {"quantization": "int4"}),
                 ("int4 lm_head", {"quantization": "int4", "quantize_lm_head": True})))}
    run_parts(parts, args.parts, saver("diet_h200.json", res, args), res.setdefault("part_seconds", {}))


if __name__ == "__main__":
    main()
