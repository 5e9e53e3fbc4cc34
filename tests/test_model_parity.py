"""Our Qwen2 against transformers' `Qwen2ForCausalLM` (the oracle) on random checkpoints that transformers made.

1. Logits: our forward pass through a paged KV cache (one prefill, uneven chunks, decodes, several sequences in one
   flat step) equals transformers' in fp32: max |ours - theirs| <= LOGIT_RTOL * max(1, max |theirs|).
2. Greedy generation through `LLM` equals `generate(do_sample=False)` token for token, whatever the engine does
   around it: chunked prefill, preemption by recompute, prefix-cache hits, static batching.
3. Seeded sampling gives a request the same tokens alone and in any batch.
4. The loader: sharded checkpoints, the transformers-4 config layout, untied LM heads, and errors that name what is
   missing.
"""
import json
import shutil

import pytest
import torch

from helpers import (BASE_CONFIG, PagedDriver, assert_all_free, build_tokenizer_source, hf_greedy, hf_logits,
                     make_checkpoint, max_rel_err, quiet_transformers, random_prompt, torch_threads)
from nanoserve.engine import LLM, SamplingParams
from nanoserve.model import ModelConfig, load_model

LOGIT_RTOL = 2e-5        # relative to the largest logit (they reach about 5-10); observed: about 2e-6
MIN_MARGIN = 1e-3        # a greedy reference is only meaningful if no step is a near-tie in fp32

# name -> overrides of BASE_CONFIG (tied, 56 hidden, 7 heads, 1 KV head, 76 intermediate, 2 layers, vocab 3072)
CONFIGS = {
    "tied-kv7": {},
    "untied-kv2-3layers": dict(hidden_size=48, intermediate_size=100, num_hidden_layers=3, num_attention_heads=4,
                               num_key_value_heads=2, tie_word_embeddings=False, vocab_size=397, rope_theta=1e4,
                               rms_norm_eps=1e-5),
    "tied-kv1-mha": dict(hidden_size=80, intermediate_size=92, num_attention_heads=5, num_key_value_heads=5,
                         vocab_size=211),
    "untied-kv7-2kvheads": dict(hidden_size=112, intermediate_size=152, num_attention_heads=14, num_key_value_heads=2,
                                tie_word_embeddings=False),
}
GEN_CONFIGS = list(CONFIGS)
PROMPT_LENS = (3, 40, 170)
NEW_TOKENS = 32


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def tok_src(tmp_path_factory):
    quiet_transformers()
    return build_tokenizer_source(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, tok_src):
    "Every config's checkpoint, built once: name -> (folder, transformers model, our model)."
    out = {}
    for i, (name, kw) in enumerate(CONFIGS.items()):
        folder = tmp_path_factory.mktemp(name)
        hf = make_checkpoint(folder, seed=100 + i, tokenizer_from=tok_src, **kw)
        out[name] = (folder, hf, load_model(folder, dtype=torch.float32))
    return out


@pytest.fixture(scope="module")
def refs(ckpts):
    "transformers' greedy continuations of three prompts of very different lengths, per generation config."
    out = {}
    for name in GEN_CONFIGS:
        _, hf, _ = ckpts[name]
        prompts = [random_prompt(n, hf.config.vocab_size, seed=n) for n in PROMPT_LENS]
        gens = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
        MARGINS[name] = min(m for _, m in gens)
        assert MARGINS[name] > MIN_MARGIN, "a near-tie in the reference: pick another seed"
        out[name] = (prompts, [g for g, _ in gens])
    return out


MAX_ERR: dict[str, float] = {}   # the largest relative error seen per test, printed at the end of the module
MARGINS: dict[str, float] = {}   # the smallest top-2 logit margin of each config's greedy references


def _record(key: str, err: float) -> None:
    MAX_ERR[key] = max(err, MAX_ERR.get(key, 0.0))
    assert err <= LOGIT_RTOL, f"{key}: max relative logit error {err:.2e} > {LOGIT_RTOL:.0e}"


@pytest.fixture(scope="module", autouse=True)
def _report_errors():
    yield
    if MAX_ERR: print("\nmax relative logit error:", {k: f"{v:.1e}" for k, v in sorted(MAX_ERR.items())})
    if MARGINS: print("smallest greedy top-2 margin:", {k: f"{v:.1e}" for k, v in MARGINS.items()})


# -- 1. logits --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("chunks", [[45], [1, 6, 13, 25], [38, 1, 1, 1, 1, 1, 1, 1]],
                         ids=["one-prefill", "uneven-chunks", "prefill-then-decodes"])
