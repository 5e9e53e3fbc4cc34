"""Speculative decoding on the H200: exactness through the graphs, the verify step's cost, the batch-1 speed-up.

Parts (`--parts`, in this order):
- check: the shipped trained tiny model in fp32, CUDA graphs on: greedy and seeded tokens with prompt lookup and
  with the shipped draft model equal those of the default engine (async scheduling, no speculation), on
  repetitive and plain prompts.
- verify: random weights of each `--shapes` shape in bf16, batch 1 in steady decode from 128-token prompts, one
  engine with speculation, synchronous: ms a step of a plain decode step and of a verify step of 1 + k tokens (k of
  `--verify-k`, made-up drafts: a verify step costs the same whether its drafts hold or not), in interleaved passes;
  beside them the default engine's decode step (async scheduling, no speculation) in the same process. Issue 30's
  bar: verify <= 1.15x.
- tiny: the trained tiny model at batch 1, the two workloads of `kernels/speculative_cpu.py` (held-out code, and
  the same prompts followed by their own first tokens: an edit), each request alone: output tokens a second with
  prompt lookup (k 8, the default, and k 4) and with the shipped draft model against the default engine,
  interleaved rounds, the prefix cache emptied before each timed run; the tokens a step that verify steps emitted.
- policy: random weights, random prompts, batch 64 (no drafting by policy) and batch 1 (the back-off where the
  lookup finds nothing): ms a step of the default engine and of one with prompt lookup, interleaved.
- profile: where a verify step's time goes against a decode step's, random weights of each shape in bf16 at batch 1:
  device kernels by name over 16 steps of each (the synchronous engine of `verify`), and the wall time of both.

    NANOSERVE_GIT_SHA=$(git rev-parse HEAD) PYTHONPATH=. python kernels/speculative_h200.py --out $OUT
"""
import sys; from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))      # the only sys.path use in the lab
from lab import (LLM, SamplingParams, checkpoint, device_or_skip, drain, free, is_smoke, kernel_table, median, parser,
                 profile_run, run_parts, saver, steady_decode, step_ms, sync, tiny_model, warm)

import time

from nanoserve.speculative import SpeculativeConfig
from nanoserve.tokenizer import default_model
from nanoserve.train import heldout_rows

NAME = "speculative_h200.json"


def spec_step(llm, drafts: list[int] | None) -> None:
    "One synchronous step of `llm` in which every running sequence verifies `drafts` (None: a plain decode step)."
    step = llm.scheduler.schedule({s.seq_id: drafts for s in llm.scheduler.running} if drafts else None)
    draws, _, _ = llm._run(step, None)
    llm.scheduler.update(step, *llm._verified(step, draws))


def pass_ms(llm, drafts, steps: int) -> float:
    "ms a step over `steps` steps of `spec_step`."
    sync(llm.device)
    t0 = time.perf_counter()
    for _ in range(steps): spec_step(llm, drafts)
    sync(llm.device)
    return (time.perf_counter() - t0) / steps * 1e3


def verify_rows(res, shapes, args) -> None:
    smoke, rows = is_smoke(args), res.setdefault("verify", [])
    steps, rounds = (4, 1) if smoke else (100, 3)
    for shape, k in [(s, int(k)) for s in shapes.split(",") for k in args.verify_k.split(",")]:
        model_dir, name = checkpoint(shape, args)
        kw = dict(dtype="float32" if smoke else "bfloat16", max_num_seqs=8, max_num_batched_tokens=256,
                  max_model_len=2048, num_kv_blocks=2048)         # two engines in one process
        spec = LLM(model_dir, speculative=SpeculativeConfig(num_speculative_tokens=k), async_scheduling=False, **kw)
        plain = LLM(model_dir, **kw)
        for llm in (spec, plain): steady_decode(llm, 1)
        warm(spec.device, 0 if smoke else 2.0)
        got = {"decode": [], "verify": [], "default engine": []}
        for _ in range(rounds):        # interleaved passes, each engine kept in steady decode
            got["decode"].append(pass_ms(spec, None, steps))
            got["verify"].append(pass_ms(spec, list(range(3, 3 + k)), steps))
            got["default engine"].append(step_ms(plain, steps))
        row = {"shape": name, "k": k, "steps_a_pass": steps, **{f"{n}_ms": v for n, v in got.items()},
               "verify_over_decode": median(got["verify"]) / median(got["decode"]),
               "verify_over_default": median(got["verify"]) / median(got["default engine"]),
               "mixed_replays": spec.runner.mixed_graphs.num_replays if spec.runner.mixed_graphs else 0}
        rows.append(row)
        print(f"{name}: decode {median(got['decode']):.3f} ms, verify 1+{k} {median(got['verify']):.3f} ms "
              f"({row['verify_over_decode']:.2f}x), default engine {median(got['default engine']):.3f} ms", flush=True)
        for llm in (spec, plain): drain(llm)
        del spec, plain; free()


