"""The db product (1 x c ones @ D, fp32 out) at MLM's single-chunk row count and aligned ones.

    python tools/probe_db_gemm.py

cuBLAS's choice of kernel for M = 1 depends on the reduction size K = c (the chunk's rows):
times K = 2458 (MLM's valid rows) against K rounded up to 8, 64 and 128, and BERT's 2048; then
(fifteenth session) the product against a column sum of D at 2464, 4096 and 8192 rows.
"""
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fused_ce.kernels import row_chunks  # noqa: E402

vp = 30592
d = torch.randn(4096, 2 * vp, device="cuda").view(torch.bfloat16)[:, :vp]  # D over Z's rows
ones = torch.ones(1, 16384, device="cuda", dtype=torch.bfloat16)
db = torch.zeros(1, vp, device="cuda")
print(torch.cuda.get_device_name(), torch.__version__)
for k in (2458, 2464, 2496, 2560, 2048):
    fn = lambda: row_chunks.gemm_f32(ones[:, :k], d[:k], db)  # noqa: E731
    ms = triton.testing.do_bench(fn, warmup=30, rep=200, return_mode="median")
    print(f"  db product K={k:<5} {ms * 1e3:7.1f} us  {k * vp * 2 / ms / 1e9:6.2f} TB/s", flush=True)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for k in (2458, 2464):
        row_chunks.gemm_f32(ones[:, :k], d[:k], db)
    torch.cuda.synchronize()
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        print("  kernel:", e.name[:90])

# Fifteenth session: the product against a column sum (torch.sum over the rows, fp32 result), on
# D over Z's rows (the fp32 logits path: row stride 2 vp) and on a contiguous D (the epilogue
# path), at MLM's rows and at the BERT chunks' (4096, 8192).
dense = torch.randn(8192, vp, device="cuda").to(torch.bfloat16)
for name, mat in (("D over Z", d), ("contiguous D", dense)):
    for k in (2464, 4096, 8192):
        if k > mat.shape[0]:
            continue
        dk = mat[:k]
        prod = lambda: row_chunks.gemm_f32(ones[:, :k], dk, db)  # noqa: E731
        col = lambda: torch.sum(dk, 0, dtype=torch.float32, out=db[0])  # noqa: E731
        ref = torch.sum(dk.float(), 0)
        col()
        err = ((db[0] - ref).abs().max() / ref.abs().max()).item()
        for label, fn in (("product", prod), ("column sum", col)):
            ms = triton.testing.do_bench(fn, warmup=30, rep=200, return_mode="median")
            print(f"  {name:13s} K={k:<5} {label:10s} {ms * 1e3:7.1f} us  "
                  f"{k * vp * 2 / ms / 1e9:6.2f} TB/s", flush=True)
        print(f"  {name:13s} K={k:<5} column sum max rel. error vs fp32 {err:.1e}")
