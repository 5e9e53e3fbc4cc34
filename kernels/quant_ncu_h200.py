"""Where the INT4 one-row GEMV's warps stall: the 7B gate/up projection's words kernel (the tuned table) under
Nsight Compute, when the device image has `ncu` (issue 9's next step after `quant_lab_h200.py`).

Run on the device machine from the repo root:
    ncu --target-processes all -k regex:quant_gemv_kernel --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section MemoryWorkloadAnalysis --csv python kernels/quant_ncu_h200.py > $OUT/quant_ncu_h200.csv
This script only makes the operands and calls the kernel (INT4, then INT8 for comparison, four calls each).
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from diet_h200 import layer_operands, quantized_copies     # noqa: E402
from nanoserve.quant import quant_gemv                    # noqa: E402

if __name__ == "__main__":
    w, b, x, _, _ = layer_operands(37888, 3584, False, False, copies=False)
    for method in ("int4", "int8"):
        q, _, _ = quantized_copies(w, method)
        for _ in range(4): quant_gemv(x, *q, None, method, 128, pdl=False)
        torch.cuda.synchronize()
        print(method, "done", flush=True)
