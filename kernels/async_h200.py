"""Async scheduling on the H200: the host schedules and packs step N+1 while the GPU runs step N (issue 6's overlap).

Run on the device machine from the repo root:
    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/async_h200.py --out $OUT [--parts parity,decode,7b,offline,nanovllm]
Writes async_h200.json (raw numbers, git sha, GPU, versions, date) to --out after every part; copy it to
figures/data/.

Random weights of the Qwen2.5 shapes, bf16, CUDA graphs (decode and mixed steps) and fused kernels on; side by
side in one run with `async_scheduling=False` as the control:
1. parity: greedy tokens async against sync on a run with arrivals (fp32 must be identical; bf16 reported);
2. decode: ms per `LLM.step()` in steady decode of the 0.5B shape at batch 1, 8, 64, 256 (warm-up before every row,
   timed twice, >15% disagreement flagged), device kernels per step and GPU busy share from one profiled window
   of the same configuration, the step ledger, and the memory floor (copy bandwidth measured in the same run);
3. 7b: the same at batch 1 and 8 for the 7B shape;
4. offline: the benchmark chapter's lognormal workload (128 requests, kernels/bench_h200.sh's settings),
   continuous and static:32, async and sync, each twice, each run in a fresh process;
5. nanovllm: nano-vllm's workload (256 requests, uniform 100..1024 in and out, EOS ignored), async, twice.
Also (by --parts): rate / rate7b, ms per step back to back (one sync per pass) sync against async; kernels, the
device kernels of a steady decode step by name; offline-async, the offline runs of the async engines alone.
In the tutorials' order: check (fp32 greedy tokens async against sync, asserted identical), then time, then write
(after every part, through kernels/lab.py). The 7B weights are `nanoserve.bench.random_checkpoint("7B")`.
`--smoke`: every part but offline-async on the built-in tiny model on the CPU under the Triton interpreter (fp32,
a few steps), written only to a temporary folder.
"""
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import (LLM, OFFLINE_COMMON, OFFLINE_SPEC, SMOKE_COMMON, SMOKE_SPEC, agreeing_prefix, checkpoint,  # noqa: E402
                 decode_rows, device_or_skip, drain, dtype_of, floors, free, greedy_with_arrivals, is_smoke,
                 model_config, nanovllm, offline, parser, run_parts, saver, steady_decode, step_rates, sync, warm)

from nanoserve.measure import event_record, is_device_kernel, profile_run                 # noqa: E402
from nanoserve.model import SHAPES                                                         # noqa: E402

CONFIGS = {"sync": dict(fused_kernels=True, async_scheduling=False),      # name -> LLM keyword overrides
           "async": dict(fused_kernels=True, async_scheduling=True)}


def parity(model_dir, res, smoke=False):
    "Greedy tokens async against sync on a run with arrivals (fp32 asserted identical; bf16 reported)."
    out = {}
    for dtype in ("float32",) if smoke else ("float32", "bfloat16"):
        toks = {}
        for name, flag in (("sync", False), ("async", True)):
            toks[name], _ = greedy_with_arrivals(model_dir, dtype, True, async_scheduling=flag)
        a, b = toks["sync"], toks["async"]
        out[dtype] = {"sequences": len(a), "identical": sum(x == y for x, y in zip(a, b)),
                      "agreeing_prefixes": [agreeing_prefix(x, y) for x, y in zip(a, b)], "lengths": [len(x) for x in a]}
        print("parity", dtype, out[dtype], flush=True)
    assert out["float32"]["identical"] == out["float32"]["sequences"], out["float32"]
    res["greedy_parity"] = out


def step_rate(model_dir, res, shape, batches, num_steps=200, dtype="bfloat16", smoke=False):
    "Steps per second, sync against async (lab.step_rates), into res['step_rate']."
    step_rates(model_dir, res, shape, batches, list(CONFIGS.items()), "step_rate", num_steps, warm_s=1.5,
               dtype=dtype, prompt_len=16 if smoke else 128)


