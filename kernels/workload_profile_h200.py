"""Where nano-vllm's workload spends the GPU's time, over the whole run, against what the workload must read.

    PYTHONPATH=. python kernels/workload_profile_h200.py --out $OUT [--shapes qwen3-0.6B,0.5B]

The benchmark's physical limit says how fast the workload could run (weights each step, every token's K/V reads,
prefill FLOPs); the step profiles of `diet_h200.py` say where one step of one width goes. Neither says where the
run's time goes between them: steps of every width from 256 rows down to one, contexts from 100 to 2,048 tokens,
prefill and mixed steps. This script runs the workload (256 requests, prompt and output uniform in 100..1024, greedy,
EOS ignored) on random weights of each shape, in the tutorials' order:

1. check: the workload's greedy tokens from the timed run and the profiled run are the same (the profiler changes
   nothing it measures);
2. time: one cold run (compiles, captures), then two timed runs with the step ledger (the prefix cache emptied
   before each), >15% apart flagged; the device's copy bandwidth and matmul rate measured here for the limit;
3. profile: one more run under the profiler, device kernels only, the whole run. Each kernel is put in a class
   (decode attention, prefill attention, cuBLAS GEMMs, our GEMVs, norms, SiLU, sampling, other) and each step
   (kernels between two `step_marker_kernel`s, which this script launches at the start of every `LLM.step()`:
   a mixed or eager step launches no `load_step_kernel`) matched with its ledger row (its width in tokens, decode-only or not),
   so every class's time is known by step width, with the device's idle time inside steps (between a step's
   kernels) and between steps. Decode attention's time is set against the K/V bytes the workload
   reads (its bandwidth over the run), the GEMMs' against the weight bytes a step.

Writes workload_profile_h200.json. `--smoke`: the built-in tiny model, 8 short requests, on the CPU (no kernels:
the profile part only checks the bookkeeping).
"""
import sys, time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import (LLM, StepLedger, checkpoint, copy_bandwidth_GBps, device_or_skip, disagree, is_smoke,  # noqa: E402
                 model_config, nanovllm_requests, parser, profile_run, run_parts, saver, sync, warm)

import torch                                                                                         # noqa: E402
import triton                                                                                        # noqa: E402
import triton.language as tl                                                                         # noqa: E402

from nanoserve.measure import (event_record, is_device_kernel, kv_bytes_per_token, matmul_TFLOPs,   # noqa: E402
                               workload_limit)

CLASSES = (("decode_attention", ("decode_attention",)), ("prefill_attention", ("prefill_attention",)),
           ("gemv", ("gemv_kernel",)), ("gemm", ("nvjet", "gemm", "cutlass", "splitkreduce", "sm90_xmma")),
           ("norm", ("rmsnorm",)), ("silu", ("silu",)), ("sampling", ("argmax", "reduce_kernel", "sample", "gumbel")),
           ("rope", ("rope",)))
WIDTHS = ((1, 16), (17, 64), (65, 128), (129, 192), (193, 256), (257, 1 << 20))   # step width classes, tokens


def kernel_class(name: str) -> str:
    "The class of a device kernel by its name (first match in CLASSES), else 'other'."
    low = name.lower()
    return next((c for c, keys in CLASSES if any(k in low for k in keys)), "other")


def width_class(num_tokens: int) -> str:
    return next(f"{a}-{b}" if b < 1 << 20 else f">{a - 1}" for a, b in WIDTHS if a <= num_tokens <= b)


def one_run(llm, reqs, sp, ledger: bool = True):
    "One `generate` of the workload from an empty prefix cache: (seconds, tokens generated, token hash, ledger rows)."
    llm.reset_prefix_cache()
    llm.ledger = StepLedger() if ledger else None
    sync(llm.device); t0 = time.perf_counter()
    outs = llm.generate([list(r.prompt_token_ids) for r in reqs], sp)
    sync(llm.device); dt = time.perf_counter() - t0
    rows, llm.ledger = (llm.ledger.rows if llm.ledger else []), None
    toks = [tuple(o.token_ids) for o in outs]
    return dt, sum(map(len, toks)), hash(tuple(toks)), rows


