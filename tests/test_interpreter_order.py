"""The package's Triton kernels run through the interpreter even in a process that imported triton before the
interpreter flag was set (as a notebook run after another that imported transformers can be): there, Triton's own
jit helpers (`tl.max`, `tl.sum`, ...) were compiled for the GPU and cannot be called from an interpreted kernel. The
kernels reduce with the runtime chapter's helpers (`nanoserve.runtime`: `row_max`, `add_fn`, `sum_last`, ...),
defined after the flag. The package reads the flag and never sets it: whoever runs the code does, as here."""
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import os
os.environ.pop("TRITON_INTERPRET", None)
import triton                                   # imported first, with the interpreter off
os.environ["TRITON_INTERPRET"] = "1"
import torch
from nanoserve.fused import add_rmsnorm, argmax_rows, gemv
torch.manual_seed(0)
x = torch.randn(3, 5000)
x[1, 7] = x[1, 4000] = 100.0                    # a tie: the first index wins
assert argmax_rows(x, 256).tolist() == x.argmax(-1).tolist()
assert argmax_rows(x[:1], 8192).tolist() == x[:1].argmax(-1).tolist()      # one part: no merge
h, w, nw = torch.randn(1, 96), torch.randn(40, 96), torch.rand(96) + 0.5
out, _ = gemv(h, w, norm=(nw, 1e-6))
assert torch.allclose(out, torch.nn.functional.linear(add_rmsnorm(h, None, nw, 1e-6), w), atol=1e-5)
print("ok")
"""


def test_kernels_run_when_triton_was_imported_before_the_flag():
    root = Path(__file__).parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
