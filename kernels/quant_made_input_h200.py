"""The 7B batch-1 step with INT8 and INT4 layers that make their own input, against the same layers with the norm and
SiLU x up as kernels of their own, and against bf16: issue 28's "INT4 >= 2.5x and INT8 >= 1.7x bf16 by default".

    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/quant_made_input_h200.py --out $OUT [--shape 7B]

The profile of the INT4 step (`quant_profile7b_h200.json`) put 57 `add_rmsnorm` and 28 `silu_mul` launches on its
chain, ~110 us of ~2.0 ms, where the bf16 step takes them into its `gemv`. `quant_made_input` now does the same for the
INT8 and INT4 one-row GEMVs (the quantization chapter: the inputs made as they load). Engines, one process, random
bf16 weights of the shape drawn on the GPU: bf16; INT8 and INT4 with it on and off (off is the control), the LM
head in bf16; INT8 and INT4 as the package makes them by default (the head in INT8; INT8's input made, INT4's apart),
and INT8 so with its input made apart. In
the tutorials' order: check (each fused engine's greedy tokens against its control's, recorded: the norm's sum of
squares is added in another order, so a bf16 near-tie may break the other way), time (each engine in steady decode
from `--prompt-len`-token prompts, the GPU warmed before every row, ms per `LLM.step()` over `--steps` steps, twice,
flagged >15% apart; the engines in a rotating order each round), write quant_made_input_h200.json with each engine's
median and the ratios that matter: on/off for INT8 and INT4, bf16 over each. The eight engines of 7B weights need
more than an H100's 80 GB: on a card under 120 GB the default is the four of issue 28's bars (bf16, INT8 and INT4 by
default, INT8's input made apart as its control). `--smoke`: the tiny model on the CPU
(fp32: the pairs paths do not run, the code path only), 4 steps, one round.
"""
import gc, sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from lab import (LLM, device_or_skip, disagree, is_smoke, median, parser, random_checkpoint,  # noqa: E402
                 same_greedy_tokens, steady_decode, step_ms, tiny_model, warm, write)

MADE, APART = {"quant_made_input": True}, {"quant_made_input": False}
NO_HEAD = {"quantize_lm_head": False}                                     # the LM head in bf16 unless named
ENGINES = {"bf16": {}, "int8": {"quantization": "int8", **MADE, **NO_HEAD},
           "int8 apart": {"quantization": "int8", **APART, **NO_HEAD},
           "int4": {"quantization": "int4", **MADE, **NO_HEAD},
           "int4 apart": {"quantization": "int4", **APART, **NO_HEAD},
           "int8 head": {"quantization": "int8", "quantize_lm_head": True, **MADE},
           "int4 head": {"quantization": "int4", "quantize_lm_head": True, **MADE},
           "int8 defaults": {"quantization": "int8"}, "int4 defaults": {"quantization": "int4"},   # the package's:
           "int8 defaults apart": {"quantization": "int8", **APART}}   # an INT8 head; INT8 made, INT4 apart
ALL_ENGINES = "bf16,int8,int8 apart,int4,int4 apart,int8 defaults,int8 defaults apart,int4 defaults"
SMALL_CARD_ENGINES = "bf16,int8 defaults,int8 defaults apart,int4 defaults"   # issue 28's bars and INT8's control


def main():
    ap = parser(__doc__, out="figures/data")
    ap.add_argument("--shape", default="7B")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--engines", default=None, help=f"comma-separated, of {', '.join(ENGINES)} (default: "
                    f"{ALL_ENGINES}; on a card under 120 GB, where those do not fit, {SMALL_CARD_ENGINES})")
    args = ap.parse_args()
    smoke = is_smoke(args)
    device = device_or_skip(args)
    if args.engines is None:
        small = device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory < 120e9
        args.engines = SMALL_CARD_ENGINES if small and not smoke else ALL_ENGINES
        print("engines:", args.engines, flush=True)
    model_dir = tiny_model() if smoke else random_checkpoint(args.shape, device=device.type)
    steps, rounds = (4, 1) if smoke else (args.steps, args.rounds)
    names = args.engines.split(",")
    engines = {n: LLM(model_dir, dtype="float32" if smoke else "bfloat16", device=device.type, max_num_seqs=1,
                      num_kv_blocks=256 if smoke else 2048, show_progress=False,
                      **ENGINES[n], **({"quant_group_size": 16} if smoke and "quantization" in ENGINES[n] else {}))
               for n in names}
    res = {"shape": "tiny" if smoke else args.shape, "engines": {n: ENGINES[n] for n in names}, "steps": steps,
           "rounds": rounds, "prompt_len": args.prompt_len}
    res["tokens_identical"] = {q: same_greedy_tokens([engines[q], engines[f"{q} apart"]])
                               for q in ("int8", "int4") if q in engines and f"{q} apart" in engines}
    ms = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:          # a rotating order
            llm = engines[n]
            steady_decode(llm, 1, prompt_len=args.prompt_len)
            warm(device, 0.0 if smoke else 1.0)
            first, second = step_ms(llm, steps), step_ms(llm, steps)
            ms[n].append({"ms": [first, second], "disagree": disagree(first, second)})
            print(r, n, round(first, 4), round(second, 4), flush=True)
    med = {n: median([x for row in rows for x in row["ms"]]) for n, rows in ms.items()}
    res["ms_per_step"], res["median_ms"] = ms, med
    ratio = lambda a, b: med[a] / med[b] if a in med and b in med else None
    res["ratios"] = {"int8 on/off": ratio("int8", "int8 apart"), "int4 on/off": ratio("int4", "int4 apart"),
                     "int8 defaults on/off": ratio("int8 defaults", "int8 defaults apart"),
                     **{f"bf16/{n}": ratio("bf16", n) for n in names if n != "bf16"}}
    print(res["ratios"], flush=True)
    write("quant_made_input_h200.json", res, args)
    del engines
    gc.collect()


if __name__ == "__main__":
    main()
