"""Qwen3, Llama 3.x and Mistral on the H200 (issue: beyond Qwen2): parity, batch-1 decode against the weight floor,
nano-vllm's workload on Qwen3-0.6B against its physical limit, and the folded q/k norm against its control.

Run on the device machine from the repo root:
    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/families_h200.py --out $OUT [--parts bench,parity,decode,qknorm]
Writes families_h200.json (raw numbers, git sha, GPU, versions, date) to --out after every part, and the benchmark's
own bench_nanovllm_qwen3_h200.json beside it; copy both to figures/data/.

In the tutorials' order, checks first, then timings, side by side in one run:
1. `bench`: `nanoserve bench --shape qwen3-0.6B --workload nanovllm` (256 requests, prompt and output lengths uniform
   in 100..1024, EOS ignored, prefill included; numerator: output tokens actually generated), two runs in fresh
   processes, and the workload's physical limit that the command prints (weights per decode step plus every decode
   token's K/V over the copy bandwidth, prefill FLOPs over the matmul rate, both measured on this GPU after the runs).
   First, while nothing else holds the GPU.
2. `parity`: greedy tokens in fp32 of every family (random transformers checkpoints at the real head sizes, 64 and
   128, GQA ratios 1 to 8, Qwen3's q/k norms, llama3 and YaRN RoPE) against transformers' own classes on this GPU,
   through the engine's defaults (Triton kernels, CUDA graphs, async scheduling) and eagerly.
3. `decode`: ms per `LLM.step()` at batch 1 (128-token prompt; warm-up first, timed twice, >15% apart flagged) for
   Qwen3-0.6B, Qwen3-1.7B, Llama-3.2-1B, Llama-3.1-8B and Mistral-7B (random bf16 weights drawn on the GPU), each
   against its memory floor (weight bytes + K/V bytes over the copy bandwidth measured in the same run).
4. `qknorm`: Qwen3-0.6B decode with the q/k norms inside the RoPE kernels against the control (norms of their own,
   `qk_norm_in_attention=False`), interleaved A/B/A/B, at batch 1 and 64.
`--smoke`: every part on tiny shapes on the CPU under the Triton interpreter, written only to a temporary folder.
"""
import json, random, shutil, sys, tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import (LLM, SamplingParams, decode_row, device_or_skip, drain, floor_rows, floors, free, is_smoke,  # noqa: E402
                 out_path, parser, random_checkpoint, run_parts, saver, tiny_model)

import torch                                                                            # noqa: E402

from nanoserve.bench import main as bench_main                                           # noqa: E402
from nanoserve.model import SHAPES                                                      # noqa: E402

