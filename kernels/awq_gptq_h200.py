"""AWQ and GPTQ checkpoints of a real shape at batch 1 against our own INT4 of the same weights (issue 29), in one
process.

    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/awq_gptq_h200.py --out $OUT [--shape 7B] [--batches 1,16] \
        [--rounds 3] [--steps 200]

From the shape's random bf16 checkpoint (`random_checkpoint`), every projection is quantized by `quantize_int4`
(groups of `--group`) on the GPU and written as AutoAWQ's GEMM layout and as AutoGPTQ's (in the inputs' own order, and
in act order: a random order of the inputs, shared by the projections of one input, as `write_quantized` does),
the rest of the checkpoint as it is. Four engines, the package's defaults otherwise: `quantization="int4"` on the
bf16 checkpoint (ours, quantized at load), and the three checkpoints, repacked at load into the same kernels'
layout. In the tutorials' order: check (how often each engine's greedy tokens agree with ours on the same prompts:
the checkpoints store fp16 scales where ours are fp32, so a few tokens may differ; the layers' equality is the CPU
tests'), time (ms per step in steady decode at each batch, passes of back-to-back steps timed twice, the engines
in turn, the order rotating each round), write. `--smoke`: a small random Qwen2 on the CPU (groups of 32), a few steps.
"""
import gc, json, shutil, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import (LLM, SamplingParams, agreeing_prefix, device_or_skip, is_smoke, median, parser,  # noqa: E402
                 random_checkpoint, run_parts, saver, step_ms_twice, tiny_model)

import torch  # noqa: E402

from nanoserve.bench import random_hf_weights, shape_config  # noqa: E402
from nanoserve.model import load_state_dict  # noqa: E402
from nanoserve.quant import awq_tensors, gptq_tensors, quantize_int4, unpack_int4  # noqa: E402

NAME = "awq_gptq_h200.json"
MADE = {"default": None, "on": True, "off": False}          # --made-input -> the engines' quant_made_input
FORMATS = {"awq": ("awq", False), "gptq": ("gptq", False), "gptq act order": ("gptq", True)}


def write_format(src: Path, dst: Path, fmt: str, act_order: bool, G: int, device) -> Path:
    "`src`'s checkpoint with every projection in `fmt`'s INT4 tensors (quantized on `device`), into `dst`."
    if (dst / "model.safetensors").is_file(): return dst
    from safetensors.torch import save_file
    gen, out, orders = torch.Generator().manual_seed(0), {}, {}
    for name, w in load_state_dict(src, device=device.type).items():
        if not name.endswith("_proj.weight"): out[name] = w.cpu().contiguous(); continue
        K = w.shape[1]
        key = (name.rsplit(".", 2)[0], "o" if "o_proj" in name else "down" if "down_proj" in name else
               "qkv" if "self_attn" in name else "gate_up")                            # one input, one order
        if key not in orders: orders[key] = torch.randperm(K, generator=gen) if act_order and fmt == "gptq" else None
        order = None if orders[key] is None else orders[key].to(w.device)
        qw, s, z = quantize_int4(w if order is None else w[:, order], G)              # groups in the tool's order
        vals, s = unpack_int4(qw), s.half().float()                                    # [N, K]; fp16 as stored
        if fmt == "awq": t = awq_tensors(vals, s, z)
        else:
            order = torch.arange(K, device=w.device) if order is None else order
            g_idx = torch.empty(K, dtype=torch.long, device=w.device)
            g_idx[order] = torch.arange(K, device=w.device) // G
            vals_in = torch.empty_like(vals); vals_in[:, order] = vals                # the inputs' own order
            t = gptq_tensors(vals_in, s, z, g_idx)
        out.update({name.replace(".weight", "." + k): v.cpu().contiguous() for k, v in t.items()})
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), {"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"bits": 4, "group_size": G, "quant_method": fmt} | (
        {"version": "gemm", "zero_point": True} if fmt == "awq" else {"desc_act": act_order, "sym": False})
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json": shutil.copy(f, dst / f.name)
    return dst