def record_contexts(llm) -> dict[int, int]:
    """Each scheduled step's decode-row context tokens (the K/V positions its decode attention reads) by step id:
    the scheduler's `schedule` wrapped for this run (the dict it returns is filled as steps are scheduled)."""
    sched, seen = llm.scheduler, {}
    schedule = sched.schedule

    def recording(*a, **kw):
        step = schedule(*a, **kw)
        seen[step.step_id] = sum(step.decodes.context_lens()) if step.decodes else 0
        return step
    sched.schedule = recording
    return seen


@triton.jit
def step_marker_kernel(count_ptr):
    tl.store(count_ptr, tl.load(count_ptr) + 1)


def mark_steps(llm) -> None:
    """Launch `step_marker_kernel` at the start of every `LLM.step()` of `llm` (on a GPU): the profile's kernels are
    cut into steps there (`del llm.step` undoes it). Under async scheduling a call's kernels are those of the step it
    launches, queued after the marker."""
    if llm.device.type != "cuda": return
    count, step = torch.zeros(1, dtype=torch.int32, device=llm.device), llm.step
    step_marker_kernel[(1,)](count)                         # compiled now, not inside the profiled run

    def marked():
        step_marker_kernel[(1,)](count)
        return step()
    llm.step = marked


def steps_of(kernels: list[dict], cut: str = "step_marker_kernel") -> list[list[dict]]:
    """Kernels in start order, cut into steps at each `cut` kernel (the marker itself dropped; a call that launched
    nothing, the last one under async scheduling, is an empty step)."""
    steps = []
    for k in kernels:
        if cut in k["name"] or not steps: steps.append([])
        if cut not in k["name"]: steps[-1].append(k)
    return steps


def idle_us(kernels: list[dict]) -> float:
    "Time inside [first start, last end] of `kernels` (in start order) when none of them ran: the bubbles."
    if not kernels: return 0.0
    idle, end = 0.0, kernels[0]["end_us"]
    for k in kernels[1:]:
        idle += max(0.0, k["start_us"] - end)
        end = max(end, k["end_us"])
    return idle


def by_width(steps, rows) -> dict:
    """Per width class: steps, device-busy us per class summed over its steps, the steps' spans (first to last
    kernel) and idle time, and their decode context tokens."""
    out = defaultdict(lambda: {"steps": 0, "span_us": 0.0, "us": defaultdict(float), "decode_only": 0,
                               "kv_tokens": 0})
    for ks, row in zip(steps, rows):
        w = out[width_class(row["num_tokens"])]
        w["steps"] += 1; w["decode_only"] += bool(row["decode_only"]); w["kv_tokens"] += row.get("kv_tokens", 0)
        w["span_us"] += ks[-1]["end_us"] - ks[0]["start_us"] if ks else 0.0
        w["idle_us"] = w.get("idle_us", 0.0) + idle_us(ks)
        for k in ks: w["us"][kernel_class(k["name"])] += k["end_us"] - k["start_us"]
    return {k: {**v, "us": dict(v["us"])} for k, v in sorted(out.items())}


