"""The fused-kernels chapter's kernels through the engine (a later chapter): on the built-in tiny model the engine
produces the same greedy tokens with `add_rmsnorm` and `silu_mul` on and off, and a decode step makes fewer
launches with them. Counted on the CPU, through the interpreter: torch operators that do work (views and allocations
excluded, through a `TorchDispatchMode`) plus Triton kernel launches. The chapter counts one forward pass through the
model's kernel table; this counts a whole engine step."""
from collections import Counter

import pytest
import torch
import triton.runtime.interpreter as triton_interpreter
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import torch_threads
from nanoserve.engine import LLM, SamplingParams
from nanoserve.tokenizer import ensure_default_model

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="counts interpreter launches on the CPU")

NO_KERNEL = {"view", "_unsafe_view", "slice", "split", "split_with_sizes", "select", "t", "transpose", "as_strided",
             "expand", "unsqueeze", "squeeze", "reshape", "detach", "alias", "empty", "empty_strided", "permute",
             "chunk", "unbind", "lift_fresh", "_to_copy_meta"}


class CountOps(TorchDispatchMode):
    "Counts torch operators that do device work (views and allocations excluded), outside Triton launches."
    def __init__(self): super().__init__(); self.ops, self.paused = Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in NO_KERNEL and not self.paused: self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def decode_launches(llm) -> tuple[int, int]:
    "(torch operators, Triton kernel launches) in one decode-only step of a 4-sequence batch."
    for p in ["def f(x):", "import os", "hello", "x = 1"]: llm.add_request(p, SamplingParams(max_tokens=4, temperature=0))
    llm.step(); llm.step()                                    # prefill, then a first decode
    launches, real, c = Counter(), triton_interpreter.GridExecutor.__call__, CountOps()

    def counting(self, *a, **k):        # one launch; the interpreter's own torch calls inside it do not count
        launches[self.fn.__name__] += 1
        c.paused += 1
        try: return real(self, *a, **k)
        finally: c.paused -= 1
    triton_interpreter.GridExecutor.__call__ = counting
    try:
        with c: llm.step()
    finally:
        triton_interpreter.GridExecutor.__call__ = real
    while llm.has_unfinished_requests(): llm.step()
    return sum(c.ops.values()), sum(launches.values())


def test_fused_kernels_keep_greedy_tokens_and_cut_launches():
    prompts = ["def fibonacci(n):", "import os\n" * 6, "Hello"]
    greedy = SamplingParams(max_tokens=10, temperature=0)
    with torch_threads(1):
        tiny = ensure_default_model()               # the random tiny model: two layers, fast through the interpreter
        plain = LLM(tiny, max_num_seqs=8, max_num_batched_tokens=64, attention_backend="triton")
        fused = LLM(tiny, max_num_seqs=8, max_num_batched_tokens=64, attention_backend="triton", fused_kernels=True)
        assert [o.token_ids for o in fused.generate(prompts, greedy)] == \
            [o.token_ids for o in plain.generate(prompts, greedy)]
        (p_ops, p_tri), (f_ops, f_tri) = decode_launches(plain), decode_launches(fused)
    print(f"one decode step of the tiny model: plain {p_ops} torch ops + {p_tri} Triton launches = {p_ops + p_tri}; "
          f"fused {f_ops} + {f_tri} = {f_ops + f_tri}")
    assert f_ops + f_tri < p_ops + p_tri