DECODE_SHAPES = ("qwen3-0.6B", "qwen3-1.7B", "llama3.2-1B", "llama3.1-8B", "mistral-7B")
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
# name -> (transformers classes, config): the real head sizes at small widths, random weights of std 0.2
PARITY = {
    "qwen3-hd128-gqa2": ("Qwen3", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                       intermediate_size=384)),
    "llama3-hd64-gqa8": ("Llama", dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=1,
                                       intermediate_size=768, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False)),
    "mistral-hd64-gqa4": ("Mistral", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1,
                                          intermediate_size=384, sliding_window=None, tie_word_embeddings=False)),
    "qwen2-yarn-hd64-gqa1": ("Qwen2", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                                           intermediate_size=384, rope_parameters={
                                               "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                               "original_max_position_embeddings": 512})),
}
BASE = dict(vocab_size=3072, num_hidden_layers=3, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1e6,
            tie_word_embeddings=True, initializer_range=0.2)


def parity_checkpoint(folder: Path, family: str, kw: dict, device, seed: int):
    "A random transformers model of `family` (biases and norms drawn too), saved with the tiny tokenizer; the model."
    import transformers
    torch.manual_seed(seed)
    cfg = getattr(transformers, f"{family}Config")(**{**BASE, **kw})
    hf = getattr(transformers, f"{family}ForCausalLM")(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"): p.normal_(0.0, 0.2)
            elif name.endswith("norm.weight"): p.uniform_(0.5, 1.5)
    hf.save_pretrained(str(folder))
    for f in tiny_model().iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json": shutil.copy(f, folder / f.name)
    return hf.to(device)


@torch.no_grad()
def hf_greedy(hf, ids: list[int], n: int, device) -> tuple[list[int], float]:
    "transformers' greedy continuation (never stopping) and the smallest top-2 logit margin along it."
    ids, out, margin = list(ids), [], float("inf")
    past = None
    x = torch.tensor([ids], device=device)
    for _ in range(n):
        r = hf(x, past_key_values=past, use_cache=True)
        past, logits = r.past_key_values, r.logits[0, -1].float()
        top = logits.topk(2).values
        margin = min(margin, (top[0] - top[1]).item())
        out.append(int(logits.argmax()))
        x = torch.tensor([[out[-1]]], device=device)
    return out, margin


def parity(res, device, smoke: bool) -> None:
    "fp32 greedy tokens of every family, ours (graphed + async, and eager) against transformers on this device."
    lens, n_new = ((5, 23), 6) if smoke else ((5, 60, 200, 700), 32)
    rows = {}
    for i, (name, (family, kw)) in enumerate(PARITY.items()):
        folder = Path(tempfile.mkdtemp(prefix=f"parity-{name}-"))
        kw = {**kw, "num_hidden_layers": 1, "hidden_size": kw["hidden_size"] // 2} if smoke else kw
        hf = parity_checkpoint(folder, family, kw, device, seed=700 + i)
        g = random.Random(i)
        prompts = [[g.randrange(BASE["vocab_size"]) for _ in range(n)] for n in lens]
        refs = [hf_greedy(hf, p, n_new, device) for p in prompts]
        del hf; free()
        sp = SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
        row = {"family": family, "config": kw, "prompt_lens": list(lens), "new_tokens": n_new,
               "min_margin": min(m for _, m in refs)}
        for setup, extra in (("default", {}), ("eager", dict(enforce_eager=True))):
            llm = LLM(folder, dtype="float32", max_num_seqs=8, num_kv_blocks=512, **extra)
            got = [o.token_ids for o in llm.generate(prompts, sp)]
            row[setup] = {"identical_sequences": sum(a == r for a, (r, _) in zip(got, refs)),
                          "identical_tokens": sum(x == y for a, (r, _) in zip(got, refs) for x, y in zip(a, r)),
                          "tokens": len(prompts) * n_new}
            drain(llm); del llm; free()
        print("parity", name, {k: v for k, v in row.items() if k != "config"}, flush=True)
        rows[name] = row
        shutil.rmtree(folder, ignore_errors=True)
    res["parity"] = rows


def shape_checkpoint(shape: str, smoke: bool, device) -> tuple[Path, str]:
    "Random bf16 weights of `shape` drawn on the GPU (the built-in tiny model under --smoke)."
    if smoke: return tiny_model(), "tiny"
    return random_checkpoint(shape, device=str(device.type)), shape


def decode(res, device, smoke: bool, save=lambda: None, shapes=DECODE_SHAPES) -> None:
    """Batch-1 decode of every new family's shapes, each row against its memory floor (`floors`: the copy bandwidth
    measured once, first); `save()` after every shape."""
    configs = {}
    floors(res, configs, 1 << 20 if smoke else 4 << 30)              # the bandwidth, before any model is loaded
    for shape in shapes[:1] if smoke else shapes:
        folder, name = shape_checkpoint(shape, smoke, device)
        configs[name] = json.loads((folder / "config.json").read_text())
        llm = LLM(folder, dtype="float32" if smoke else "bfloat16", num_kv_blocks=512, max_num_seqs=8,
                  max_num_batched_tokens=2048, show_progress=False)
        kw = dict(profiled_steps=2, ledger_steps=2, prompt_len=16) if smoke else {}
        row = decode_row(llm, name, "default", 1, 3 if smoke else 40, **kw)
        print("decode", {k: v for k, v in row.items() if k != "ledger_decode"}, flush=True)
        res.setdefault("decode", []).append(row)
        drain(llm); del llm; free()
        floor_rows(res, configs); save()


def qknorm(res, device, smoke: bool) -> None:
    "Qwen3-0.6B: q/k norms in the RoPE kernels (default) against norms of their own, interleaved A/B/A/B."
    folder, name = shape_checkpoint("qwen3-0.6B", smoke, device)
    llms = {c: LLM(folder, dtype="float32" if smoke else "bfloat16", num_kv_blocks=4096 if not smoke else 512,
                   max_num_seqs=64, max_num_batched_tokens=2048, show_progress=False, qk_norm_in_attention=c == "in_rope")
            for c in ("in_rope", "own_kernels")}
    kw = dict(profiled_steps=2, ledger_steps=2, prompt_len=16) if smoke else {}
    rows = []
    for batch in (1,) if smoke else (1, 64):
        for rnd in range(1 if smoke else 2):
            for c, llm in llms.items():
                row = decode_row(llm, name, c, batch, 3 if smoke else 40, **kw) | {"round": rnd}
                print("qknorm", {k: v for k, v in row.items() if k != "ledger_decode"}, flush=True)
                rows.append(row)
                drain(llm)
    res["qknorm"] = rows
    for batch in sorted({r["batch"] for r in rows}):
        pairs = [(a, b) for a in rows for b in rows if a["batch"] == b["batch"] == batch and a["round"] == b["round"]
                 and a["config"] == "in_rope" and b["config"] == "own_kernels"]
        res.setdefault("qknorm_ratio", {})[str(batch)] = [a["median_ms"] / b["median_ms"] for a, b in pairs]
    del llms; free()


def bench(res, args, smoke: bool) -> None:
    "`nanoserve bench` on nano-vllm's workload with the Qwen3-0.6B shape: two fresh-process runs and the limit."
    out = out_path("bench_nanovllm_qwen3_h200.json", args)
    argv = (["--model", str(tiny_model()), "--workload", "lognormal", "--num-requests", "4", "--prompt-max", "32",
             "--output-max", "8", "--repeats", "1", "--warmup", "0", "--profile-steps", "2", "--device", "cpu"]
            if smoke else ["--shape", "qwen3-0.6B", "--workload", "nanovllm", "--repeats", "2"])
    argv += ["--engines", "continuous", "--max-num-seqs", "256", "--max-num-batched-tokens", "16384", "--out", str(out)]
    rc = bench_main(argv)
    results = json.loads(out.read_text())
    runs = [r for r in results["runs"] if "error" not in r]
    res["bench"] = {"argv": argv, "exit_status": rc, "file": out.name, "limit": results.get("limit"),
                    "output_tokens_per_s": runs[0]["output_tokens_per_s"] if runs else None,
                    "disagree": runs[0]["disagree"] if runs else None}
    if runs and results.get("limit"):
        res["bench"]["share_of_limit"] = max(runs[0]["output_tokens_per_s"]) / results["limit"]["output_tokens_per_s"]
    if rc != 0: raise RuntimeError(f"nanoserve bench exited {rc}")


def main():
    ap = parser(__doc__, parts="bench,parity,decode,qknorm")
    ap.add_argument("--decode-shapes", default=",".join(DECODE_SHAPES), help="the decode part's shapes, comma-separated")
    args = ap.parse_args()
    smoke = is_smoke(args)
    device = device_or_skip(args)
    res = {"numerator": "output tokens actually generated", "shapes": {s: dict(SHAPES[s]) for s in DECODE_SHAPES}}
    parts = {"bench": lambda: bench(res, args, smoke), "parity": lambda: parity(res, device, smoke),
             "decode": lambda: decode(res, device, smoke, lambda: save("decode", None), args.decode_shapes.split(",")),
             "qknorm": lambda: qknorm(res, device, smoke)}
    save = saver("families_h200.json", res, args)
    run_parts(parts, args.parts, save, res.setdefault("part_seconds", {}))
    if any(k.endswith("_error") for k in res): raise SystemExit("a part failed (its error is in the JSON)")


if __name__ == "__main__":
    main()
