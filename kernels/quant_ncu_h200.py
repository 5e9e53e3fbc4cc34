"""Where a one-row quantized GEMV's warps stall: a 7B projection's kernel under Nsight Compute, when the device image
has `ncu`. By default the gate/up projection, INT4 then INT8 from the tuned tables (a checked call, then four more
each); `--method` and `--config` (JSON over the table, passed as `config=`) profile one variant, `--layer` another
projection.

Run on the device machine from the repo root:
    ncu --target-processes all -k regex:quant_gemv_kernel --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section MemoryWorkloadAnalysis --csv python kernels/quant_ncu_h200.py > $OUT/quant_ncu_h200.csv
With one `--method`, `--launch-skip 3` profiles its fourth call (a warm one, like the rest). Each kernel is checked
against the reference before the profiled calls; Nsight Compute writes the data (this script writes no file).
`--smoke`: a tiny layer on the CPU under the interpreter.
"""
import json, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import device_or_skip, is_smoke, parser, rel_err, sync

import torch

from nanoserve.quant import quant_gemv, quant_matmul_ref, quantize_int4, quantize_int8

LAYERS = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
TINY = (256, 512)                                       # --smoke's layer


def operands(N: int, K: int, method: str, device):
    "A seeded bf16 weight [N, K] quantized (INT4: groups of 128) and an input row [1, K]."
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(N, K, device=device, dtype=torch.bfloat16, generator=g) * 0.02
    x = torch.randn(1, K, device=device, dtype=torch.bfloat16, generator=g)
    return (quantize_int8(w) + (None,) if method == "int8" else quantize_int4(w, 128)), x


def main():
    ap = parser(__doc__)
    ap.add_argument("--method", default=None, help="int4 or int8 (default: both, INT4 first)")
    ap.add_argument("--config", default="{}", help="JSON config over the tuned table, e.g. '{\"F16\": true}'")
    ap.add_argument("--layer", default="gate_up", choices=list(LAYERS))
    args = ap.parse_args()
    device = device_or_skip(args)
    N, K = TINY if is_smoke(args) else LAYERS[args.layer]
    config = json.loads(args.config) or None
    for method in ([args.method] if args.method else ["int4", "int8"]):
        q, x = operands(N, K, method, device)
        out = quant_gemv(x, *q, None, method, 128, config=config)
        err = rel_err(out, quant_matmul_ref(x.float(), *q, None, method, 128))
        assert err < 0.02, (method, err)                 # check first: the profiled calls follow
        for _ in range(3 if is_smoke(args) else 4): quant_gemv(x, *q, None, method, 128, config=config, pdl=False)
        sync(device)
        print(method, args.layer, args.config, f"checked (rel err {err:.1e}), profiled calls done", flush=True)


if __name__ == "__main__":
    main()