def profile_rows(res, shapes, args, k: int = 4, steps: int = 16) -> None:
    "Device kernels by name over `steps` decode steps and `steps` verify steps of 1 + k, at batch 1 (see the parts)."
    smoke, rows = is_smoke(args), res.setdefault("profile", [])
    for shape in shapes.split(","):
        model_dir, name = checkpoint(shape, args)
        spec = LLM(model_dir, speculative=SpeculativeConfig(num_speculative_tokens=k), async_scheduling=False,
                   dtype="float32" if smoke else "bfloat16", max_num_seqs=8, max_num_batched_tokens=256,
                   max_model_len=2048, num_kv_blocks=2048)
        steady_decode(spec, 1)
        warm(spec.device, 0 if smoke else 2.0)
        row = {"shape": name, "k": k, "steps": steps}
        for what, drafts in (("decode", None), ("verify", list(range(3, 3 + k)))):
            pass_ms(spec, drafts, 4)                                     # the same path, warm
            with profile_run(spec.device) as run: ms = pass_ms(spec, drafts, steps)
            row[what] = {"ms_a_step": ms, **kernel_table(run, calls=steps, top=40)}
        rows.append(row)
        print(f"{name}: decode {row['decode']['ms_a_step']:.3f} ms, {row['decode']['kernels']:.0f} kernels, "
              f"{row['decode']['total_us']:.0f} us of kernels; verify {row['verify']['ms_a_step']:.3f} ms, "
              f"{row['verify']['kernels']:.0f} kernels, {row['verify']['total_us']:.0f} us", flush=True)
        drain(spec)
        del spec; free()


def policy_rows(res, shapes, args) -> None:
    """The policy's cost where speculation should not run or not pay: random weights of each shape in bf16, random
    prompts in steady decode, at batch 64 (more than `max_num_seqs`: no drafting, every step async) and batch 1
    (drafting allowed; on text the lookup cannot predict the engine backs off): ms a step of the default engine
    and of one with prompt lookup, interleaved passes. Issue 30's bar: no slowdown at batch 64."""
    smoke, rows = is_smoke(args), res.setdefault("policy", [])
    steps, rounds = (2, 1) if smoke else (100, 3)
    for shape in shapes.split(","):
        model_dir, name = checkpoint(shape, args)
        for batch in ((4, 1) if smoke else (64, 1)):                # smoke: 4 rows over a policy of 2
            kw = dict(dtype="float32" if smoke else "bfloat16", max_num_seqs=max(batch, 8), max_model_len=2048,
                      num_kv_blocks=4096 if not smoke else 512)                      # two engines in one process
            lookup = SpeculativeConfig(max_num_seqs=2) if smoke else SpeculativeConfig()
            engines = {"default": LLM(model_dir, **kw), "prompt lookup": LLM(model_dir, speculative=lookup, **kw)}
            for llm in engines.values(): steady_decode(llm, batch, prompt_len=16 if smoke else 128)
            warm(engines["default"].device, 0 if smoke else 2.0)
            got = {e: [] for e in engines}
            for r in range(rounds):
                for e in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                    got[e].append(step_ms(engines[e], steps))
            spec = engines["prompt lookup"]
            row = {"shape": name, "batch": batch, "steps_a_pass": steps, **{f"{e}_ms": v for e, v in got.items()},
                   "lookup_over_default": median(got["prompt lookup"]) / median(got["default"]),
                   "drafted": spec.num_draft_tokens, "accepted": spec.num_accepted_tokens}
            rows.append(row)
            print(f"{name} batch {batch}: default {median(got['default']):.3f} ms, prompt lookup "
                  f"{median(got['prompt lookup']):.3f} ms ({row['lookup_over_default']:.2f}x), drafted "
                  f"{row['drafted']}, kept {row['accepted']}", flush=True)
            for llm in engines.values(): drain(llm)
            del engines, spec; free()


