"""Tensor parallelism through the engine, on the CPU: two processes over gloo give the tokens of one (greedy and
seeded, fp32), each rank holds half the KV heads, a dead worker is an error, and a size that does not divide the
heads is refused. (Moved here from the tensor-parallelism chapter, which comes before the engine.)"""
import time

import fastcore.test as fc

from nanoserve.engine import LLM, SamplingParams
from nanoserve.tokenizer import default_model


def test_two_processes_give_the_tokens_of_one():
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self", "for i in range("]
    sp = SamplingParams(max_tokens=24, temperature=0)
    one = [o.token_ids for o in LLM(default_model(), dtype="float32").generate(prompts, sp)]
    t0 = time.perf_counter()
    llm2 = LLM(default_model(), dtype="float32", tensor_parallel_size=2)
    start_s = time.perf_counter() - t0
    two = [o.token_ids for o in llm2.generate(prompts, sp)]
    fc.test_eq(two, one)
    # each rank holds half the KV heads: the same memory budget holds twice the blocks
    fc.test_eq(llm2.runner.kv_cache.shape[4], 1)
    print(llm2, f"\nstarted in {start_s:.1f} s;", llm2.tokenizer.decode(two[0]))

    sampled = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7)
    fc.test_eq(llm2.generate(prompts[:2], sampled)[0].token_ids,
            LLM(default_model(), dtype="float32").generate(prompts[:2], sampled)[0].token_ids)
    llm2.parallel.procs[0].kill(); llm2.parallel.procs[0].wait()
    fc.test_fail(lambda: llm2.generate(prompts[0], sp), contains="rank 1 exited")
    llm2.close()
    fc.test_fail(lambda: LLM(default_model(), tensor_parallel_size=3), contains="does not divide num_attention_heads (4)")
