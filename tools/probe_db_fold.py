"""Probe (seventeenth session): db folded into the dW product by a ones column on x.

    python tools/probe_db_fold.py

dW32 = D^T x_c and db32 = D^T 1 are two products over the same D (the gemv reads all of D
again: 0.24 ms at BERT's 8192 rows on the H100, NOTES.md #43). With x_c extended by a ones
column (and zeros up to a multiple of 8 columns, for aligned rows) one product gives both:
dW in columns [0, H), db in column H. Times, per BERT chunk size c: the dW product alone (fp32
out), the gemv, and the extended product; the extended product's db against the gemv's.
"""
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fused_ce.kernels import row_chunks  # noqa: E402


def ms(fn):
    return triton.testing.do_bench(fn, warmup=30, rep=200, return_mode="median")


print(torch.cuda.get_device_name(), torch.__version__)
vp, h = 30592, 1024
he = h + 8
for c in (8192, 4096, 2464):
    d = (torch.randn(c, vp, device="cuda") * 1e-3).to(torch.bfloat16)
    x = torch.randn(c, h, device="cuda").to(torch.bfloat16)
    xe = torch.zeros(c, he, device="cuda", dtype=torch.bfloat16)
    xe[:, :h] = x
    xe[:, h] = 1
    ones = torch.ones(1, c, device="cuda", dtype=torch.bfloat16)
    dw = torch.empty(vp, h, device="cuda")
    dwe = torch.empty(vp, he, device="cuda")
    db = torch.empty(1, vp, device="cuda")
    t_dw = ms(lambda: row_chunks.gemm_f32(d.t(), x, dw))
    t_db = ms(lambda: row_chunks.gemm_f32(ones, d, db))
    t_dwe = ms(lambda: row_chunks.gemm_f32(d.t(), xe, dwe))
    t_acc = ms(lambda: row_chunks.gemm_f32(d.t(), x, dw, accumulate=True))
    t_acce = ms(lambda: row_chunks.gemm_f32(d.t(), xe, dwe, accumulate=True))
    t_cp = ms(lambda: xe[:, :h].copy_(x))
    row_chunks.gemm_f32(ones, d, db)
    row_chunks.gemm_f32(d.t(), xe, dwe)
    err = ((dwe[:, h] - db[0]).abs().max() / db.abs().max()).item()
    print(f"c={c}: dW {t_dw:.3f} + db {t_db:.3f} = {t_dw + t_db:.3f} ms; extended {t_dwe:.3f} "
          f"(+ x copy {t_cp:.3f}); accumulating dW {t_acc:.3f} + db vs extended {t_acce:.3f}; "
          f"db difference {err:.1e}", flush=True)
