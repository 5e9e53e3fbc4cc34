"Tensor parallelism on the CPU: two gloo processes against one, and the errors."
import pickle

import pytest
import torch

from nanoserve.engine import LLM, SamplingParams
from nanoserve.runner import StepInputs
from nanoserve.model import ModelConfig
from nanoserve.parallel import check_tensor_parallel, _vocab_slice
from nanoserve.tokenizer import default_model

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self", "for i in range(", "x = [", "#"]


@pytest.fixture(scope="module")
def single():
    return LLM(default_model(), dtype="float32", max_num_seqs=4)


def test_two_ranks_same_tokens_as_one(single):
    greedy = SamplingParams(max_tokens=20, temperature=0)
    sampled = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, seed=3)
    # max_num_seqs 4 < 6 prompts: steps mix prefills and decodes; 5 KV blocks of 16 force preemption; rank 0
    # schedules asynchronously (the default on a GPU), so every rank takes decode tokens from its own last samples
    llm = LLM(default_model(), dtype="float32", tensor_parallel_size=2, max_num_seqs=4, num_kv_blocks=5,
              async_scheduling=True)
    try:
        ref = LLM(default_model(), dtype="float32", max_num_seqs=4, num_kv_blocks=5)
        got = llm.generate(PROMPTS, greedy)
        assert sum(o.num_preemptions for o in got) > 0
        assert [o.token_ids for o in got] == [o.token_ids for o in ref.generate(PROMPTS, greedy)]
        assert [o.token_ids for o in llm.generate(PROMPTS, sampled)] == [o.token_ids for o in ref.generate(PROMPTS, sampled)]
        assert llm.runner.kv_cache.shape[4] == single.runner.kv_cache.shape[4] // 2     # half the KV heads per rank
        assert "tensor parallel 2" in repr(llm)
        with pytest.raises(ValueError, match="context"):           # bad input is refused on rank 0, workers untouched
            llm.generate("x", SamplingParams(max_tokens=10**6))
        assert llm.generate(PROMPTS[0], greedy)[0].token_ids == ref.generate(PROMPTS[0], greedy)[0].token_ids
    finally:
        llm.close()
    assert [p.returncode for p in llm.parallel.procs] == [0]          # the worker left cleanly when told to stop
    import torch.distributed as dist
    assert not dist.is_initialized()                                 # and so did rank 0: a new engine can start


def test_dead_worker_is_an_error_not_a_hang():
    llm = LLM(default_model(), dtype="float32", tensor_parallel_size=2)
    try:
        llm.parallel.procs[0].kill(); llm.parallel.procs[0].wait()
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            llm.generate("def f(", SamplingParams(max_tokens=4))
        assert not llm.has_unfinished_requests()
    finally:
        llm.close()
    llm.close()                                                       # twice is fine


def test_worker_that_fails_at_load_is_reported(tmp_path, monkeypatch):
    import shutil
    from nanoserve import parallel
    bad = tmp_path / "model"
    shutil.copytree(default_model(), bad)
    (bad / "model.safetensors").unlink()          # the worker finds no weights ...
    orig = parallel.load_shard                    # ... while rank 0 loads its shard from the intact folder
    monkeypatch.setattr(parallel, "load_shard", lambda model_dir, *a, **k: orig(default_model(), *a, **k))
    with pytest.raises(RuntimeError, match="rank 1 failed: FileNotFoundError"):
        LLM(bad, dtype="float32", tensor_parallel_size=2)


def test_checks():
    cfg = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    check_tensor_parallel(cfg, 2, torch.device("cpu"))
    for n, msg in ((4, "num_key_value_heads"), (0, "positive integer"), (True, "positive integer"), (3, "num_attention_heads")):
        with pytest.raises(ValueError, match=msg): check_tensor_parallel(cfg, n, torch.device("cpu"))
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="needs 2 GPUs"): check_tensor_parallel(cfg, 2, torch.device("cuda"))
    with pytest.raises(ValueError, match="does not divide"):
        LLM(default_model(), tensor_parallel_size=3)


def test_vocab_slices_cover_the_table_once():
    w = torch.arange(10.0)[:, None].expand(10, 3)
    got = []
    for r in range(3):
        rows, start, valid = _vocab_slice(w, r, 3)
        assert rows.shape == (4, 3)
        got += rows[:valid, 0].tolist()
        assert rows[valid:].abs().sum() == 0
    assert got == list(range(10))


def test_step_inputs_pickle_round_trip(single):
    single.add_request("def f(x):", SamplingParams(max_tokens=2, temperature=0.5, seed=1))
    step = single.scheduler.schedule()
    sampling = [(0.5, 1.0, 0, 1, 0)] * sum(s.sample for s in step.seqs)
    x = single.runner.pack(step, sampling)
    y = pickle.loads(pickle.dumps(x))
    assert isinstance(y, StepInputs) and y.ints == x.ints and y.floats == x.floats and y.sections == x.sections
    single.scheduler.cancel(step)
    for rid in list(single._requests): single.abort_request(rid)


def test_cli_generate_two_ranks(capsys):
    "`nanoserve generate --tensor-parallel-size 2` writes the same text as one process, and exits 0."
    from nanoserve.cli import main
    args = ["generate", "def fibonacci(n):", "--max-tokens", "12", "--dtype", "float32"]
    assert main(args) == 0
    one = capsys.readouterr().out
    assert main(args + ["--tensor-parallel-size", "2"]) == 0
    assert capsys.readouterr().out == one
    assert main(args + ["--tensor-parallel-size", "3"]) == 2                    # 4 heads: a clear error
    assert "does not divide num_attention_heads" in capsys.readouterr().err
