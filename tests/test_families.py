"""Qwen3, Llama 3 and Mistral, and Qwen2 with YaRN, against transformers' own classes (the oracle) on random
checkpoints of odd sizes that transformers made: logits through the paged cache in the parity tests' regimes
(one prefill, uneven chunks, decodes), greedy tokens through `LLM` (chunked prefill, forced preemption, prefix-cache
hits), and the loader's errors for what the forward pass does not implement."""
import json

import pytest
import torch

from helpers import (BASE_CONFIG, FAMILY_CLASSES, PagedDriver, assert_all_free, build_tokenizer_source, hf_greedy,
                     hf_logits, make_checkpoint, max_rel_err, quiet_transformers, random_prompt, torch_threads)
from nanoserve.bench import shape_config
from nanoserve.engine import LLM, SamplingParams
from nanoserve.measure import model_params
from nanoserve.model import SHAPES, ModelConfig, load_model
from nanoserve.tokenizer import hf_weight_shapes

LOGIT_RTOL = 2e-5
MIN_MARGIN = 1e-3
NEW_TOKENS = 24
# a short original context so that the scaled frequencies differ from plain RoPE inside 256 positions
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64}

# name -> (family, overrides of BASE_CONFIG)
FAMILIES = {
    "qwen3-hd16": ("qwen3", dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 intermediate_size=84)),                              # head_dim != 48 / 4
    "qwen3-gqa8-untied": ("qwen3", dict(hidden_size=40, num_attention_heads=8, num_key_value_heads=1, head_dim=8,
                                        tie_word_embeddings=False, num_hidden_layers=3)),
    "llama3-scaled-untied": ("llama", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                           intermediate_size=96, tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE)),
    "llama-linear-tied": ("llama", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=6,
                                        rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})),
    "mistral-gqa3": ("mistral", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                                     tie_word_embeddings=False, sliding_window=None)),
    "qwen2-yarn": ("qwen2", dict(rope_parameters=YARN_ROPE)),
}
PROMPT_LENS = (3, 40, 150)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    "name -> (folder, transformers model, our model), each built once."
    quiet_transformers()
    src = build_tokenizer_source(tmp_path_factory.mktemp("tokenizer"))
    out = {}
    for i, (name, (family, kw)) in enumerate(FAMILIES.items()):
        folder = tmp_path_factory.mktemp(name)
        hf = make_checkpoint(folder, seed=500 + i, tokenizer_from=src, family=family, **kw)
        out[name] = (folder, hf, load_model(folder, dtype=torch.float32))
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_the_config_reads_the_family(ckpts, name):
    folder, hf, ours = ckpts[name]
    c, d = ours.config, json.loads((folder / "config.json").read_text())
    assert c.model_type == d["model_type"] == FAMILIES[name][0]
    assert c.head_dim == hf.config.head_dim if hasattr(hf.config, "head_dim") else c.hidden_size // c.num_attention_heads
    assert c.qk_norm == (c.model_type == "qwen3") and c.attention_bias == (c.model_type == "qwen2")
    assert (c.rope_scaling is None) == ("rope_parameters" not in FAMILIES[name][1])


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("chunks", [[45], [1, 6, 13, 25], [38, 1, 1, 1, 1, 1, 1, 1], [200, 1, 1]],
                         ids=["one-prefill", "uneven-chunks", "prefill-then-decodes", "past-the-original-context"])
def test_logits_match_transformers(ckpts, name, chunks):
    _, hf, ours = ckpts[name]
    ids = random_prompt(sum(chunks), hf.config.vocab_size, seed=7)
    expected = hf_logits(hf, ids)
    drv, start, got = PagedDriver(ours, {"s": len(ids)}, block_size=4), 0, []
    for n in chunks:
        got += drv.step([("s", ids[start:start + n], start, n == 1 and start > 0)])
        start += n
    err = max_rel_err(torch.cat(got), expected)
    assert err <= LOGIT_RTOL, f"{name}: max relative logit error {err:.2e}"