def profile_shape(shape, res, args):
    model_dir, name = checkpoint(shape, args)
    smoke = is_smoke(args)
    llm = LLM(model_dir, dtype="float32" if smoke else "bfloat16", max_num_seqs=256, max_num_batched_tokens=16384,
              **({"num_kv_blocks": 512} if smoke else {}))
    reqs, sp = nanovllm_requests(llm.config.vocab_size, llm.max_model_len, smoke=smoke)
    cold = one_run(llm, reqs, sp, ledger=False)[0]
    timed = []
    for _ in range(2):
        warm(llm.device, 0.0 if smoke else 2.0)
        timed.append(one_run(llm, reqs, sp))
    secs = [t[0] for t in timed]
    n = timed[0][1]
    warm(llm.device, 0.0 if smoke else 2.0)
    llm.reset_prefix_cache()
    llm.ledger = StepLedger()
    contexts = record_contexts(llm)
    mark_steps(llm)
    with profile_run(llm.device, host_ops=smoke) as run:   # device kernels only (a CPU run has none)
        outs = llm.generate([list(r.prompt_token_ids) for r in reqs], sp)
    rows, llm.ledger = llm.ledger.rows, None
    del llm.scheduler.schedule                              # the class's own again
    if "step" in vars(llm): del llm.step
    for row in rows: row["kv_tokens"] = contexts.get(row["step"], 0)
    same = hash(tuple(tuple(o.token_ids) for o in outs)) == timed[0][2] == timed[1][2]
    assert same, "the profiled run's tokens differ from the timed runs'"
    kernels = sorted((event_record(e) for e in run.events if is_device_kernel(e)), key=lambda r: r["start_us"])
    steps = steps_of(kernels)
    totals = defaultdict(float)
    for k in kernels: totals[kernel_class(k["name"])] += k["end_us"] - k["start_us"]
    top = defaultdict(float)
    for k in kernels: top[k["name"][:80]] += k["end_us"] - k["start_us"]
    cfg = model_config(model_dir)
    bw, bw_flag = copy_bandwidth_GBps(1 << 30 if smoke else 4 << 30, llm.device)
    mm, mm_flag = matmul_TFLOPs(512 if smoke else 8192, llm.device)
    limit = workload_limit(cfg, [len(r.prompt_token_ids) for r in reqs], [r.max_tokens for r in reqs], 256, bw, mm)
    row = {"shape": name, "output_tokens": n, "cold_s": cold, "seconds": secs,
           "output_tokens_per_s": [n / s for s in secs], "disagree": disagree(secs[0], secs[1]),
           "profiled_wall_s": run.wall_s, "tokens_same": same, "num_steps": len(rows), "num_step_kernels": len(steps),
           "steps_matched": len(steps) == len(rows), "kernel_us_by_class": dict(totals),
           "device_span_us": kernels[-1]["end_us"] - kernels[0]["start_us"] if kernels else None,
           "idle_in_steps_us": sum(idle_us(ks) for ks in steps) if kernels else None,
           "idle_between_steps_us": sum(max(0.0, b[0]["start_us"] - max(k["end_us"] for k in a))
                                        for a, b in zip(steps, steps[1:]) if a and b) if kernels else None,
           "top_kernels_us": dict(sorted(top.items(), key=lambda kv: -kv[1])[:25]),
           "by_width": by_width(steps, rows) if len(steps) == len(rows) else None,
           "ledger_gpu_s": sum(r.get("gpu", 0.0) for r in rows), "limit": limit,
           "copy_bandwidth_GBps": bw, "matmul_TFLOPs": mm, "rates_disagree": bw_flag or mm_flag}
    att = totals.get("decode_attention", 0.0) / 1e6
    row["decode_attention_TBps"] = limit["kv_bytes"] / att / 1e12 if att else None
    row["decode_attention_vs_kv_limit"] = att / (limit["kv_bytes"] / (bw * 1e9)) if att else None
    kv_token_bytes = kv_bytes_per_token(cfg)
    for w in (row["by_width"] or {}).values():            # each width's decode attention against its K/V bytes
        a = w["us"].get("decode_attention", 0.0)
        w["decode_attention_TBps"] = w["kv_tokens"] * kv_token_bytes / (a * 1e-6) / 1e12 if a else None
    res.setdefault("shapes", {})[name] = row
    print(name, {k: row[k] for k in ("output_tokens_per_s", "disagree", "kernel_us_by_class", "decode_attention_TBps",
                                     "steps_matched")}, flush=True)
    del llm


def main():
    ap = parser(__doc__, parts="profile")
    ap.add_argument("--shapes", default="qwen3-0.6B,0.5B")
    args = ap.parse_args()
    device_or_skip(args)
    res = {"workload": "256 requests, prompt and output uniform 100..1024, greedy, EOS ignored, seed 0"}
    shapes = ["tiny"] if is_smoke(args) else args.shapes.split(",")
    parts = {"profile": lambda: [profile_shape(s, res, args) for s in shapes]}
    run_parts(parts, args.parts, saver("workload_profile_h200.json", res, args), res.setdefault("part_seconds", {}))


if __name__ == "__main__":
    main()