def kernel_names(model_dir, res, batches=(1, 64), steps=16, dtype="bfloat16", smoke=False):
    "Device kernels of steady decode steps (async, graphs, fused) grouped by name: which ones a step is made of."
    llm = LLM(model_dir, dtype=dtype, num_kv_blocks=512 if smoke else 16384, max_num_seqs=max(batches),
              **CONFIGS["async"])
    out = {}
    for b in batches:
        steady_decode(llm, b, 16 if smoke else 128)
        warm(llm.device, 1.0)
        for _ in range(2 if smoke else 20): llm.step()
        with profile_run(llm.device) as run:
            for _ in range(steps): llm.step()
            sync(llm.device)
        names = Counter(event_record(e)["name"][:90] for e in run.events if is_device_kernel(e))
        out[b] = {"kernels_per_step": sum(names.values()) / steps,
                  "by_name": {k: v / steps for k, v in names.most_common()}}
        print("kernels", b, out[b]["kernels_per_step"], list(out[b]["by_name"].items())[:14], flush=True)
    drain(llm)
    res["kernel_names"] = out
    del llm; free()


def main():
    parts_default = "parity,decode,7b,offline,nanovllm"
    args = parser(__doc__, parts=parts_default).parse_args()
    device_or_skip(args)
    smoke, dtype = is_smoke(args), dtype_of(args)
    if smoke and args.parts == parts_default: args.parts = parts_default + ",rate,kernels,rate7b"
    res = {}
    d05, s05 = checkpoint("0.5B", args)
    row_kw = dict(dtype=dtype, **(dict(profiled_steps=2, ledger_steps=2, prompt_len=16) if smoke else {}))
    common, spec, reps = (SMOKE_COMMON, SMOKE_SPEC, 1) if smoke else (OFFLINE_COMMON, OFFLINE_SPEC, 2)
    async_offline = [("continuous, async", "continuous", {"async_scheduling": True}),
                     ("static:32, async", "static:32", {"async_scheduling": True})]
    sync_offline = [("continuous, sync", "continuous", {"async_scheduling": False}),
                    ("static:32, sync", "static:32", {"async_scheduling": False})]
    every = async_offline + sync_offline
    with_res = lambda folder_shape: (folder_shape[0], res, folder_shape[1])      # (model folder, res, shape)
    rate_kw = dict(num_steps=4, dtype=dtype, smoke=True) if smoke else {}
    parts = {
        "parity": lambda: parity(d05, res, smoke),
        "decode": lambda: decode_rows(d05, res, s05, CONFIGS, [1, 4] if smoke else [1, 8, 64, 256], "decode",
                                      3 if smoke else 30, **row_kw),
        "7b": lambda: decode_rows(*with_res(checkpoint("7B", args)), CONFIGS, [1] if smoke else [1, 8], "decode",
                                  3 if smoke else 20, **row_kw),
        "offline": lambda: offline(d05, res, every[::2] if smoke else every, reps, common, spec),
        "offline-async": lambda: offline(d05, res, async_offline, reps, common, spec),
        "nanovllm": lambda: nanovllm(d05, res, 1 if smoke else 3, smoke, dtype),      # the defaults: async
        "rate": lambda: step_rate(d05, res, s05, [1, 4] if smoke else [1, 8, 64, 256], **rate_kw),
        "kernels": lambda: kernel_names(d05, res, (1, 4) if smoke else (1, 64), 2 if smoke else 16, dtype, smoke),
        "rate7b": lambda: step_rate(*with_res(checkpoint("7B", args)), [1], **rate_kw),
    }
    save = saver("async_h200.json", res, args)
    run_parts(parts, args.parts, save, res.setdefault("part_seconds", {}))
    try: floors(res, {**SHAPES, "tiny": model_config(d05)}, 1 << 20 if smoke else 4 << 30)
    except Exception as e: res["floors_error"] = repr(e)
    save("floors", None)


if __name__ == "__main__":
    main()
