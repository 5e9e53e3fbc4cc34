"The trained tiny model shipped in the package (the training chapter): it loads, it is deterministic, it learned."
import math

import pytest
import torch

from nanoserve.engine import LLM, SamplingParams
from nanoserve.tokenizer import default_model, is_model_folder, shipped_model_dir
from nanoserve.train import eval_loss, heldout_rows, is_held_out, stdlib_files

# The training run's held-out loss was 3.22 nats/token (perplexity 25) (figures/data/tiny_model_training.json); a model with
# random weights of the same shape scores about ln(3072) = 8.0. The bound leaves room for bf16 rounding and for
# another Python version's held-out files, and is still far below a random model's.
PERPLEXITY_BOUND = 60.0


def test_shipped_folder_is_complete_and_small():
    path = shipped_model_dir()
    assert is_model_folder(path) and default_model() == path
    assert sum(p.stat().st_size for p in path.iterdir()) < 15 * 2**20


def test_loads_through_our_loader_and_greedy_is_deterministic():
    prompt = "def read_config(path):\n"
    runs = []
    for _ in range(2):
        llm = LLM()                                   # no model named: the shipped one
        assert llm.model_dir == shipped_model_dir() and llm.config.num_hidden_layers == 4
        runs.append(llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0)))
    assert runs[0][0].token_ids == runs[1][0].token_ids and runs[0][0].text == runs[1][0].text
    assert len(runs[0][0].token_ids) >= 1


def test_heldout_perplexity_is_far_below_a_random_models():
    from transformers import Qwen2ForCausalLM
    path = shipped_model_dir()
    if not any(is_held_out(f) for f in stdlib_files()): pytest.skip("no held-out files in this Python's library")
    rows = heldout_rows(path / "tokenizer.json", num_rows=8)
    trained = Qwen2ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    random = Qwen2ForCausalLM(trained.config).float().eval()
    ppl_trained, ppl_random = math.exp(eval_loss(trained, rows)), math.exp(eval_loss(random, rows))
    assert ppl_trained < PERPLEXITY_BOUND, ppl_trained
    assert ppl_random > 1000 and ppl_trained < ppl_random / 50


def test_the_training_cells_are_never_run_by_ci():
    """The tiny model's run and its draft's: nbdev_test skips `#| eval: false`; nbval skips `# NBVAL_SKIP` (nbdev_clean
    strips cell tags, so a tag is not enough)."""
    import json
    from pathlib import Path
    nb = json.loads((Path(__file__).resolve().parents[1] / "nbs" / "04_train_tiny.ipynb").read_text())
    training = [c for c in nb["cells"] if c["cell_type"] == "code" and "history = train(" in "".join(c["source"])]
    assert len(training) == 2 and "teacher=" in "".join(training[1]["source"])     # the model, then its draft
    for cell in training:
        lines = [l.strip() for l in "".join(cell["source"]).splitlines()]
        assert "#| eval: false" in lines and "# NBVAL_SKIP" in lines
