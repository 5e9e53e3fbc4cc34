"""How many tokens a speculative step emits with prompt lookup and with the trained draft, on the trained tiny model
(CPU, no GPU needed).

The speculative-decoding chapter shows that a verify step emits exactly the tokens plain decoding would, so the
number of verify steps is a function of the plain output alone (`nanoserve.speculative.verify_steps`). This script
decodes held-out standard-library code greedily with the shipped tiny model, then counts the steps prompt lookup
would take, and the drafts those steps verify, for each (k, n range), with k fixed and adaptive
(`SpeculativeConfig.adaptive_k`), on two workloads:

- code: the first 128 tokens of a held-out row, continued for 128 tokens;
- edit: the same 128 tokens followed by their own first 24 again, continued for 128 tokens (an output that repeats
  much of its prompt, as an edit or a rewrite does).

The draft model (`SpeculativeConfig(method="draft")`, the shipped `tiny-qwen2-stdlib-draft`) is run in the engine
itself on the same prompts, k fixed and adaptive: its rows count the drafts it made and the target kept (the tokens
checked against the plain outputs), and the engine's wall time on this CPU beside plain decoding's (batch 16, not a
GPU figure).

Tokens a step = output tokens after the first (which the prefill step gives) over the decode steps they take; plain
decoding is exactly 1. The speed-up at batch 1 is this over the cost of a verify step relative to a decode step
(measured on the H200, not here).

    PYTHONPATH=. python kernels/speculative_cpu.py --out figures/data
"""
import sys; from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))      # the only sys.path use in the lab
from lab import is_smoke, parser, write

import time

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.speculative import SpeculativeConfig, verify_steps
from nanoserve.tokenizer import default_model
from nanoserve.train import heldout_rows

DRAFTS = (2, 4, 8)
NGRAMS = ((1, 3), (2, 4), (3, 5))


def workloads(rows: torch.Tensor, prompt_len: int, repeat: int) -> dict:
    "Prompts (token id lists) of the two workloads."
    code = [r[:prompt_len].tolist() for r in rows]
    return {"code": code, "edit": [p + p[:repeat] for p in code]}


def acceptance(prompts: list, outputs: list, k: int, n_min: int, n_max: int, adaptive_k: bool = False) -> dict:
    """Decode steps with and without prompt lookup over the plain outputs, the tokens each step emits and the drafts
    it verifies (`adaptive_k`: each request's k follows its acceptance)."""
    cfg = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=n_min, prompt_lookup_max=n_max,
                            adaptive_k=adaptive_k)
    drafted = []
    steps = [verify_steps(p + o, len(p), cfg, drafted) for p, o in zip(prompts, outputs)]
    tokens, num_steps = sum(map(sum, steps)), sum(map(len, steps))
    return {"k": k, "n_min": n_min, "n_max": n_max, "adaptive_k": adaptive_k, "tokens": tokens, "steps": num_steps,
            "tokens_per_step": tokens / num_steps, "drafts": sum(drafted), "drafts_per_step": sum(drafted) / num_steps,
            "kept_share": (tokens - num_steps) / max(sum(drafted), 1),
            "per_request": [sum(s) / len(s) for s in steps if s]}


def draft_row(prompts: list, outputs: list, k: int, adaptive_k: bool, max_model_len: int) -> dict:
    "The draft model's drafts and kept tokens in the engine over `prompts` (the plain `outputs` checked)."
    spec = SpeculativeConfig("draft", num_speculative_tokens=k, adaptive_k=adaptive_k, max_num_seqs=len(prompts))
    llm = LLM(max_model_len=max_model_len, max_num_seqs=len(prompts), speculative=spec)
    params = SamplingParams(temperature=0, max_tokens=len(outputs[0]), ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    assert [list(o.token_ids) for o in outs] == outputs, "the draft changed a token"
    tokens = sum(len(o) - 1 for o in outputs)                           # after the prefill's
    steps = tokens - llm.num_accepted_tokens                            # each step: one draw plus the drafts kept
    return {"proposer": "draft", "k": k, "adaptive_k": adaptive_k, "tokens": tokens, "steps": steps,
            "tokens_per_step": tokens / steps, "drafts": llm.num_draft_tokens, "drafts_per_step": llm.num_draft_tokens / steps,
            "kept_share": llm.num_accepted_tokens / max(llm.num_draft_tokens, 1), "engine_seconds": seconds,
            "per_request": [(len(o.token_ids) - 1) / max(len(o.token_ids) - 1 - o.num_accepted_tokens, 1) for o in outs]}


def main():
    args = parser(__doc__, out="figures/data").parse_args()
    smoke = is_smoke(args)
    t0 = time.perf_counter()
    num_rows, prompt_len, max_tokens = (2, 32, 16) if smoke else (16, 128, 128)
    rows = heldout_rows(default_model() / "tokenizer.json", num_rows=num_rows, seq_len=2 * prompt_len)
    llm = LLM(max_model_len=4 * prompt_len)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    results = {}
    for name, prompts in workloads(rows, prompt_len, repeat=3 * prompt_len // 16).items():
        outputs = [list(o.token_ids) for o in llm.generate(prompts, params)]
        assert all(len(o) == max_tokens for o in outputs)
        t1 = time.perf_counter()
        llm.generate(prompts, params)
        plain_s = time.perf_counter() - t1
        results[name] = {"num_prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts],
                         "max_tokens": max_tokens, "plain_engine_seconds": plain_s,
                         "rows": [acceptance(prompts, outputs, k, lo, hi, a) for a in (False, True) for k in DRAFTS
                                  for lo, hi in NGRAMS],
                         "draft_rows": [draft_row(prompts, outputs, k, a, 4 * prompt_len) for a in (False, True)
                                        for k in DRAFTS]}
        for r in results[name]["rows"]:
            print(f"{name} k={r['k']} n={r['n_min']}..{r['n_max']}{' adaptive' if r['adaptive_k'] else ''}: "
                  f"{r['tokens_per_step']:.3f} tokens, {r['drafts_per_step']:.2f} drafts a step "
                  f"({r['kept_share']:.0%} kept)")
        for r in results[name]["draft_rows"]:
            print(f"{name} draft k={r['k']}{' adaptive' if r['adaptive_k'] else ''}: {r['tokens_per_step']:.3f} tokens, "
                  f"{r['drafts_per_step']:.2f} drafts a step ({r['kept_share']:.0%} kept); engine {r['engine_seconds']:.1f} s "
                  f"against plain {plain_s:.1f} s")
    write("speculative_cpu.json", {"model": "tiny-qwen2-stdlib (shipped, fp32), greedy", "draft": "tiny-qwen2-stdlib-draft", "workloads": results,
                                   "cpu_threads": torch.get_num_threads(),
                                   "seconds": time.perf_counter() - t0}, args)


if __name__ == "__main__":
    main()
