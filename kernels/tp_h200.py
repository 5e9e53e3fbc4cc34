"""Tensor parallelism on two H200s: `tensor_parallel_size` 1 and 2 side by side in one run.

    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/tp_h200.py --out $OUT [--eager]   # on nvidia-h200-x2
Writes tp_h200.json (raw numbers, run metadata, GPUs); copy it to figures/data/.

Random weights of the Qwen2.5-7B shape in bf16 (written once as a safetensors folder, generated on the GPU), CUDA
graphs on (and TP=2 eager as a control with --eager), in the tutorials' order:
1. check: greedy tokens of TP=2 against TP=1 (bf16: agreement reported, random weights make near-ties);
2. time: the decode step at batch 1 and 8: ms per `LLM.step()` (GPU warmed before every row, measured twice, >15%
   apart flagged), and from one profiled window on rank 0 (device kernels only): kernels per step, GPU busy share,
   and the share of the window spent in NCCL kernels (all-reduce and all-gather; it includes waiting for the other
   rank); offline throughput on the lognormal workload (128 requests, prompt median 256, output median 128, EOS
   ignored; numerator: generated tokens), twice per configuration;
3. write tp_h200.json after each configuration.
`--smoke`: the built-in tiny model, TP=2 over gloo on the CPU (two processes), a few short requests; writes only
to a temporary folder.
"""
import json, os, random, shutil, sys, time
from pathlib import Path

for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(k, v)          # never NVLink multicast on the lent machines

sys.path.insert(0, str(Path(__file__).parent))
from lab import (LLM, SamplingParams, device_or_skip, is_smoke, median, parser, steady_decode, sync, time_wall,
                 tiny_model, twice, warm, write)

import torch

from nanoserve.bench import WorkloadSpec, make_workload
from nanoserve.model import SHAPES
from nanoserve.measure import busy_share, count_device_kernels, event_record, is_device_kernel, profile_run


def gpu_random_checkpoint(shape: str, root: Path) -> Path:
    "A safetensors folder with random bf16 weights of `shape`, generated on the GPU (fast), the tiny tokenizer."
    from safetensors.torch import save_file
    from nanoserve.tokenizer import hf_weight_shapes
    d = root / f"random-{shape}"
    if (d / "model.safetensors").is_file(): return d
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "qwen2", **SHAPES[shape], "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
           "dtype": "bfloat16", "rope_theta": 1e6, "use_sliding_window": False}
    (d / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = {n: (torch.ones(s, dtype=torch.bfloat16) if n.endswith("norm.weight") else
                   (torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02).cpu())
               for n, s in hf_weight_shapes(cfg).items()}
    save_file(tensors, str(d / "model.safetensors"), {"format": "pt"})
    for f in tiny_model().iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json": shutil.copy(f, d / f.name)
    return d


def nccl_share(run) -> tuple[float, int]:
    "Share of the profiled window covered by NCCL kernels (their union), and their count."
    iv = sorted((r["start_us"], r["end_us"]) for r in map(event_record, run.events)
                if is_device_kernel(r) and "nccl" in r["name"].lower())
    total, cur = 0.0, None
    for s, e in iv:
        if cur is None or s > cur[1]:
            if cur: total += cur[1] - cur[0]
            cur = [s, e]
        else: cur[1] = max(cur[1], e)
    if cur: total += cur[1] - cur[0]
    window = run.window.end_us - run.window.start_us if run.window else 0.0
    return (total / window if window > 0 else 0.0), len(iv)


def greedy_agreement(rows: list[dict]) -> dict | None:
    "TP=2's greedy tokens against TP=1's: identical sequences and each one's agreeing prefix."
    by = {r["config"]: r for r in rows}
    if "tp1" not in by or "tp2" not in by: return None
    a, b = by["tp1"]["greedy_tokens"], by["tp2"]["greedy_tokens"]
    return {"identical_sequences": sum(x == y for x, y in zip(a, b)), "sequences": len(a),
            "agreeing_prefixes": [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
                                  for x, y in zip(a, b)]}


def decode_rows(llm, name: str, smoke: bool) -> list[dict]:
    "The decode step at batch 1 and 8: timed twice, then one profiled window on rank 0."
    rows, steps = [], 2 if smoke else 16
    for b in (1, 8):
        steady_decode(llm, b, prompt_len=16 if smoke else 128)
        warm(llm.device, 0 if smoke else 2.0)
        t1, t2, flag = twice(lambda: median(time_wall(llm.step, 3 if smoke else 30, warmup=1 if smoke else 5,
                                                      device=llm.device)) * 1e3)
        with profile_run(llm.device) as run:
            for _ in range(steps): llm.step()
        share, n_nccl = nccl_share(run)
        d = {"batch": b, "ms_per_step": [t1, t2], "median_ms": median([t1, t2]), "disagree": flag,
             "kernels_per_step": count_device_kernels(run.events) / steps, "nccl_kernels_per_step": n_nccl / steps,
             "gpu_busy": busy_share(run) if llm.device.type == "cuda" else None, "nccl_share": share,
             "profiled_ms_per_step": run.wall_s / steps * 1e3}
        print(name, d, flush=True)
        rows.append(d)
    for i in list(llm._requests): llm.abort_request(i)
    return rows


def offline(llm, name: str, smoke: bool) -> dict:
    "The lognormal workload, offline, twice (generated tokens a second)."
    spec = WorkloadSpec(kind="lognormal", num_requests=4 if smoke else 128, prompt_median=16 if smoke else 256,
                        output_median=4 if smoke else 128, prompt_max=32 if smoke else 1024,
                        output_max=8 if smoke else 512, seed=0)
    reqs = make_workload(spec, llm.config.vocab_size, 4096)
    sp = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in reqs]
    llm.generate([list(r.prompt_token_ids) for r in reqs[:32]], SamplingParams(max_tokens=2 if smoke else 8,
                                                                               ignore_eos=True))
    runs = []
    for _ in range(2):
        warm(llm.device, 0 if smoke else 2.0)
        sync(llm.device); t1 = time.perf_counter()
        outs = llm.generate([list(r.prompt_token_ids) for r in reqs], sp)
        sync(llm.device); dt = time.perf_counter() - t1
        n = sum(len(o.token_ids) for o in outs)
        runs.append({"seconds": dt, "output_tokens": n, "output_tokens_per_s": n / dt})
        print(name, "offline", runs[-1], flush=True)
    tps = [r["output_tokens_per_s"] for r in runs]
    return {"workload": spec.__dict__, "numerator": "output tokens actually generated (EOS ignored)", "runs": runs,
            "disagree": (max(tps) - min(tps)) > 0.15 * min(tps)}