def test_logits_match_transformers(ckpts, name, chunks):
    folder, hf, ours = ckpts[name]
    ids = random_prompt(sum(chunks), hf.config.vocab_size, seed=7)
    expected = hf_logits(hf, ids)
    drv, start, got = PagedDriver(ours, {"s": len(ids)}, block_size=4), 0, []
    for n in chunks:
        is_decode = n == 1 and start > 0
        got += drv.step([("s", ids[start:start + n], start, is_decode)])
        start += n
    _record(f"{name}/{'-'.join(map(str, chunks))}", max_rel_err(torch.cat(got), expected))


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_mixed_flat_batch(ckpts, name):
    "Three sequences through shared steps: decodes first, then several prefill chunks, as the engine lays them out."
    folder, hf, ours = ckpts[name]
    V = hf.config.vocab_size
    seqs = {"a": random_prompt(9, V, 1), "b": random_prompt(23, V, 2), "c": random_prompt(37, V, 3)}
    # (name, first position, number of tokens); n == 1 after the prompt's prefill counts as a decode
    plan = [[("a", 0, 5), ("b", 0, 6)],
            [("a", 5, 1), ("b", 6, 11), ("c", 0, 10)],
            [("a", 6, 1), ("b", 17, 1), ("c", 10, 20)],
            [("a", 7, 1), ("b", 18, 1), ("c", 30, 1)],
            [("a", 8, 1), ("b", 19, 1), ("c", 31, 1), ("b", 20, 3)],   # b again as a 3-token chunk (decodes first)
            [("c", 32, 5)]]
    drv = PagedDriver(ours, {k: len(v) for k, v in seqs.items()}, block_size=4, seed=5)
    got = {k: [] for k in seqs}
    for step in plan:
        work = [(k, seqs[k][s:s + n], s, n == 1 and s > 0) for k, s, n in step]
        work.sort(key=lambda w: not w[3])   # stable: decodes first
        for w, logits in zip(work, drv.step(work)): got[w[0]].append(logits)
    for k, ids in seqs.items():
        _record(f"{name}/mixed", max_rel_err(torch.cat(got[k]), hf_logits(hf, ids)))


# -- 2. greedy generation through the engine ---------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
ENGINE_SETUPS = {
    "default": {},
    "chunked": dict(max_num_batched_tokens=8, max_num_seqs=4),
    "odd-blocks-chunked": dict(block_size=3, max_num_batched_tokens=7, max_num_seqs=3),
    "preempt": dict(block_size=4, num_kv_blocks=56),
    "preempt-no-prefix-cache": dict(block_size=4, num_kv_blocks=56, enable_prefix_caching=False),
    "preempt-chunked": dict(block_size=4, num_kv_blocks=56, max_num_batched_tokens=12, max_num_seqs=3),
    "static": dict(policy="static", static_batch_size=2),
    "static-preempt": dict(policy="static", block_size=4, num_kv_blocks=56),
    "block-size-1": dict(block_size=1, max_num_batched_tokens=16, max_num_seqs=2),
}


def _llm(folder, **kw) -> LLM:
    return LLM(folder, dtype="float32", device="cpu", **kw)


