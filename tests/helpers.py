"""Shared helpers for the model-parity and engine tests: random Qwen2 checkpoints made by transformers (the oracle),
loadable by `nanoserve.engine.LLM`, and a driver that runs our model over hand-built paged-cache steps."""
from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import torch

from nanoserve.model import AttentionMetadata, PrefillChunk
from nanoserve.tokenizer import TINY_MODEL_NAME, build_tiny_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# A Qwen2 in miniature with odd sizes: 7 query heads per KV head (as in Qwen2.5-0.5B), head_dim 8, tied embeddings,
# the built-in tokenizer's vocabulary (3072) so that text prompts and detokenization work too.
BASE_CONFIG = dict(vocab_size=3072, hidden_size=56, intermediate_size=76, num_hidden_layers=2, num_attention_heads=7,
                   num_key_value_heads=1, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1e6,
                   tie_word_embeddings=True)

# Weights drawn with std 0.2 (transformers' default is 0.02): with 0.02 a random model's greedy output collapses
# into repeating one token, which would make "same tokens" a weak check. With 0.2 the output is varied and the
# top-2 logit margins stay far above fp32 rounding (checked by `greedy_margins`).
INIT_STD = 0.2


@contextlib.contextmanager
def torch_threads(n: int):
    """Run with `n` intra-op threads, then restore. These models are tiny: one thread is as fast as two, and far
    faster when another process shares the 2 cores (spinning worker threads then wait on each other)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def build_tokenizer_source(root) -> Path:
    "A built-in tiny model folder under `root` (built once), whose tokenizer files random checkpoints borrow."
    path = Path(root) / TINY_MODEL_NAME
    return path if path.is_dir() else build_tiny_model(path)


FAMILY_CLASSES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
                  "llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM")}


def make_checkpoint(path, *, seed: int = 0, std: float = INIT_STD, tokenizer_from=None, max_shard_size=None,
                    family: str = "qwen2", **overrides):
    """Save a random transformers model of `family` (`Qwen2ForCausalLM` by default; fp32, eval mode) to `path` and
    return it.

    transformers zero-initialises biases and sets norms to ones, so every bias and norm weight gets random values
    too (a loader that forgot the QKV bias or Qwen3's q/k norms would otherwise pass). With `tokenizer_from` (a
    model folder), its tokenizer files are copied in, so that `LLM(path)` can load the folder."""
    import transformers
    quiet_transformers()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config_cls, model_cls = (getattr(transformers, n) for n in FAMILY_CLASSES[family])
    cfg = config_cls(**{**BASE_CONFIG, "initializer_range": std, **overrides})
    hf = model_cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"): p.normal_(0.0, std)
            elif name.endswith("norm.weight"): p.uniform_(0.5, 1.5)   # not all ones: the norm weights must be read
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    hf.save_pretrained(str(path), **kw)
    if tokenizer_from is not None:
        for f in TOKENIZER_FILES: shutil.copy(Path(tokenizer_from) / f, path / f)
    return hf


def random_prompt(n: int, vocab_size: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n,), generator=g).tolist()


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    "transformers' logits [len(ids), vocab] for one unpadded sequence."
    return hf(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(hf, ids: list[int], n: int) -> tuple[list[int], float]:
    "transformers' greedy continuation of one unpadded prompt, never stopping early; and the smallest top-2 margin."
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                      output_scores=True, return_dict_in_generate=True)
    margin = min((s[0].topk(2).values[0] - s[0].topk(2).values[1]).item() for s in out.scores)
    return out.sequences[0, len(ids):].tolist(), margin


def with_tokenizer(folder: Path, **quant_overrides) -> None:
    "The shipped tiny model's tokenizer copied into checkpoint `folder`; `quant_overrides` into its quantization_config."
    import json
    from nanoserve.tokenizer import shipped_model_dir
    for name in ("tokenizer.json", "tokenizer_config.json"): shutil.copy(shipped_model_dir() / name, folder / name)
    if quant_overrides:
        cfg = json.loads((folder / "config.json").read_text())
        cfg["quantization_config"].update(quant_overrides)
        (folder / "config.json").write_text(json.dumps(cfg))


class PagedDriver:
    """Runs our model step by step over a paged KV cache, building the step's metadata by hand.

    Each sequence gets a scattered set of blocks (a random permutation of the pool); a step is a list of
    (name, token_ids, start_pos, is_decode) in flat-batch order (decodes first, as the engine lays them out).
    Decode block tables are padded with block 0 (another sequence's block), which the length mask must hide."""

    def __init__(self, model, lengths: dict[str, int], block_size: int = 4, spare_blocks: int = 3, seed: int = 0):
        cfg = model.config
        self.model, self.block_size = model, block_size
        need = {k: -(-n // block_size) for k, n in lengths.items()}
        num_blocks = sum(need.values()) + spare_blocks
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(num_blocks, generator=g).tolist()
        self.tables, i = {}, 0
        for k, n in need.items(): self.tables[k] = perm[i:i + n]; i += n
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        dtype = model.embed_tokens.weight.dtype
        # never-written slots hold large garbage (not zeros), so a read that the masks should hide would show
        self.caches = [(100 * torch.randn(shape, generator=g).to(dtype), 100 * torch.randn(shape, generator=g).to(dtype))
                       for _ in range(cfg.num_hidden_layers)]

    def slots(self, name: str, start: int, n: int) -> list[int]:
        t, bs = self.tables[name], self.block_size
        return [t[p // bs] * bs + p % bs for p in range(start, start + n)]

    @torch.no_grad()
    def step(self, work) -> list[torch.Tensor]:
        "Compute one step; returns logits [n, vocab] for every token of every entry of `work`."
        decodes = [w for w in work if w[3]]
        assert work[:len(decodes)] == decodes, "decodes come first in a step"
        ids, pos, slots = [], [], []
        for name, toks, start, _ in work:
            ids += toks; pos += range(start, start + len(toks)); slots += self.slots(name, start, len(toks))
        width = 1 << max(0, (max((len(self.tables[w[0]]) for w in decodes), default=1) - 1).bit_length())
        tables = [self.tables[w[0]] + [0] * (width - len(self.tables[w[0]])) for w in decodes]
        chunks, t = [], len(decodes)
        for name, toks, start, is_decode in work[len(decodes):]:
            chunks.append(PrefillChunk(t, len(toks), start, torch.tensor(self.tables[name])))
            t += len(toks)
        meta = AttentionMetadata(torch.tensor(slots), len(decodes),
                                 torch.tensor(tables, dtype=torch.long).view(len(decodes), width),
                                 torch.tensor([w[2] + 1 for w in decodes], dtype=torch.long), chunks)
        hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.caches, meta)
        logits = self.model.compute_logits(hidden)
        out, t = [], 0
        for _, toks, _, _ in work:
            out.append(logits[t:t + len(toks)]); t += len(toks)
        return out


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    "max |ours - ref| divided by max(1, max |ref|)."
    return ((ours - ref).abs().max() / max(1.0, ref.abs().max().item())).item()


def assert_all_free(llm) -> None:
    "Nothing queued or running, every KV block free (cached ones count as free), bookkeeping consistent."
    assert not llm.has_unfinished_requests()
    assert not llm.scheduler.has_unfinished()
    assert not llm.scheduler.waiting and not llm.scheduler.running
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_used_blocks} KV blocks still in use"
    llm.scheduler.check_invariants()


def compiled_run(script: str, timeout: int = 600) -> str:
    """Run `script` in a fresh Python with TRITON_INTERPRET=0 from the repository root (it compiles for sm_90 on the
    CPU, it does not interpret; `kernels/` importable): its standard output."""
    import os, subprocess, sys
    root = Path(__file__).parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout,
                       cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def small_model(dtype: torch.dtype = torch.float32, **config):
    """A seeded random `Qwen2ForCausalLM` (norm weights in [0.5, 1.5], the rest N(0, 0.1)) of a small config (`config`
    overrides it), in `dtype`, its rotary table built on the CPU in `dtype`, in eval mode."""
    from nanoserve.model import ModelConfig, Qwen2ForCausalLM
    cfg = ModelConfig(**(dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                              tie_word_embeddings=True) | config))
    torch.manual_seed(0)
    m = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"): p.uniform_(0.5, 1.5)
            else: p.normal_(0.0, 0.1)
    m = m.to(dtype)
    m.rotary.build("cpu", dtype)
    return m.eval().requires_grad_(False)



@torch.no_grad()
def recomputed_greedy(model, ids: list[int], n: int, cache_dtype: torch.dtype) -> list[int]:
    """Greedy tokens, each from one prefill of the whole sequence so far over a fresh cache of `cache_dtype` (nothing
    reused: every key and value rounded once, as a cache of that dtype stores it)."""
    from nanoserve.model import make_kv_cache
    cfg, out = model.config, list(ids)
    for _ in range(n):
        T, nb = len(out), -(-len(out) // 4)
        cache = make_kv_cache(cfg.num_hidden_layers, nb, 4, cfg.num_key_value_heads, cfg.head_dim, cache_dtype)
        meta = AttentionMetadata(torch.arange(T), prefills=[PrefillChunk(0, T, 0, torch.arange(nb))])
        hidden = model(torch.tensor(out), torch.arange(T), [(c[0], c[1]) for c in cache], meta)
        out.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
    return out[len(ids):]


ONE_BYTE_SETUPS = {"default": {}, "chunked": dict(max_num_batched_tokens=8, max_num_seqs=4),
                   "preempt": dict(block_size=4, num_kv_blocks=22), "async-off": dict(async_scheduling=False)}


def check_one_byte_engine(ckpt, setup: str, cache: str) -> None:
    """An fp32 engine with a one-byte K/V cache (`cache`: "fp8" or "int8") in a scheduling regime of `ONE_BYTE_SETUPS`
    gives `recomputed_greedy`'s tokens, and again on a prefix-cache hit over those blocks."""
    from nanoserve.engine import LLM, SamplingParams
    from nanoserve.model import load_model
    from nanoserve.runner import kv_cache_dtype
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    model, dtype = load_model(ckpt, dtype=torch.float32), kv_cache_dtype(cache, torch.float32)
    prompts = [random_prompt(n, model.config.vocab_size, seed=n) for n in (5, 23, 41)]
    llm = LLM(ckpt, dtype="float32", device="cpu", kv_cache_dtype=cache, **ONE_BYTE_SETUPS[setup])
    assert llm.runner.kv_cache.dtype == dtype
    outs = llm.generate(prompts, greedy)
    if setup == "preempt": assert sum(o.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == [recomputed_greedy(model, p, 12, dtype) for p in prompts]
    again = llm.generate([prompts[2][:30]], greedy)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == recomputed_greedy(model, prompts[2][:30], 12, dtype)