@pytest.fixture(scope="module")
def refs(ckpts):
    "transformers' greedy continuations of three prompts per family."
    out = {}
    for name, (_, hf, _) in ckpts.items():
        prompts = [random_prompt(n, hf.config.vocab_size, seed=n) for n in PROMPT_LENS]
        gens = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
        assert min(m for _, m in gens) > MIN_MARGIN, f"{name}: a near-tie in the reference: pick another seed"
        out[name] = (prompts, [g for g, _ in gens])
    return out


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
SETUPS = {"default": {}, "chunked": dict(max_num_batched_tokens=8, max_num_seqs=4),
          "preempt": dict(block_size=4, num_kv_blocks=44), "async-off": dict(async_scheduling=False)}


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_matches_transformers(ckpts, refs, name, setup):
    folder = ckpts[name][0]
    prompts, expected = refs[name]
    llm = LLM(folder, dtype="float32", device="cpu", **SETUPS[setup])
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    if setup == "preempt":      # three that fit alone and together at first, not as they grow: preempted
        hf = ckpts[name][1]
        mids = [random_prompt(n, hf.config.vocab_size, seed=n) for n in (30, 40, 50)]
        grown = llm.generate(mids, GREEDY)
        assert sum(o.num_preemptions for o in grown) > 0
        assert [o.token_ids for o in grown] == [hf_greedy(hf, m, NEW_TOKENS)[0] for m in mids]
    again = llm.generate([prompts[1] + expected[1][:5], prompts[2]], GREEDY)     # prefix-cache hits
    assert again[0].num_cached_tokens > 0 and again[1].token_ids == expected[2]
    assert again[0].token_ids == hf_greedy(ckpts[name][1], prompts[1] + expected[1][:5], NEW_TOKENS)[0]
    assert_all_free(llm)


def _write_config(folder, **changes):
    path = folder / "config.json"
    d = json.loads(path.read_text()) | changes
    path.write_text(json.dumps(d))


def test_unsupported_fields_are_named(ckpts, tmp_path):
    folder = ckpts["mistral-gqa3"][0]
    import shutil
    for changes, words in [({"sliding_window": 64}, "sliding_window 64"), ({"model_type": "gemma3"}, "model_type 'gemma3'"),
                           ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "longrope"),
                           ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "original_max"),
                           ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act")]:
        bad = tmp_path / words.split()[0].strip("'")
        shutil.copytree(folder, bad, dirs_exist_ok=True)
        _write_config(bad, **changes)
        with pytest.raises(ValueError, match=words.replace("(", r"\(")):
            ModelConfig.from_model_dir(bad)


def test_a_window_as_long_as_the_context_is_plain_attention(ckpts, tmp_path):
    import shutil
    folder = tmp_path / "window"
    shutil.copytree(ckpts["mistral-gqa3"][0], folder)
    _write_config(folder, sliding_window=BASE_CONFIG["max_position_embeddings"])
    assert ModelConfig.from_model_dir(folder).model_type == "mistral"


def test_tensor_parallel_qwen3_and_llama_give_the_tokens_of_one(ckpts, refs):
    "Two processes over gloo: no QKV bias to split, Qwen3's q/k norms kept whole on each rank."
    for name in ("qwen3-hd16", "llama3-scaled-untied"):
        folder = ckpts[name][0]
        prompts, expected = refs[name]
        llm = LLM(folder, dtype="float32", device="cpu", tensor_parallel_size=2)
        try:
            assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
        finally: llm.close()


# the families' real head sizes, through the attention chapter's Triton kernels (interpreted here): Qwen3's 128 with
# its q/k norms folded into the RoPE kernels, Llama 3.2's 64 at 8 query heads per KV head
KERNEL_SHAPES = {
    "qwen3-hd128": ("qwen3", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                  intermediate_size=64, num_hidden_layers=1)),
    "llama-hd64-gqa8": ("llama", dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=1, head_dim=64,
                                      intermediate_size=64, num_hidden_layers=1, rope_parameters=LLAMA3_ROPE)),
}


@pytest.mark.parametrize("name", KERNEL_SHAPES)
def test_triton_kernels_at_the_families_head_sizes(tmp_path, name):
    family, kw = KERNEL_SHAPES[name]
    src = build_tokenizer_source(tmp_path / "tokenizer")
    hf = make_checkpoint(tmp_path / name, seed=600, tokenizer_from=src, family=family, **kw)
    prompts = [random_prompt(n, hf.config.vocab_size, seed=n) for n in (3, 37)]
    gens = [hf_greedy(hf, p, 12) for p in prompts]
    assert min(m for _, m in gens) > MIN_MARGIN, f"{name}: a near-tie in the reference: pick another seed"
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for in_attention in (True, False):     # Qwen3's norms in the kernels, and as kernels of their own (the control)
        llm = LLM(tmp_path / name, dtype="float32", device="cpu", attention_backend="triton", fused_kernels=True,
                  max_num_batched_tokens=16, max_num_seqs=4, qk_norm_in_attention=in_attention)   # chunked
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == [g for g, _ in gens], (name, in_attention)


@pytest.mark.parametrize("shape", SHAPES)
def test_random_checkpoints_of_real_shapes_match_transformers(shape):
    "The benchmarks' random checkpoints: every tensor transformers' class has, by name and shape; the same count."
    import transformers
    cfg = shape_config(shape)
    config_cls, model_cls = (getattr(transformers, n) for n in FAMILY_CLASSES[cfg["model_type"]])
    with torch.device("meta"): hf = model_cls(config_cls.from_dict(cfg))
    want = {k: tuple(v.shape) for k, v in hf.state_dict().items()
            if not (cfg["tie_word_embeddings"] and k == "lm_head.weight")}
    assert hf_weight_shapes(cfg) == want
    assert model_params(cfg) == sum(p.numel() for p in hf.parameters())
    assert ModelConfig.from_dict(cfg).context_length == hf.config.max_position_embeddings



