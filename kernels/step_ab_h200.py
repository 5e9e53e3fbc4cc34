"""A decode step's time with one engine switch on and off, in one process, interleaved (the floor issue's A/Bs).

    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/step_ab_h200.py --out $OUT [--field decode_splits_by_context] \
        [--shapes 0.5B,qwen3-0.6B] [--batches 1,64] [--rounds 4] [--name splits_ab_h200.json]

`--field` is any boolean keyword of `LLM` (a `KernelConfig` or `SchedulerConfig` field); the package's default is
"on" and its opposite the control. For each shape (bf16, random weights drawn on the GPU, the package's defaults
otherwise: CUDA graphs, asynchronous scheduling) two engines, each with its own `--kv-blocks` KV blocks. In the tutorials' order: check (the same
greedy tokens from both engines for the same 8 requests), time (for each batch, each engine in steady decode from
`--prompt-len`-token prompts, the GPU warmed before every row, ms per `LLM.step()` over `--steps` steps, measured
twice and flagged when the two disagree by over 15%; the engines alternate, the order flipping each round), write.
`--smoke`: the tiny model on the CPU, batch 1 and 4, 5 steps, one round.
"""
import gc, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import (LLM, SamplingParams, command, device_or_skip, dtype_of, is_smoke, median, parser,  # noqa: E402
                 random_checkpoint, same_greedy_tokens, steady_decode, step_ms, tiny_model, warm, write)


def one_shape(shape: str, args, device, smoke: bool) -> dict:
    "Both engines of one shape: checked, then timed round by round."
    model_dir, name = (tiny_model(), "tiny") if smoke else (random_checkpoint(shape, device=device.type), shape)
    batches = (1, 4) if smoke else tuple(int(b) for b in args.batches.split(","))
    steps, rounds = (5, 1) if smoke else (args.steps, args.rounds)
    engines = {on: LLM(model_dir, dtype=dtype_of(args), device=device.type, max_num_seqs=max(batches),
                       max_num_batched_tokens=max(4096, args.prompt_len * max(batches)),
                       num_kv_blocks=512 if smoke else args.kv_blocks, **{args.field: on}) for on in (True, False)}
    same = same_greedy_tokens(engines.values())
    assert same or not args.token_check, (shape, "the engines' greedy tokens differ")
    ms = {b: {"on": [], "off": []} for b in batches}
    for r in range(rounds):
        for b in batches:
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                llm = engines[on]
                steady_decode(llm, b, prompt_len=args.prompt_len)
                warm(device, 1.0)
                first, second = step_ms(llm, steps), step_ms(llm, steps)
                key = "on" if on else "off"
                ms[b][key].append({"ms": [first, second], "disagree": abs(first - second) / min(first, second) > 0.15})
                print(name, r, b, key, round(first, 4), round(second, 4), flush=True)
    summary = {}
    for b in batches:
        med = {k: median([x for row in rows for x in row["ms"]]) for k, rows in ms[b].items()}
        summary[b] = {"median_ms": med, "on_over_off": med["on"] / med["off"]}
    print(name, summary, flush=True)
    del engines
    gc.collect()
    return {"shape": name, "tokens_identical": same, "steps": steps, "rounds": rounds, "ms_per_step": ms,
            "summary": summary}


def main():
    ap = parser(__doc__, out="figures/data")
    ap.add_argument("--field", default="decode_splits_by_context")
    ap.add_argument("--shapes", default="0.5B,qwen3-0.6B")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--name", default="step_ab_h200.json")
    ap.add_argument("--kv-blocks", type=int, default=20000, help="KV blocks of each engine")
    ap.add_argument("--no-token-check", dest="token_check", action="store_false",
                    help="record, not require, equal bf16 greedy tokens (a switch that reorders sums, such as the "
                         "GEMV's blocks, rounds differently in bf16; fp32 parity is the families script's)")
    args = ap.parse_args()
    smoke = is_smoke(args)
    device = device_or_skip(args)
    shapes = ["tiny"] if smoke else args.shapes.split(",")
    rows = []
    for shape in shapes:
        rows.append(one_shape(shape, args, device, smoke))
        write(args.name, {"field": args.field, "prompt_len": args.prompt_len, "shapes": rows,
                          "command": command()}, args)
        import torch
        if device.type == "cuda": torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
