"""nanoserve.yardsticks on the CPU: transformers' static `generate` and its continuous batching manager as yardsticks.

One random checkpoint made by transformers (vocab 300, 7 query heads per KV head, random biases and norm weights),
whose config names as EOS a token that greedy decoding produces early, so that "EOS is ignored" is tested. The oracle
is greedy decoding by full recomputation (no cache, no padding, no generate). Both runners must give every request
exactly its max_tokens tokens, equal to the oracle's, with timings that follow each runner's batching semantics.
"""
import sys

import pytest
import torch

from helpers import make_checkpoint, quiet_transformers, random_prompt, torch_threads
from nanoserve.yardsticks import check_requests, load_hf_model, run_hf_continuous, run_hf_static

SHAPES = [(5, 7), (13, 3), (2, 12), (9, 9), (20, 1), (7, 6), (1, 5)]    # (prompt length, max_tokens)
VOCAB = 300


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@torch.no_grad()
def oracle_greedy(model, ids, n):
    ids = list(ids)
    for _ in range(n): ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    "(checkpoint folder, loaded model, requests, oracle tokens, eos id)."
    quiet_transformers()
    folder = tmp_path_factory.mktemp("yardstick-qwen2")
    hf = make_checkpoint(folder, seed=11, vocab_size=VOCAB, max_position_embeddings=128)
    requests = [dict(prompt_token_ids=random_prompt(L, VOCAB, seed=100 + i), max_tokens=n)
                for i, (L, n) in enumerate(SHAPES)]
    expected = [oracle_greedy(hf, r["prompt_token_ids"], r["max_tokens"]) for r in requests]
    eos = expected[2][1]                                  # produced second by request 2: generate would stop there
    hf.config.eos_token_id = hf.generation_config.eos_token_id = eos
    hf.save_pretrained(str(folder))
    return folder, load_hf_model(folder, "cpu", "float32"), requests, expected, eos


def check_tokens(results, requests, expected):
    assert len(results) == len(requests)
    for q, r, want in zip(requests, results, expected):
        assert r["num_output_tokens"] == q["max_tokens"] == len(r["output_token_ids"])
        assert r["output_token_ids"] == want
        assert r["ttft_s"] is None or 0 < r["ttft_s"] <= r["e2e_s"]
        assert r["e2e_s"] > 0


def test_stock_generate_would_stop_at_eos(setup):
    _, model, requests, expected, eos = setup
    ids = torch.tensor([requests[2]["prompt_token_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert out[0, ids.shape[1]:].tolist() == expected[2][:2] and expected[2][1] == eos


@pytest.mark.parametrize("batch_size", [1, 3, len(SHAPES)])
def test_static_tokens_equal_oracle(setup, batch_size):
    _, model, requests, expected, _ = setup
    check_tokens(run_hf_static(model, requests, batch_size), requests, expected)


def test_static_batch_semantics(setup):
    _, model, requests, expected, _ = setup
    res = run_hf_static(model, requests, 3)
    assert [r["batch"] for r in res] == [0, 0, 0, 1, 1, 1, 2]
    for b in range(3):
        rows = [r for r in res if r["batch"] == b]
        longest = max(requests[i]["max_tokens"] for i, r in enumerate(res) if r["batch"] == b)
        assert len({(r["ttft_s"], r["e2e_s"]) for r in rows}) == 1           # a batch shares its clock
        assert all(r["num_computed_tokens"] == longest for r in rows)        # and decodes for its longest request
    firsts = [next(r for r in res if r["batch"] == b) for b in range(3)]
    for a, b in zip(firsts, firsts[1:]): assert b["ttft_s"] > a["e2e_s"]     # batches run one after another


def test_continuous_tokens_and_finish_order(setup):
    _, model, requests, expected, _ = setup
    res = run_hf_continuous(model, requests)
    check_tokens(res, requests, expected)
    assert all(r["ttft_s"] is not None for r in res)
    assert all(r["num_computed_tokens"] == r["num_output_tokens"] for r in res)
    order = sorted(range(len(res)), key=lambda i: res[i]["e2e_s"])
    assert order[0] == 4 and order[-1] == 2          # max_tokens 1 first, 12 last: nobody waits for a batch


def test_continuous_small_step_budget(setup):
    "8 tokens a step, 4-token blocks: chunked prefill over several steps, staggered first tokens, same tokens."
    _, model, requests, expected, _ = setup
    res = run_hf_continuous(model, requests, max_batch_tokens=8, cb_options=dict(block_size=4))
    check_tokens(res, requests, expected)
    assert len({round(r["ttft_s"], 6) for r in res}) > 1


def test_from_folder_and_model_state_restored(setup):
    folder, model, requests, expected, eos = setup
    check_tokens(run_hf_static(folder, requests[:3], 2, device="cpu", dtype="float32"), requests[:3], expected[:3])
    check_tokens(run_hf_continuous(folder, requests[:3]), requests[:3], expected[:3])
    run_hf_continuous(model, requests[:2])
    assert model.config._attn_implementation == "sdpa"         # the manager's attention switch is undone
    assert model.generation_config.eos_token_id == eos          # the clean generation config is swapped back


def test_bad_inputs(setup):
    folder, model, requests, _, _ = setup
    for bad in ([], [dict(max_tokens=1)], [dict(prompt_token_ids=[], max_tokens=1)],
                [dict(prompt_token_ids=[1], max_tokens=0)], [dict(prompt_token_ids=[1.5], max_tokens=1)]):
        with pytest.raises(ValueError): check_requests(bad)
        with pytest.raises(ValueError): run_hf_static(model, bad, 1)
        with pytest.raises(ValueError): run_hf_continuous(model, bad)
    with pytest.raises(ValueError): run_hf_static(model, requests, 0)
    with pytest.raises(ValueError): run_hf_static(model, requests, 2, dtype="bfloat16")    # contradicts the model
    with pytest.raises(ValueError): run_hf_continuous(model, requests, cb_options=dict(no_such_field=1))
    with pytest.raises(FileNotFoundError): load_hf_model(folder / "missing")
    assert model.config._attn_implementation == "sdpa"


def test_continuous_on_cpu_needs_psutil(setup, monkeypatch):
    _, model, requests, _, _ = setup
    monkeypatch.setitem(sys.modules, "psutil", None)            # `import psutil` now raises ImportError
    with pytest.raises(RuntimeError, match="psutil"): run_hf_continuous(model, requests[:1])
