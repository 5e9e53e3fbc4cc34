"""The CUDA-graphs chapter's checks that need the engine (a later chapter): the static-buffer path through `LLM`,
the runner's bucket choice, and a mixed step packed by the runner. On a CPU they run the buffers without capture."""
import pytest
import torch

from nanoserve.engine import LLM, SamplingParams
from nanoserve.graphs import DecodeGraphs, MixedGraphs, graph_batch_sizes, graph_token_sizes
from nanoserve.runner import eager_inputs
from nanoserve.scheduler import ScheduledSeq, Step
from nanoserve.tokenizer import ensure_default_model

TINY = ensure_default_model()     # the random tiny model (2 layers of 64): the checks run through Triton's interpreter


def run_engine(static_buffers: bool, num_kv_blocks=7):
    llm = LLM(TINY, dtype="float32", attention_backend="triton", enforce_eager=True, num_kv_blocks=num_kv_blocks,
              max_num_seqs=6, max_num_batched_tokens=64)
    if static_buffers: llm.runner.enable_graphs(graph_batch_sizes(6), llm.max_model_len, capture=False)
    rng = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, llm.config.vocab_size, (int(n),), generator=rng).tolist()
               for n in torch.randint(1, 40, (10,), generator=rng)]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
                                  for m in (5, 17, 9, 30, 2, 12, 25, 7, 19, 3)])
    preempted = sum(o.num_preemptions for o in outs)
    return [o.token_ids for o in outs], preempted, llm.runner.graphs.num_replays if static_buffers else 0


def run_engine_mixed(num_kv_blocks=7):
    llm = LLM(TINY, dtype="float32", attention_backend="triton", enforce_eager=True, num_kv_blocks=num_kv_blocks,
              max_num_seqs=6, max_num_batched_tokens=64)
    llm.runner.enable_graphs(graph_batch_sizes(6), llm.max_model_len, capture=False, token_sizes=graph_token_sizes(64))
    rng = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, llm.config.vocab_size, (int(n),), generator=rng).tolist()
               for n in torch.randint(1, 40, (10,), generator=rng)]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
                                  for m in (5, 17, 9, 30, 2, 12, 25, 7, 19, 3)])
    return [o.token_ids for o in outs], llm.runner.graphs.num_replays, llm.runner.mixed_graphs.num_replays


@pytest.fixture(scope="module")
def eager_tokens():
    "The eager engine's tokens on the workload both engine tests share (a cache small enough to preempt)."
    tokens, _, _ = run_engine(False)
    return tokens


def test_whole_engine_with_and_without_static_buffers(eager_tokens):
    "Greedy fp32 generation over prompts of many lengths, with preemptions: the buckets give the eager tokens."
    graph_tokens, graph_preempted, replays = run_engine(True)
    assert graph_tokens == eager_tokens
    assert graph_preempted > 0 and replays > 20


def test_whole_engine_with_both_kinds_of_replay(eager_tokens):
    "The same workload with decode and mixed steps replayed from static buffers gives the eager tokens."
    mixed_tokens, decode_replays, mixed_replays = run_engine_mixed()
    assert mixed_tokens == eager_tokens
    assert decode_replays > 20 and mixed_replays > 5


def test_only_decode_only_steps_in_a_bucket_replay():
    "A step with a prefill chunk, and one larger than the largest bucket, run eagerly (`graph_bucket` says None)."
    dec = lambda i: ScheduledSeq(i, [1], 5, [0], [5], sample=True, is_decode=True)
    pre = ScheduledSeq(9, [1, 2], 0, [1], [16, 17], sample=True)
    llm = LLM(TINY, dtype="float32", attention_backend="triton", enforce_eager=True, num_kv_blocks=64, max_num_seqs=4)
    llm.runner.enable_graphs(graph_batch_sizes(4), llm.max_model_len, capture=False)
    assert llm.runner.graph_bucket(Step(0, [dec(0), dec(1), dec(2)])) == (4, 1)     # bucket, longest block table
    assert llm.runner.graph_bucket(Step(0, [dec(0), pre])) is None
    assert llm.runner.graph_bucket(Step(0, [dec(i) for i in range(5)])) is None


