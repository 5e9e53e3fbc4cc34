"CUDA-graph bookkeeping on the CPU: buckets, padding, static buffers (replay itself is checked on the H200)."
import dataclasses
import functools

import pytest
import torch

from nanoserve.attention import paged_attention
from nanoserve.engine import LLM, SamplingParams
from nanoserve.graphs import DecodeGraphs, HeldTables, MixedGraphs, graph_batch_sizes, graph_token_sizes, pick_bucket
from nanoserve.scheduler import Step
from nanoserve.tokenizer import ensure_default_model

TINY = ensure_default_model()      # the random tiny model: 2 layers of 64, fast through the Triton interpreter


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 63, 64, 65, 100, 255, 256, 257, 1000])
def test_buckets_cover_every_batch(n):
    sizes = graph_batch_sizes(n)
    assert sizes == sorted(set(sizes)) and sizes[-1] == n and sizes[0] == 1
    for b in range(1, n + 1):
        got = pick_bucket(b, sizes)
        assert got >= b and got - b <= max(b, 16)            # never more padding than rows (or 16 above 64)
    assert pick_bucket(n + 1, sizes) is None


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_bucket_sizes_reject_bad_input(bad):
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_batch_sizes(bad)


def _tokens(static_buffers: bool, dtype="float32", temperature=0.0, mixed=False, num_kv_blocks=8, **kw):
    llm = LLM(TINY, dtype=dtype, attention_backend="triton", enforce_eager=True, num_kv_blocks=num_kv_blocks,
              max_num_seqs=5, max_num_batched_tokens=48, **kw)
    if static_buffers:
        llm.runner.enable_graphs(graph_batch_sizes(5), llm.max_model_len, capture=False,
                                 token_sizes=graph_token_sizes(48) if mixed else None)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, llm.config.vocab_size, (int(n),), generator=g).tolist() for n in (3, 20, 9, 33, 14, 5, 27)]
    params = [SamplingParams(max_tokens=m, temperature=temperature, seed=i, ignore_eos=True)
              for i, m in enumerate((11, 4, 23, 9, 16, 30, 2))]
    outs = llm.generate(prompts, params)
    if mixed: return [o.token_ids for o in outs], llm.runner.mixed_graphs.num_replays
    return [o.token_ids for o in outs], llm.runner.graphs.num_replays if static_buffers else 0


@functools.lru_cache(maxsize=None)
def _eager_tokens(temperature: float) -> list:
    "The eager path's tokens, computed once per temperature for the tests that compare against them."
    return _tokens(False, temperature=temperature)[0]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_static_buffer_path_gives_the_eager_tokens(temperature):
    eager = _eager_tokens(temperature)
    padded, replays = _tokens(True, temperature=temperature)
    assert padded == eager
    assert replays > 10


def test_mixed_step_buffers_give_the_eager_tokens():
    "Steps with prefill chunks through the token buckets (tiled prefill kernel) give the eager tokens."
    eager = _eager_tokens(0.0)
    mixed, replays = _tokens(True, mixed=True)
    assert mixed == eager
    assert replays >= 3


def test_block_table_width_never_exceeds_the_static_buffer():
    "A 5-block table rounds up to 8 columns; the buffers are 5 wide (5 KV blocks in all), so the copy is clamped."
    outs = []
    for static_buffers in (False, True):
        llm = LLM(TINY, dtype="float32", attention_backend="triton", enforce_eager=True, num_kv_blocks=5,
                  max_num_seqs=2, max_num_batched_tokens=48)
        if static_buffers:
            llm.runner.enable_graphs(graph_batch_sizes(2), llm.max_model_len, capture=False,
                                     token_sizes=graph_token_sizes(48))
        prompt = list(range(3, 73))                                    # 70 tokens + 8 new = 78: 5 blocks of 16
        outs.append(llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids)
    assert outs[0] == outs[1] and llm.runner.graphs.num_replays > 0 and llm.runner.graphs.max_blocks == 5


def test_mixed_graphs_refuse_bad_input():
    llm = LLM(TINY, dtype="float32", enforce_eager=True, num_kv_blocks=16, max_num_seqs=2)
    with pytest.raises(ValueError, match="Triton attention"):
        MixedGraphs(llm.model, llm.runner.kv_caches, [16], 2, 64, 16, llm.device, capture=False)
    llm.model.set_kernels(dataclasses.replace(llm.model.kernels, attention=paged_attention))
    with pytest.raises(ValueError, match="increasing"):
        MixedGraphs(llm.model, llm.runner.kv_caches, [16, 16], 2, 64, 16, llm.device, capture=False)
    with pytest.raises(ValueError, match="CUDA device"):
        MixedGraphs(llm.model, llm.runner.kv_caches, [16], 2, 64, 16, llm.device)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        graph_token_sizes(0)