def workloads(smoke: bool) -> dict:
    "The two workloads of kernels/speculative_cpu.py, as token-id prompts."
    num_rows, prompt_len = (2, 32) if smoke else (16, 128)
    rows = heldout_rows(default_model() / "tokenizer.json", num_rows=num_rows, seq_len=2 * prompt_len)
    code = [r[:prompt_len].tolist() for r in rows]
    return {"code": code, "edit": [p + p[:3 * prompt_len // 16] for p in code]}


def one_at_a_time(llm, prompts, params) -> tuple[float, list]:
    "(seconds, outputs) of `prompts` generated one request at a time, the prefix cache emptied first."
    llm.reset_prefix_cache()
    sync(llm.device)
    t0 = time.perf_counter()
    outs = [llm.generate([p], params)[0] for p in prompts]
    sync(llm.device)
    return time.perf_counter() - t0, outs


SPECULATIVE = {"prompt lookup": SpeculativeConfig(), "prompt lookup, k 4": SpeculativeConfig(num_speculative_tokens=4),
               "draft model": SpeculativeConfig("draft")}   # the defaults: k 8 for the lookup, 4 for the draft


def tiny_rows(res, args) -> None:
    smoke = is_smoke(args)
    max_tokens, rounds = (16, 1) if smoke else (128, 2)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    kw = dict(num_kv_blocks=2048)                                        # engines in one process
    engines = {"default": LLM(default_model(), **kw)} | {n: LLM(default_model(), speculative=spec, **kw)
                                                          for n, spec in SPECULATIVE.items()}
    out = res.setdefault("tiny", {})
    for name, prompts in workloads(smoke).items():
        for llm in engines.values(): one_at_a_time(llm, prompts[:2], params)           # warm: graphs, caches
        secs, tokens, counts = {e: [] for e in engines}, {}, {}
        for r in range(rounds):
            for e in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                llm = engines[e]
                before = (llm.num_draft_tokens, llm.num_accepted_tokens)
                s, outs = one_at_a_time(llm, prompts, params)
                secs[e].append(s)
                tokens[e] = [list(o.token_ids) for o in outs]
                counts[e] = (llm.num_draft_tokens - before[0], llm.num_accepted_tokens - before[1],
                             sum(o.num_verify_steps for o in outs))
        n = sum(map(len, tokens["default"]))
        tps = {e: n / median(v) for e, v in secs.items()}
        rows = {e: {"same_tokens": tokens[e] == tokens["default"], "speedup": tps[e] / tps["default"],
                    "drafted_last_run": counts[e][0], "accepted_last_run": counts[e][1],
                    "accepted_a_verify_step_last_run": counts[e][1] / max(counts[e][2], 1)} for e in SPECULATIVE}
        out[name] = {"num_prompts": len(prompts), "max_tokens": max_tokens, "output_tokens": n, "seconds": secs,
                     "tokens_per_s": tps, **rows["prompt lookup"],
                     **{e: rows[e] for e in SPECULATIVE if e != "prompt lookup"}}
        print(f"tiny {name}: default {tps['default']:.0f} tok/s; "
              + "; ".join(f"{e} {tps[e]:.0f} ({rows[e]['speedup']:.2f}x, same tokens {rows[e]['same_tokens']})"
                          for e in SPECULATIVE), flush=True)


def check(res, args) -> None:
    prompts = ["import os\nimport sys\nimport os\n", "def f(x):\n    return x\n\ndef g(x):\n    return", "Hello",
               "for i in range(10):\n    print(i)\nfor i in range(10):\n"]
    model = tiny_model() if is_smoke(args) else default_model()
    plain = LLM(model, dtype="float32", num_kv_blocks=2048)             # engines in one process
    draft = dict(draft_model=str(model)) if is_smoke(args) else {}       # the random model: itself as its draft
    specs = {"prompt lookup": SpeculativeConfig(), "draft model": SpeculativeConfig("draft", **draft)}
    engines = {n: LLM(model, dtype="float32", speculative=spec, num_kv_blocks=2048) for n, spec in specs.items()}
    out = {}
    for name, sp in (("greedy", SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)),
                     ("seeded", SamplingParams(max_tokens=64, temperature=0.8, seed=11, ignore_eos=True))):
        a = [o.token_ids for o in plain.generate(prompts, sp)]
        same = {n: [o.token_ids for o in llm.generate(prompts, sp)] == a for n, llm in engines.items()}
        out[name] = {"tokens": sum(map(len, a)), "same_tokens": same["prompt lookup"],
                     "same_tokens_draft_model": same["draft model"]}
    lookup, drafter = engines["prompt lookup"], engines["draft model"]
    out.update(drafted=lookup.num_draft_tokens, accepted=lookup.num_accepted_tokens,
               draft_model_drafted=drafter.num_draft_tokens, draft_model_accepted=drafter.num_accepted_tokens,
               async_default=plain.async_scheduling,
               graphs=all(llm.runner.graphs is not None for llm in engines.values()))
    res["check"] = out
    print("check:", out, flush=True)


def main():
    ap = parser(__doc__, parts="check,verify,tiny,policy,profile")
    ap.add_argument("--name", default=NAME)
    ap.add_argument("--shapes", default="0.5B,7B")
    ap.add_argument("--verify-k", default="4,8", help="verify: the drafts a verify step carries, comma-separated")
    args = ap.parse_args()
    device_or_skip(args)
    res = {"what": "speculative decoding with prompt lookup and a draft model: exactness, the verify step's cost, "
                   "batch-1 speed"}
    parts = {"check": lambda: check(res, args), "verify": lambda: verify_rows(res, args.shapes, args),
             "tiny": lambda: tiny_rows(res, args), "policy": lambda: policy_rows(res, args.shapes, args),
             "profile": lambda: profile_rows(res, args.shapes, args)}
    run_parts(parts, args.parts, saver(args.name, res, args))


if __name__ == "__main__":
    main()
