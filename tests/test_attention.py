"""The Triton attention kernels on the CPU, through the interpreter, in a fresh process.

The kernels' own checks (irregular shapes, ratios 1/2/7, block sizes 16/32, split-K, fp32/fp16) live in
nbs/06_attention.ipynb. This file guards the import-order bug found while wiring the kernels into the engine:
torch imports triton lazily inside some operations; if that happens before TRITON_INTERPRET is set, triton's own
`@jit` helpers (tl.max, tl.sum, tl.zeros, tl.cdiv) are compiled-mode functions the interpreter cannot call. The
package never sets the switch: whoever runs it does, here after triton was imported.
"""
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU interpreter path")

SCRIPT = r"""
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
import torch
import triton                                    # imported first, in compiled mode, as torch may do
import triton.language as tl
os.environ["TRITON_INTERPRET"] = "1"             # the switch, set after triton was imported
from nanoserve.attention import decode_attention, decode_attention_ref, prefill_attention, prefill_attention_ref
torch.manual_seed(0)
B, H, KVH, D, bs = 2, 7, 1, 16, 16
kc, vc = torch.randn(8, bs, KVH, D), torch.randn(8, bs, KVH, D)
bt = torch.tensor([[3, 1, 5, 0], [2, 6, 4, 7]], dtype=torch.int32)
cl = torch.tensor([40, 17], dtype=torch.int32)
q = torch.randn(B, H, D)
for splits in (1, 4):
    out = decode_attention(q, kc, vc, bt, cl, D ** -0.5, 40, num_splits=splits)
    ref = decode_attention_ref(q, kc, vc, bt.long(), cl.long(), D ** -0.5)
    assert torch.allclose(out, ref, atol=1e-4), (splits, (out - ref).abs().max())
qp = torch.randn(9, H, D)
cu, st = torch.tensor([0, 6, 9], dtype=torch.int32), torch.tensor([10, 0], dtype=torch.int32)
out = prefill_attention(qp, kc, vc, bt, cu, st, 6, D ** -0.5)
ref = prefill_attention_ref(qp, kc, vc, bt.long(), cu, st, D ** -0.5)
assert torch.allclose(out, ref, atol=1e-4), (out - ref).abs().max()
print("ok")
"""


def test_kernels_run_when_triton_was_imported_before_the_interpreter_switch():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