def test_graphs_refuse_a_cpu_capture_and_bad_sizes():
    llm = LLM(TINY, dtype="float32", enforce_eager=True, num_kv_blocks=16, max_num_seqs=2)
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs(llm.model, llm.runner.kv_caches, [1, 2], 64, 16, llm.device)
    with pytest.raises(ValueError, match="increasing"):
        DecodeGraphs(llm.model, llm.runner.kv_caches, [2, 1], 64, 16, llm.device, capture=False)
    assert llm.runner.graphs is None and not llm.use_cuda_graphs     # no graphs on a CPU


def test_eager_path_unchanged_when_graphs_are_off():
    llm = LLM(TINY, dtype="float32", num_kv_blocks=16, max_num_seqs=2)
    out = llm.generate("hello", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and llm.runner.graphs is None


def test_compile_kernels_runs_every_split_variant():
    "The start-up compile of the decode kernel's variants runs (here through the interpreter) and writes nothing."
    llm = LLM(TINY, dtype="float32", attention_backend="triton", enforce_eager=True, num_kv_blocks=8, max_num_seqs=2)
    llm.runner.kv_cache.normal_()
    before = llm.runner.kv_cache.clone()
    llm.runner.compile_kernels()
    assert torch.equal(llm.runner.kv_cache, before)


def test_one_launch_load_gives_the_eager_tokens(monkeypatch):
    """`load_step` (the step's integers, block tables and feed in one kernel; on by default on a GPU) forced on the
    CPU through the interpreter: the static-buffer path still gives the eager tokens, and it was the path taken."""
    import nanoserve.graphs as graphs
    calls = []
    real_init, real_load_step = DecodeGraphs.__init__, graphs.load_step
    def init(self, *a, **k):
        real_init(self, *a, **k)
        self.load_step_kernel = True
    def counting(*a, **k):
        calls.append(a[5] is not None if len(a) > 5 else k.get("feed") is not None)
        return real_load_step(*a, **k)
    monkeypatch.setattr(DecodeGraphs, "__init__", init)
    monkeypatch.setattr(graphs, "load_step", counting)    # the name the graphs module calls
    eager = _eager_tokens(0.0)
    padded, replays = _tokens(True, async_scheduling=True)   # async: steps take the previous step's samples on device
    assert padded == eager
    assert len(calls) == replays > 10 and any(calls)          # every replay loaded by it, some with a feed


def test_tables_kept_on_the_device_give_the_eager_tokens(monkeypatch):
    """Block tables kept in the static buffer (`HeldTables`, the default) as sequences join, leave, take blocks and
    are preempted (8 blocks for 7 requests): the eager tokens, with whole rows, single entries and empty changes all
    sent; and the dense tables (the control) give the same."""
    sent, changes = [], HeldTables.changes
    def counting(self, *a):
        out = changes(self, *a)
        sent.append((len(out[0]), len(out[2])))
        return out
    monkeypatch.setattr(HeldTables, "changes", counting)
    kept, _ = _tokens(True)
    assert kept == _eager_tokens(0.0)
    assert any(r for r, _ in sent) and any(e for _, e in sent) and (0, 0) in sent
    sent.clear()
    dense, _ = _tokens(True, persistent_block_tables=False)
    assert dense == kept and not sent


def test_graph_step_packs_decode_columns_as_scheduled_seqs():
    """The scheduler hands decodes over as columns (`DecodeRows`, block tables as int64 arrays); a step packed from
    them equals the same step built by hand from `ScheduledSeq`s, padding rows and all; tables of different lengths."""
    llm = LLM(TINY, dtype="float32", num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=256,
              persistent_block_tables=False)                          # the dense tables, written out below
    for i, n in enumerate((5, 40, 17)):                               # 1, 3 and 2 blocks of 16
        llm.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    for _ in range(3): llm.step()                                     # prefill and two decodes, run eagerly
    llm.runner.enable_graphs(graph_batch_sizes(4), llm.max_model_len, capture=False)   # then only packed here
    step = llm.scheduler.schedule()
    assert step.is_decode_only and step.decodes is not None and not step.chunks
    assert len(set(step.decodes.num_blocks)) == 3
    sampling = llm._sampling(step)
    from_columns = llm.runner.pack(step, sampling)
    by_hand = Step(step.step_id, [dataclasses.replace(s) for s in step.seqs])
    assert by_hand.decodes is None
    from_seqs = llm.runner.pack(by_hand, sampling)
    assert from_columns.bucket == 4 and from_columns.width == 4
    assert from_columns.ints.tolist() == from_seqs.ints.tolist()
    assert list(from_columns.floats) == list(from_seqs.floats)
    bucket, width = 4, 4                                              # the tables' section, written out by hand
    tables = [b for s in step.seqs for b in s.block_table + [0] * (width - len(s.block_table))]
    tables += [0] * width * (bucket - len(step.seqs))
    assert from_columns.ints.tolist()[4 * bucket:4 * bucket + bucket * width] == tables
    llm.scheduler.cancel(step)