@pytest.mark.parametrize("setup", ENGINE_SETUPS)
@pytest.mark.parametrize("name", GEN_CONFIGS)
def test_greedy_matches_transformers(ckpts, refs, name, setup):
    folder = ckpts[name][0]
    prompts, expected = refs[name]
    kw = ENGINE_SETUPS[setup]
    llm = _llm(folder, **kw)
    if "num_kv_blocks" in kw:   # enough blocks for the longest request alone, not for all three at once
        bs = kw["block_size"]
        need = [-(-(len(p) + NEW_TOKENS) // bs) for p in prompts]
        assert max(need) <= kw["num_kv_blocks"] < sum(need)
    outs = llm.generate(prompts, GREEDY)
    for o, p, e in zip(outs, prompts, expected):
        assert o.prompt_token_ids == p
        assert o.finish_reason == "length"
        assert o.token_ids == e, f"{setup}: prompt of {len(p)} tokens diverges at token " \
                                 f"{next(i for i, (a, b) in enumerate(zip(o.token_ids, e)) if a != b)}"
    if "num_kv_blocks" in kw:
        assert sum(o.num_preemptions for o in outs) > 0
        assert llm.scheduler.num_preemptions > 0
    if setup == "static":
        assert all(o.num_preemptions == 0 for o in outs)
    assert_all_free(llm)
    # the same engine again, prompts in the reverse order: same tokens (and prefix-cache hits where enabled)
    again = llm.generate(prompts[::-1], GREEDY)[::-1]
    assert [o.token_ids for o in again] == expected
    assert_all_free(llm)


@pytest.mark.parametrize("setup", ["default", "chunked", "preempt"])
def test_greedy_with_prefix_cache_hits(ckpts, setup):
    "A first request fills the prefix cache; a later batch shares its prefix and must still match transformers."
    folder, hf, _ = ckpts["tied-kv7"]
    V = hf.config.vocab_size
    prefix = random_prompt(64, V, seed=11)
    first = prefix + random_prompt(5, V, seed=12)
    batch = [prefix + random_prompt(3, V, seed=13),   # 67 tokens: 4 full blocks of 16 shared
             prefix + random_prompt(30, V, seed=14),  # 94 tokens: its 5th block differs
             list(first),                             # the same prompt again
             prefix[:33]]                             # 2 blocks cached, 1 token left to compute
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in [first] + batch]
    assert min(m for _, m in expected) > MIN_MARGIN
    kw = dict(ENGINE_SETUPS[setup])
    if setup == "preempt": kw.update(block_size=16, num_kv_blocks=14)   # 14 blocks: 2 requests at a time, at most
    llm = _llm(folder, **kw)
    bs = llm.block_size
    o0 = llm.generate(first, GREEDY)[0]
    assert o0.num_cached_tokens == 0 and o0.token_ids == expected[0][0]
    outs = llm.generate(batch, GREEDY)
    assert [o.token_ids for o in outs] == [e for e, _ in expected[1:]]
    cached = [o.num_cached_tokens for o in outs]
    assert all(c > 0 for c in cached), cached
    assert all(c % bs == 0 and c < len(p) for c, p in zip(cached, batch))
    if setup != "preempt":
        assert cached == [64, 64, 64, 32]
    else:
        assert sum(o.num_preemptions for o in outs) > 0
    assert_all_free(llm)


# -- 3. seeded sampling -------------------------------------------------------------------------------------------

def _seeded(seed, n=24):
    return SamplingParams(max_tokens=n, temperature=0.8, top_p=0.9, top_k=20, seed=seed, ignore_eos=True)


def test_seeded_sampling_same_alone_and_in_batch(ckpts, refs):
    folder = ckpts["tied-kv7"][0]
    prompts, greedy = refs["tied-kv7"]
    llm = _llm(folder)
    alone = llm.generate(prompts[1], _seeded(1234))[0].token_ids
    assert len(alone) == 24
    assert alone != greedy[1][:24]                       # it really sampled
    assert llm.generate(prompts[1], _seeded(1234))[0].token_ids == alone
    mixed = llm.generate(prompts, [_seeded(99), _seeded(1234), GREEDY])
    assert mixed[1].token_ids == alone
    assert mixed[2].token_ids == greedy[2]
    assert llm.generate([prompts[1], prompts[1]], [_seeded(5), _seeded(1234)])[1].token_ids == alone
    # other engines: chunked prefill, and preemption (the draws after a recompute must not change)
    for kw in (ENGINE_SETUPS["chunked"], ENGINE_SETUPS["preempt"]):
        other = _llm(folder, **kw)
        outs = other.generate(prompts[::-1], [GREEDY, _seeded(1234), _seeded(99)])
        assert outs[1].token_ids == alone, kw
        assert outs[2].token_ids == mixed[0].token_ids, kw
        if "num_kv_blocks" in kw: assert sum(o.num_preemptions for o in outs) > 0


def test_top_k_1_and_tiny_top_p_are_greedy(ckpts, refs):
    folder = ckpts["tied-kv7"][0]
    prompts, greedy = refs["tied-kv7"]
    llm = _llm(folder)
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_k=1, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=NEW_TOKENS, temperature=1.5, top_p=1e-6, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=NEW_TOKENS, temperature=1e-6, seed=3, ignore_eos=True)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == greedy


def test_different_seeds_differ(ckpts, refs):
    folder = ckpts["tied-kv7"][0]
    prompt = refs["tied-kv7"][0][1]
    llm = _llm(folder)
    outs = [tuple(o.token_ids) for o in llm.generate([prompt] * 4, [_seeded(s) for s in (1, 2, 3, 4)])]
    assert len(set(outs)) == 4, outs
    # unseeded requests differ from each other too (each request gets its own seed)
    a, b = llm.generate([prompt] * 2, SamplingParams(max_tokens=24, temperature=0.8, ignore_eos=True))
    assert a.token_ids != b.token_ids


