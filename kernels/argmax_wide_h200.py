"""The greedy argmax over a wide step's logits: torch's one block a row against `argmax_rows` (many programs a row).

    PYTHONPATH=. python kernels/argmax_wide_h200.py --out $OUT [--rows 16,32,64,128,256]

The engine takes `argmax_rows` for up to 16 rows and torch's `argmax` beyond, on the view that torch's one block a
row fills the GPU from there. The 256-row profiles say otherwise: torch's argmax took 53 us of a 2.29 ms step of
the 0.5B shape and of the Qwen3-0.6B one (`decode256_profile_h200.json`, `families_profile256q3_h200.json`), where
reading the [256, 151936] bf16 logits once takes about 18 us. In the tutorials' order, at each row count: check
`argmax_rows` (several `block` sizes, and so several parts a row) equals torch's argmax on the same logits (ties
included: rows with a repeated maximum), then time each inside CUDA graphs over copies of the logits that overflow
L2 (`lab.graph_bench`, two passes, >15% apart flagged), then write argmax_wide_h200.json with each row count's
fastest way and its ratio to torch. `--smoke`: fp32, small rows, under the interpreter.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import copies_for_l2, device_or_skip, disagree, graph_bench, is_smoke, median, parser, write  # noqa: E402

import torch  # noqa: E402

from nanoserve.fused import argmax_rows  # noqa: E402

BLOCKS = (1024, 2048, 4096)


def logits(B: int, V: int, device, dtype, seed: int = 0) -> torch.Tensor:
    "Random logits [B, V], every third row with its maximum repeated further on (argmax takes the first)."
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(B, V, device=device, dtype=dtype, generator=g)
    top = x.argmax(-1)
    for r in range(0, B, 3): x[r, (top[r] + V // 2) % V] = x[r, top[r]]
    return x


def one_rows(B: int, V: int, device, dtype) -> dict:
    x = logits(B, V, device, dtype)
    ref = x.argmax(-1)
    for block in BLOCKS:
        assert torch.equal(argmax_rows(x, block=block), ref), f"argmax_rows(block={block}) differs at {B} rows"
    nbytes = x.numel() * x.element_size()
    copies = [x] + [x.clone() for _ in range(copies_for_l2(nbytes, device) - 1)]
    ways = {"torch": lambda i: (lambda: copies[i].argmax(-1))}
    for b in BLOCKS:
        ways[f"argmax_rows {b}"] = (lambda b: lambda i: (lambda: argmax_rows(copies[i], block=b)))(b)
    us = {k: graph_bench(f, nbytes, device=device) for k, f in ways.items()}
    best = min((k for k in us if k != "torch"), key=lambda k: median(us[k]))
    row = {"rows": B, "vocab": V, "us": us, "disagree": {k: disagree(*v[:2]) for k, v in us.items() if len(v) > 1},
           "best": best, "best_over_torch": median(us[best]) / median(us["torch"]),
           "read_TBps": {k: nbytes / (median(v) * 1e-6) / 1e12 for k, v in us.items()}}
    print(B, {k: round(median(v), 1) for k, v in us.items()}, "best", best, flush=True)
    return row


def main():
    ap = parser(__doc__)
    ap.add_argument("--rows", default="16,32,64,128,256")
    args = ap.parse_args()
    device = device_or_skip(args)
    smoke = is_smoke(args)
    rows, V, dtype = ([4, 20], 3000, torch.float32) if smoke else ([int(r) for r in args.rows.split(",")], 151936,
                                                                  torch.bfloat16)
    write("argmax_wide_h200.json", {"rows": [one_rows(B, V, device, dtype) for B in rows]}, args)


if __name__ == "__main__":
    main()
