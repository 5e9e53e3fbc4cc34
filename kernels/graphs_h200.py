"""CUDA graphs and the overhead diet on the GPU (issue: CUDA graphs and the overhead diet).

Run on the device machine from the repo root:
    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/graphs_h200.py --out $OUT [--parts parity,decode,7b,nanovllm]
Writes graphs_h200.json (raw numbers, git sha, GPU, versions, date) to --out after every part; copy it to
figures/data/.

With random weights of the Qwen2.5 shapes (`nanoserve.model.SHAPES`), side by side in one run, `enforce_eager` as the control:
1. greedy tokens with graphs on and off (fp32, where they must be identical; bf16, agreement reported), at a
   batch that pads (6 sequences in the 8 bucket) and at batch 1;
2. decode steps of the 0.5B shape in bf16 for each configuration (eager, eager + fused kernels, graphs,
   graphs + fused kernels) at several batch sizes: ms per `LLM.step()` (warm-up before every row, timed twice,
   >15% disagreement flagged), device kernels per step and GPU busy share from one profiled window of the same
   configuration (device kernels only), and the step ledger (where the host time goes);
3. the 7B shape at batch 1 with graphs + fused kernels against eager, and against its memory floor (weight
   bytes + K/V bytes over the copy bandwidth measured in the same run);
4. nano-vllm's workload (256 requests, prompt and output lengths uniform in 100..1024, EOS ignored): output
   tokens/s with graphs and without (numerator: generated tokens).
In the tutorials' order: the check (1) comes first, then the timings (2-4), then the data is written (after every
part, through kernels/lab.py). The 7B weights are `nanoserve.bench.random_checkpoint("7B")`, written once into the
cache. `--smoke`: every part on the built-in tiny model on the CPU under the Triton interpreter (fp32, a few
steps; CPU engines run eagerly, so "graphs" there is the eager path), written only to a temporary folder.
"""
import random, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import (LLM, SamplingParams, agreeing_prefix, checkpoint, decode_rows, device_or_skip, drain, dtype_of,  # noqa: E402
                 floors, free, graph_replays, is_smoke, model_config, nanovllm_requests, parser, run_parts, saver,
                 timed_generate)

from nanoserve.model import SHAPES                                                     # noqa: E402

CONFIGS = {"eager": dict(enforce_eager=True), "eager+fused": dict(enforce_eager=True, fused_kernels=True),
           "graphs": dict(), "graphs+fused": dict(fused_kernels=True)}      # name -> LLM keyword overrides


def greedy_parity(model_dir, res, smoke=False):
    "Graphs on vs off: the same greedy tokens (fp32 must be identical)."
    g = random.Random(3)
    vocab = model_config(model_dir)["vocab_size"]
    prompts = [[g.randrange(vocab) for _ in range(n)] for n in (7, 33, 64, 100, 130, 257)]
    sp = SamplingParams(max_tokens=8 if smoke else 48, temperature=0, ignore_eos=True)
    out = {}
    for dtype in ("float32",) if smoke else ("float32", "bfloat16"):
        toks = {}
        for name, kw in (("eager", dict(enforce_eager=True)), ("graphs", {})):
            llm = LLM(model_dir, dtype=dtype, num_kv_blocks=1024, max_num_seqs=8, **kw)
            toks[name] = {"batch6": [o.token_ids for o in llm.generate(prompts, sp)],
                          "batch1": llm.generate(prompts[0], sp)[0].token_ids}
            if name == "graphs": replays = graph_replays(llm)[0]
            drain(llm); del llm; free()
        same = sum(a == b for a, b in zip(toks["eager"]["batch6"], toks["graphs"]["batch6"]))
        pos = [agreeing_prefix(a, b) for a, b in zip(toks["eager"]["batch6"], toks["graphs"]["batch6"])]
        out[dtype] = {"sequences": len(prompts), "identical_sequences": same, "agreeing_prefixes": pos,
                      "batch1_identical": toks["eager"]["batch1"] == toks["graphs"]["batch1"], "graph_replays": replays}
        print("parity", dtype, out[dtype], flush=True)
        if dtype == "float32":                    # fp32: the graphs replay the eager step's arithmetic exactly
            assert same == len(prompts) and out[dtype]["batch1_identical"], out[dtype]
    res["greedy_parity"] = out


def nanovllm_workload(model_dir, res, repeats=2, smoke=False, dtype="bfloat16"):
    "nano-vllm's workload with graphs + fused kernels, then eager (once), each engine with the default KV sizing."
    rows = []
    for cname in ("graphs+fused", "eager"):
        llm = LLM(model_dir, dtype=dtype, max_num_seqs=256, max_num_batched_tokens=16384,
                  **({"num_kv_blocks": 512} if smoke else {}), **CONFIGS[cname])
        reqs, sp = nanovllm_requests(llm.config.vocab_size, llm.max_model_len, smoke=smoke)
        n, times, outs = timed_generate(llm, reqs, sp, repeats if cname != "eager" else 1, cname,
                                        warm_s=0.0 if smoke else 3.0)
        rows.append({"config": cname, "output_tokens": n, "seconds": times, "output_tokens_per_s": n / min(times),
                     "disagree": len(times) > 1 and abs(times[0] - times[1]) / min(times) > 0.15,
                     "preemptions": sum(o.num_preemptions for o in outs), "num_kv_blocks": llm.num_kv_blocks})
        drain(llm); del llm; free()
    res["nanovllm"] = {"workload": {"num_requests": len(reqs), "prompt_len": "uniform 100..1024",
                                    "output_len": "uniform 100..1024", "ignore_eos": True, "seed": 0,
                                    "max_num_seqs": 256, "max_num_batched_tokens": 16384},
                       "numerator": "output tokens actually generated", "rows": rows}


def main():
    args = parser(__doc__, parts="parity,decode,7b,nanovllm").parse_args()
    device_or_skip(args)
    smoke, dtype = is_smoke(args), dtype_of(args)
    res = {"dtype": dtype}
    d05, s05 = checkpoint("0.5B", args)
    batches, repeats = ((1, 4), 3) if smoke else ((1, 8, 64, 256), 40)

    def seven_b():
        d7, s7 = checkpoint("7B", args)
        decode_rows(d7, res, s7, {c: CONFIGS[c] for c in ("eager", "graphs+fused")}, batches[:1] if smoke else [1, 8],
                    "decode", 3 if smoke else 20, dtype=dtype, **row_kw)

    row_kw = dict(profiled_steps=2, ledger_steps=2, prompt_len=16) if smoke else {}
    parts = {"parity": lambda: greedy_parity(d05, res, smoke),
             "decode": lambda: decode_rows(d05, res, s05, CONFIGS, batches, "decode", repeats, dtype=dtype, **row_kw),
             "7b": seven_b,
             "nanovllm": lambda: nanovllm_workload(d05, res, 1 if smoke else 2, smoke, dtype)}
    save = saver("graphs_h200.json", res, args)
    run_parts(parts, args.parts, save, res.setdefault("part_seconds", {}))
    try: floors(res, {**SHAPES, "tiny": model_config(d05)}, 1 << 20 if smoke else 4 << 30)
    except Exception as e: res["floors_error"] = repr(e)
    save("floors", None)


if __name__ == "__main__":
    main()