def test_mixed_step_packed_by_the_runner_matches_the_eager_step():
    """Two decodes and two prefill chunks (one not sampled) in the 32-token bucket: the sampled rows' logits and
    the cache writes equal the eager step's, packed by the engine's runner."""
    llm = LLM(TINY, dtype="float32", attention_backend="triton", enforce_eager=True, num_kv_blocks=64, max_num_seqs=8,
              max_num_batched_tokens=64)
    runner = llm.runner
    mixed = MixedGraphs(llm.model, runner.kv_caches, graph_token_sizes(64), 8, llm.max_model_len, llm.block_size,
                        llm.device, capture=False)
    g = torch.Generator().manual_seed(1)
    runner.kv_cache.normal_(generator=g)
    cache_before = runner.kv_cache.clone()
    def seq(i, n, start, table, sample, decode=False):
        slots = [table[p // 16] * 16 + p % 16 for p in range(start, start + n)]
        return ScheduledSeq(i, torch.randint(0, 100, (n,), generator=g).tolist(), start, table, slots, sample, decode)
    step = Step(0, [seq(0, 1, 4, [1], True, True), seq(1, 1, 16, [2, 3], True, True), seq(2, 9, 0, [4], True),
                    seq(3, 6, 20, [5, 6], False)])
    with torch.inference_mode():
        x = runner.pack(step, [(0.0, 1.0, 0, 0, 0)] * 3)      # the engine's eager packing of the same step
        ids, pos, meta, rows = eager_inputs(x, torch.tensor(x.ints))
        eager = llm.model.compute_logits(llm.model(ids, pos, runner.kv_caches, meta)[rows])
        cache_eager = runner.kv_cache.clone()
        runner.kv_cache.copy_(cache_before)
        T = mixed.bucket(step.num_tokens, 2)
        replayed = mixed.run(torch.tensor(mixed.pack(step, T, 2)), T, len(step.seqs), 2)[:3]
    assert T == 32
    assert torch.allclose(replayed, eager, atol=1e-5), (replayed - eager).abs().max()
    assert torch.allclose(runner.kv_cache, cache_eager, atol=1e-5)
    written = lambda cache: (cache != cache_before).flatten(3).any(-1).nonzero()[:, 2].unique().tolist()   # blocks
    assert written(runner.kv_cache) == written(cache_eager)                 # padding tokens wrote nothing


def test_graphs_refuse_the_torch_backend_and_bad_sizes_in_an_engine():
    "The torch attention backend cannot replay mixed steps; buckets out of order and a CPU capture are refused."
    llm = LLM(TINY, dtype="float32", attention_backend="triton", enforce_eager=True, num_kv_blocks=64, max_num_seqs=8)
    torch_llm = LLM(TINY, dtype="float32", enforce_eager=True, num_kv_blocks=16, max_num_seqs=2)
    with pytest.raises(ValueError, match="Triton attention"):
        MixedGraphs(torch_llm.model, torch_llm.runner.kv_caches, [16], 2, 64, 16, torch_llm.device, capture=False)
    with pytest.raises(ValueError, match="increasing"):
        MixedGraphs(llm.model, llm.runner.kv_caches, [32, 16], 2, 64, 16, llm.device, capture=False)
    with pytest.raises(ValueError, match="increasing"):
        DecodeGraphs(llm.model, llm.runner.kv_caches, [1, 1, 2], 64, 16, llm.device, capture=False)
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs(llm.model, llm.runner.kv_caches, [1, 2], 64, 16, llm.device)


@pytest.mark.parametrize("override", [dict(fp32_logits=True), dict(load_step_kernel=False)])
def test_graph_controls_are_engine_overrides(override):
    """The H200 scripts' controls (an fp32 logits buffer; the loads as two copies and a feed) are `LLM` keyword
    overrides that reach the static buffers, and the tokens do not change."""
    base = LLM(TINY, dtype="float32", attention_backend="triton", enforce_eager=True, num_kv_blocks=16, max_num_seqs=2)
    llm = LLM(TINY, dtype="float32", attention_backend="triton", enforce_eager=True, num_kv_blocks=16, max_num_seqs=2,
              **override)
    outs = []
    for engine in (base, llm):
        engine.runner.enable_graphs(graph_batch_sizes(2), engine.max_model_len, capture=False)
        outs.append(engine.generate([3, 4, 5], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids)
    assert outs[0] == outs[1] and llm.runner.graphs.num_replays > 0
    assert llm.runner.graphs.fp32_logits == override.get("fp32_logits", False)
    assert llm.runner.graphs.logits.dtype == torch.float32                   # an fp32 model: fp32 either way