def test_a_real_checkpoints_details(ckpts, tmp_path):
    """bf16 weights in shards with an index, loaded into fp32; the sampling defaults and end ids of
    generation_config.json; the chat template of chat_template.jinja; a max_model_len past the context refused."""
    import shutil
    src, hf = ckpts["llama3-scaled-untied"][0], ckpts["llama3-scaled-untied"][1]
    folder = tmp_path / "llama-bf16-sharded"
    hf.to(torch.bfloat16).save_pretrained(str(folder), max_shard_size="100KB")
    hf.float()
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 2
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json": shutil.copy(f, folder / f.name)
    (folder / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.0, "top_k": 5, "eos_token_id": [3, 4], "bos_token_id": 1}))
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (folder / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                                                "{% if add_generation_prompt %}<assistant>{% endif %}")
    llm = LLM(folder, dtype="float32", device="cpu", max_num_seqs=4)
    w = llm.model.layers[0].mlp.down_proj.weight
    assert w.dtype == torch.float32 and torch.equal(w, hf.model.layers[0].mlp.down_proj.weight.bfloat16().float())
    assert {3, 4} <= llm.eos_token_ids
    assert (llm.default_sampling_params().temperature, llm.default_sampling_params().top_k) == (0.0, 5)
    prompt = random_prompt(20, hf.config.vocab_size, seed=3)
    no_params = llm.generate(prompt)[0]                        # the checkpoint's defaults: greedy here
    assert no_params.token_ids == llm.generate(prompt, SamplingParams(temperature=0, top_k=5))[0].token_ids
    assert LLM(folder, dtype="float32", device="cpu", generation_config="none").default_sampling_params() == SamplingParams()
    assert llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True) == "<user>hi<assistant>"
    context = llm.config.context_length
    with pytest.raises(ValueError, match=f"max_model_len {context + 1} is longer than the model's context {context}"):
        LLM(folder, dtype="float32", device="cpu", max_model_len=context + 1)


@pytest.mark.parametrize("name,method,group", [("qwen3-hd16", "int8", 128), ("llama3-scaled-untied", "int8", 128),
                                               ("llama3-scaled-untied", "int4", 16), ("mistral-gqa3", "int4", 4)])
def test_quantized_families_equal_their_dequantized_weights(ckpts, name, method, group):
    "Weight-only int8 and int4 without a QKV bias (and with Qwen3's norms): what the dequantized fp32 model generates."
    from nanoserve.quant import QuantLinear
    folder, hf = ckpts[name][0], ckpts[name][1]
    q = LLM(folder, dtype="float32", device="cpu", quantization=method, quant_group_size=group, max_num_seqs=4)
    ref = LLM(folder, dtype="float32", device="cpu", max_num_seqs=4)
    qmods, n = dict(q.model.named_modules()), 0
    for mod_name, mod in ref.model.named_modules():
        if isinstance(qmods.get(mod_name), QuantLinear):
            mod.weight.data.copy_(qmods[mod_name].dequantized_weight(torch.float32)); n += 1
    head = q.model.quant_lm_head                                   # the engine's default head: INT8 (tied: the table)
    if ref.model.lm_head is None: ref.model.embed_tokens.weight.data.copy_(head.dequantized_weight(torch.float32)); n += 1
    assert n == 4 * q.config.num_hidden_layers + 1 and head.method == "int8"
    prompts = [random_prompt(n, hf.config.vocab_size, seed=n) for n in (5, 33)]
    assert [o.token_ids for o in q.generate(prompts, GREEDY)] == [o.token_ids for o in ref.generate(prompts, GREEDY)]


def test_fewer_kv_heads_than_ranks_is_refused(ckpts):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide num_key_value_heads \(1\)"):
        LLM(ckpts["qwen3-gqa8-untied"][0], dtype="float32", device="cpu", tensor_parallel_size=2)


def test_start_up_compiles_qwen3s_decode_variants_and_writes_nothing(ckpts):
    "The decode kernel's variants compiled at start-up (RoPE inside, Qwen3's norms folded in) leave the cache as it was."
    llm = LLM(ckpts["qwen3-hd16"][0], dtype="float32", device="cpu", attention_backend="triton", enforce_eager=True,
              num_kv_blocks=8, max_num_seqs=2)
    assert llm.model.kernels.qk_norm_in_attention
    llm.runner.kv_cache.normal_()
    before = llm.runner.kv_cache.clone()
    llm.runner.compile_kernels()
    assert torch.equal(llm.runner.kv_cache, before)
