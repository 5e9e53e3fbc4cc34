"""Where a one-row quantized GEMV's warps stall: a 7B projection's kernel under Nsight Compute, when the device image
has `ncu` (issue 9). By default the gate/up projection, INT4 then INT8 from the tuned tables (four calls each);
`--method` and `--config` (JSON over the table) profile one variant, `--layer` another projection.

Run on the device machine from the repo root:
    ncu --target-processes all -k regex:quant_gemv_kernel --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section MemoryWorkloadAnalysis --csv python kernels/quant_ncu_h200.py > $OUT/quant_ncu_h200.csv
With one `--method`, `--launch-skip 3` profiles its fourth call.
"""
import argparse, json, sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from diet_h200 import layer_operands, quantized_copies     # noqa: E402
from nanoserve.quant import quant_gemv                    # noqa: E402

LAYERS = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default=None, help="int4 or int8 (default: both, INT4 first)")
    ap.add_argument("--config", default="{}", help="JSON config over the tuned table, e.g. '{\"F16\": true}'")
    ap.add_argument("--layer", default="gate_up", choices=list(LAYERS))
    args = ap.parse_args()
    w, b, x, _, _ = layer_operands(*LAYERS[args.layer], False, False, copies=False)
    for method in ([args.method] if args.method else ["int4", "int8"]):
        q, _, _ = quantized_copies(w, method)
        for _ in range(4): quant_gemv(x, *q, None, method, 128, config=json.loads(args.config) or None, pdl=False)
        torch.cuda.synchronize()
        print(method, args.layer, args.config, "done", flush=True)
