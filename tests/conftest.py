"""pytest configuration for the package tests (`pytest tests`).

The runner, not the package, chooses how Triton runs: on a machine without CUDA the kernels run in Triton's
interpreter, and TRITON_INTERPRET=1 must be in the environment before anything defines a Triton kernel, that is
before any test module imports nanoserve. pytest imports this file before the test modules, so it is set here
(never overriding a value the caller chose). One intra-op thread too, unless the caller says otherwise: the test
models are tiny, and torch's default of one thread per core oversubscribes a small CI machine (two workers on two
cores ran the tiny model 10-50x slower).
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")         # before torch is imported

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def random_qwen2(tmp_path_factory):
    "A small random Qwen2 checkpoint folder (seed 7) with a tokenizer: the one-byte K/V caches' engine tests."
    from helpers import build_tokenizer_source, make_checkpoint
    folder = tmp_path_factory.mktemp("random-qwen2")
    make_checkpoint(folder, seed=7, tokenizer_from=build_tokenizer_source(tmp_path_factory.mktemp("tokenizer")))
    return folder