def small_checkpoint(root: Path) -> Path:
    "--smoke: a random Qwen2 of the 0.5B shape's family, hidden 128, 2 layers, with the built-in tokenizer."
    path = root / "small-qwen2"
    if (path / "model.safetensors").is_file(): return path
    from safetensors.torch import save_file
    cfg = shape_config("0.5B") | dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=3072)
    path.mkdir(parents=True, exist_ok=True)
    save_file(random_hf_weights(cfg, seed=0, dtype=torch.bfloat16), str(path / "model.safetensors"), {"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in tiny_model().iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json": shutil.copy(f, path / f.name)
    return path


def engines(args, device, G: int) -> dict:
    "Our INT4 engine on the bf16 checkpoint and one engine a checkpoint format."
    src = small_checkpoint(Path(args.work)) if is_smoke(args) else random_checkpoint(args.shape, device=device.type)
    kw = dict(dtype="float32" if is_smoke(args) else "bfloat16", device=device.type,
              max_num_seqs=max(int(b) for b in args.batches.split(",")), num_kv_blocks=512,
              quant_made_input=MADE[args.made_input])
    out = {"int4 (ours)": LLM(src, quantization="int4", quant_group_size=G, quantize_lm_head=False, **kw)}   # like for
    # like: a checkpoint's LM head stays in bf16
    root = Path(args.work) / f"{src.name}-g{G}"
    for name, (fmt, act) in FORMATS.items():
        out[name] = LLM(write_format(src, root / name.replace(" ", "-"), fmt, act, G, device), **kw)
        print(out[name], out[name].quant_report, flush=True)
    if args.made_input == "default":       # the control: act order's one-row output projection gathered apart
        out["gptq act order, gather apart"] = LLM(root / "gptq-act-order", **{**kw, "quant_made_input": False})
    return out


def check(res, es) -> None:
    "Greedy tokens of every engine against ours, on the same prompts."
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(20 + 9 * i)] for i in range(8)]
    sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    outs = {k: [o.token_ids for o in llm.generate(prompts, sp)] for k, llm in es.items()}
    ours = outs["int4 (ours)"]
    res["check"] = {k: {"agreeing_prefix_mean": sum(agreeing_prefix(a, b) for a, b in zip(v, ours)) / len(ours),
                        "identical_requests": sum(a == b for a, b in zip(v, ours)), "requests": len(ours)}
                    for k, v in outs.items()}
    print(res["check"], flush=True)


def timed(res, es, args) -> None:
    "ms per step at each batch, every engine in turn, the order rotating each round."
    batches = (1, 2) if is_smoke(args) else tuple(int(b) for b in args.batches.split(","))
    steps, rounds = (3, 1) if is_smoke(args) else (args.steps, args.rounds)
    names = list(es)
    ms = {b: {k: [] for k in names} for b in batches}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for b in batches:
            for k in order:
                first, second, disagree = step_ms_twice(es[k], b, steps)
                ms[b][k].append({"ms": [first, second], "disagree": disagree})
                print("decode", r, b, k, round(first, 4), round(second, 4), flush=True)
    summary = {}
    for b in batches:
        med = {k: median([x for row in v for x in row["ms"]]) for k, v in ms[b].items()}
        summary[b] = {"median_ms": med, "ours_over": {k: med["int4 (ours)"] / v for k, v in med.items()}}
    res["decode"] = {"steps": steps, "rounds": rounds, "ms_per_step": ms, "summary": summary}
    print(summary, flush=True)


def main():
    ap = parser(__doc__, out="figures/data", parts="check,time")
    ap.add_argument("--shape", default="7B")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--work", default="/tmp/nanoserve-awq-gptq", help="where the checkpoints are written")
    ap.add_argument("--name", default=NAME)
    ap.add_argument("--made-input", choices=tuple(MADE), default="default",
                    help="every engine's quant_made_input: the package's default (INT4 apart, act order's gathers in "
                         "the GEMV, with an act-order engine gathering apart beside it), on or off")
    args = ap.parse_args()
    device = device_or_skip(args)
    G = 32 if is_smoke(args) else args.group
    es = engines(args, device, G)
    res = {"shape": "tiny" if is_smoke(args) else args.shape, "group_size": G, "quant_made_input": args.made_input,
           "engines": {k: repr(v) for k, v in es.items()}}
    run_parts({"check": lambda: check(res, es), "time": lambda: timed(res, es, args)}, args.parts,
              saver(args.name, res, args))
    del es
    gc.collect()
    if any(k.endswith("_error") for k in res): raise SystemExit("a part failed (its error is in the JSON)")


if __name__ == "__main__":
    main()
