"""lm-evaluation-harness (lm-eval 0.4.13) against nanoserve's server, the way users evaluate a served model: its
`local-completions` model over /v1/completions, on two tiny tasks defined in tests/data/lm_eval (four local JSON
lines, no network):

- a loglikelihood (multiple_choice) task, which the harness scores from echoed prompt logprobs (`echo`, `logprobs`,
  `max_tokens: 1`): every per-sample value it logs must equal transformers' log-probability of the continuation
  given the context, computed here on the same weights (Qwen2ForCausalLM, fp32, CPU);
- a generate_until task (greedy, stopped at a newline), which must complete with the engine's own greedy text.

The server is `build_app` + `ServerThread` in this process, on the random tiny model on the CPU in fp32. Everything
that could reach the network is off: HF_DATASETS_OFFLINE, HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE are set (in the
environment and in the libraries' already-read settings), the datasets cache is a temporary folder, the tokenizer is
the model's own folder.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import torch

from nanoserve.engine import LLM, SamplingParams
from nanoserve.server import ServerThread, build_app
from nanoserve.tokenizer import TINY_MODEL_NAME, build_tiny_model

DATA = Path(__file__).resolve().parent / "data" / "lm_eval"
SERVED = "tiny"
TOL = 1e-3                      # nats, per sample: fp32 on both sides, different kernels


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("lm-eval-model") / TINY_MODEL_NAME)


@pytest.fixture(scope="module")
def server(model_dir):
    "The server on a free loopback port, and its engine."
    llm = LLM(model_dir, device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=512)
    with ServerThread(build_app(llm, served_model_name=SERVED)) as srv:
        yield srv.url, llm


@pytest.fixture
def offline(monkeypatch, tmp_path):
    "No network for datasets, the hub or transformers; a temporary datasets cache; the task folder as the cwd."
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"): monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    import datasets.config
    import huggingface_hub.constants
    # the libraries read these at import, which may have happened already
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(DATA)               # the tasks' data_files are relative to the working directory
    return tmp_path


def evaluate(url: str, model_dir: Path, task: str) -> dict:
    "`lm_eval.simple_evaluate` of one task with `local-completions` pointed at `url`; per-sample logs kept."
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    model_args = {"model": SERVED, "base_url": f"{url}/v1/completions", "tokenizer_backend": "huggingface",
                  "tokenizer": str(model_dir), "tokenized_requests": True, "max_retries": 1, "num_concurrent": 1,
                  "max_length": 2048, "timeout": 120}
    return simple_evaluate(model="local-completions", model_args=model_args, tasks=[task],
                           task_manager=TaskManager(include_path=str(DATA)), log_samples=True, bootstrap_iters=0,
                           random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], int]:
    """The harness's tokenization of a (context, continuation) pair (`TemplateLM._encode_pair`): the context's
    trailing whitespace moves to the continuation; the continuation's ids are what the whole's ids hold past the
    context's own count, and the request is the context's ids followed by those. (Where a merge crosses the border,
    as ':' and a newline into ':\n', the request is not the whole's tokenization: the harness scores that sequence,
    so the reference scores it too.) Returns (the request's ids, the context's length)."""
    n = len(context) - len(context.rstrip())
    if n: context, continuation = context[:-n], context[-n:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx + whole[len(ctx):], len(ctx)


@pytest.fixture(scope="module")
def hf(model_dir):
    "transformers' own Qwen2 on the same weights, fp32, and the model folder's tokenizer."
    from transformers import AutoTokenizer, Qwen2ForCausalLM
    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def hf_logprob(hf, context: str, continuation: str) -> tuple[float, bool]:
    """The sum of transformers' log-softmax over the continuation's tokens, each given everything before it, and
    whether each of them is the most likely token there (the harness's is_greedy)."""
    model, tok = hf
    ids, ctxlen = encode_pair(tok, context, continuation)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return (sum(logp[i - 1, ids[i]].item() for i in range(ctxlen, len(ids))),
            all(logp[i - 1].argmax().item() == ids[i] for i in range(ctxlen, len(ids))))


def test_loglikelihood_task_matches_transformers(server, model_dir, hf, offline):
    url, _ = server
    res = evaluate(url, model_dir, "nanoserve_tiny_code_mc")
    samples = res["samples"]["nanoserve_tiny_code_mc"]
    assert len(samples) == 4
    checked = 0
    for s in samples:
        assert len(s["arguments"]) == len(s["doc"]["choices"]) == len(s["filtered_resps"])
        for (context, continuation), (ll, is_greedy) in zip(s["arguments"], s["filtered_resps"]):
            want, greedy = hf_logprob(hf, context, continuation)
            assert math.isfinite(ll) and ll < 0, (context, continuation, ll)
            assert abs(ll - want) < TOL, (context, continuation, ll, want)
            assert is_greedy == greedy, (context, continuation)
            checked += 1
    assert checked == 12
    acc = res["results"]["nanoserve_tiny_code_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0


def test_generate_until_task_completes(server, model_dir, hf, offline):
    url, _ = server
    res = evaluate(url, model_dir, "nanoserve_tiny_code_gen")
    samples = res["samples"]["nanoserve_tiny_code_gen"]
    assert len(samples) == 4
    assert "exact_match,none" in res["results"]["nanoserve_tiny_code_gen"]
    prompts, texts = [], []
    for s in samples:
        ((context, gen_kwargs),) = s["arguments"]
        assert gen_kwargs["until"] == ["\n"] and gen_kwargs["max_gen_toks"] == 8
        ((text,),) = s["resps"]
        assert isinstance(text, str) and "\n" not in text
        prompts.append(hf[1].encode(context, add_special_tokens=False)); texts.append(text)
    # the engine's own greedy text (an engine of its own: the server's runs on the server's thread), stopped where
    # the harness asked (its stop list adds the EOS string)
    llm = LLM(model_dir, device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=512)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, stop=["\n", "<|endoftext|>"]))
    assert texts == [o.text for o in outs]