# -- 4. the loader ---------------------------------------------------------------------------------------------------

def _logits(model, ids):
    drv = PagedDriver(model, {"s": len(ids)})
    return drv.step([("s", ids, 0, False)])[0]


def _same_params(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


@pytest.mark.parametrize("name", ["tied-kv7", "untied-kv2-3layers"])
def test_sharded_checkpoint(ckpts, tmp_path, name):
    folder, hf, ours = ckpts[name]
    hf.save_pretrained(str(tmp_path), max_shard_size="40KB")
    index = tmp_path / "model.safetensors.index.json"
    assert index.is_file() and not (tmp_path / "model.safetensors").exists()
    shards = set(json.loads(index.read_text())["weight_map"].values())
    assert len(shards) >= 2
    sharded = load_model(tmp_path, dtype=torch.float32)
    assert sharded.config == ours.config
    assert _same_params(sharded, ours)
    ids = random_prompt(20, hf.config.vocab_size, seed=3)
    assert torch.equal(_logits(sharded, ids), _logits(ours, ids))
    # a shard listed in the index but missing is named
    missing = sorted(shards)[-1]
    (tmp_path / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing.replace(".", r"\.")):
        load_model(tmp_path)


def test_old_config_layout(ckpts, tmp_path):
    "transformers 4 wrote torch_dtype and a top-level rope_theta, and no rope_parameters."
    folder, hf, ours = ckpts["tied-kv7"]
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((folder / "config.json").read_text())
    assert "rope_parameters" in cfg and "dtype" in cfg and "rope_theta" not in cfg   # the new layout, as written
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["torch_dtype"] = cfg.pop("dtype")
    cfg.pop("layer_types", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    old = load_model(tmp_path)                         # dtype from torch_dtype: float32
    assert old.config == ours.config
    assert old.config.rope_theta == 1e6 and old.embed_tokens.weight.dtype == torch.float32
    assert _same_params(old, ours)
    assert torch.equal(old.rotary.cos_sin_table, ours.rotary.cos_sin_table)
    ids = random_prompt(30, hf.config.vocab_size, seed=4)
    assert torch.equal(_logits(old, ids), _logits(ours, ids))
    # and the engine runs it, matching transformers
    prompt = random_prompt(12, hf.config.vocab_size, seed=5)
    expected, _ = hf_greedy(hf, prompt, 8)
    out = _llm(tmp_path).generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == expected


def test_untied_checkpoint_uses_lm_head(ckpts):
    for name in ("untied-kv2-3layers", "untied-kv7-2kvheads"):
        folder, hf, ours = ckpts[name]
        assert not ours.config.tie_word_embeddings and ours.lm_head is not None
        assert torch.equal(ours.lm_head.weight, hf.lm_head.weight)
        assert not torch.equal(ours.lm_head.weight, ours.embed_tokens.weight)
    folder, hf, ours = ckpts["tied-kv7"]
    assert ours.config.tie_word_embeddings and ours.lm_head is None
    assert torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)


def test_loader_errors_name_the_problem(ckpts, tmp_path):
    from safetensors.torch import load_file, save_file
    folder = ckpts["untied-kv2-3layers"][0]
    missing = tmp_path / "no-such-model"
    for load in (lambda p: load_model(p), lambda p: LLM(p, device="cpu")):
        with pytest.raises(FileNotFoundError, match="no-such-model"):
            load(missing)
    bare = tmp_path / "bare"; bare.mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json.*bare|bare.*config\.json"):
        load_model(bare)
    shutil.copy(folder / "config.json", bare)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(bare)
    sd = load_file(str(folder / "model.safetensors"))
    for name in ("model.layers.2.self_attn.k_proj.bias", "lm_head.weight", "model.norm.weight"):
        save_file({k: v for k, v in sd.items() if k != name}, str(bare / "model.safetensors"))
        with pytest.raises(KeyError, match=name.replace(".", r"\.")):
            load_model(bare)
    save_file(sd | {"model.layers.0.mlp.down_proj.weight": torch.zeros(48, 99)}, str(bare / "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj"):
        load_model(bare)
    (bare / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        load_model(bare)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["hidden_size"]
    (bare / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_size"):
        load_model(bare)


def test_base_config_is_what_the_brief_describes():
    "The main test config keeps the 0.5B model's 7 query heads per KV head, at odd small sizes."
    c = ModelConfig.from_dict({**BASE_CONFIG, "model_type": "qwen2"})
    assert (c.num_queries_per_kv, c.head_dim, c.hidden_size, c.intermediate_size) == (7, 8, 56, 76)