def measure(model_dir, res, name, tp, enforce_eager=False, with_offline=True, smoke=False):
    "One configuration: start it, its greedy tokens (the check), its decode rows and offline runs, then close."
    t0 = time.perf_counter()
    llm = LLM(model_dir, dtype="float32" if smoke else "bfloat16", tensor_parallel_size=tp,
              enforce_eager=enforce_eager, num_kv_blocks=256 if smoke else 8192, max_num_seqs=32,
              max_num_batched_tokens=2048)
    start_s = time.perf_counter() - t0
    print(name, "started in", round(start_s, 1), "s:", llm, flush=True)
    row = {"config": name, "tensor_parallel_size": tp, "enforce_eager": enforce_eager, "start_s": start_s}
    g = random.Random(5)
    lens = (5, 17) if smoke else (17, 64, 200, 333)
    prompts = [[g.randrange(llm.config.vocab_size) for _ in range(n)] for n in lens]
    greedy = SamplingParams(max_tokens=4 if smoke else 32, temperature=0, ignore_eos=True)
    row["greedy_tokens"] = [o.token_ids for o in llm.generate(prompts, greedy)]
    row["decode"] = decode_rows(llm, name, smoke)
    if with_offline: row["offline"] = offline(llm, name, smoke)
    res["rows"].append(row)           # recorded before shutdown (the first run hung in NCCL's teardown)
    t0 = time.perf_counter()
    llm.close()
    row["close_s"] = time.perf_counter() - t0
    del llm
    if torch.cuda.is_available(): torch.cuda.empty_cache()


def main():
    ap = parser(__doc__)
    ap.add_argument("--cache", default="/tmp/nscache")
    ap.add_argument("--eager", action="store_true", help="also TP=2 with enforce_eager (a control for the graphs)")
    args = ap.parse_args()
    smoke = is_smoke(args)
    device_or_skip(args)
    if not smoke and torch.cuda.device_count() < 2: raise SystemExit("tp_h200.py needs two GPUs (nvidia-h200-x2)")
    res = {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
           "shape": "tiny" if smoke else "7B", "dtype": "float32" if smoke else "bfloat16", "rows": []}
    t0 = time.perf_counter()
    model_dir = tiny_model() if smoke else gpu_random_checkpoint("7B", Path(args.cache))
    res["checkpoint_s"] = time.perf_counter() - t0
    print("checkpoint", model_dir, round(res["checkpoint_s"], 1), "s", flush=True)
    configs = [("tp1", 1, False, True), ("tp2", 2, False, True)] + ([("tp2-eager", 2, True, False)] if args.eager else [])
    failed = []
    for name, tp, eager, with_offline in configs:
        t1 = time.perf_counter()
        try: measure(model_dir, res, name, tp, eager, with_offline, smoke)
        except Exception as e:
            import traceback; traceback.print_exc(); res[f"{name}_error"] = repr(e); failed.append(name)
        print(f"{name}: {time.perf_counter() - t1:.0f} s", flush=True)
        if "greedy_agreement" not in res and (agree := greedy_agreement(res["rows"])):
            res["greedy_agreement"] = agree
            print("greedy agreement", agree, flush=True)
            if smoke: assert agree["identical_sequences"] == agree["sequences"], agree   # fp32: identical
        write("tp_h200.json", res, args)
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(1 if failed else 0)     # no interpreter-exit teardown of NCCL to hold the device call


if __name__ == "__main__":
    main()
