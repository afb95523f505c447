"""Time each step of the row-chunk path (row_chunks.py) at the BERT shape, one chunk size."""
import os, sys
import torch
import triton.testing
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fused_ce.kernels import row_chunks

def t(name, fn, flops=None):
    fn(); torch.cuda.synchronize()
    ms = triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")
    print(f"{name:<44} {ms:8.3f} ms" + (f"  {flops/ms/1e9:6.0f} TF/s" if flops else ""), flush=True)

n, h, v, c = 8192, 1024, 30258, 1368
vp = (v + 7) // 8 * 8
x = torch.randn(n, h, device="cuda").bfloat16(); w = (torch.randn(v, h, device="cuda") / 32).bfloat16()
b = torch.randn(v, device="cuda").bfloat16()
z = torch.empty(c, vp, device="cuda"); d = torch.empty(c, vp, device="cuda", dtype=torch.bfloat16)
xc = x[:c]; f = 2 * c * h * v
t("mm fp32-out strided (c x V, ld Vpad)", lambda: torch.mm(xc, w.t(), out_dtype=torch.float32, out=z[:, :v]), f)
z2 = torch.empty(c, v, device="cuda")
t("mm fp32-out contiguous (c x V)", lambda: torch.mm(xc, w.t(), out_dtype=torch.float32, out=z2), f)
t("mm bf16-out contiguous (c x V)", lambda: torch.mm(xc, w.t()), f)
wp = torch.zeros(vp, h, device="cuda", dtype=torch.bfloat16); wp[:v] = w
t("mm fp32-out padded W (c x Vpad)", lambda: torch.mm(xc, wp.t(), out_dtype=torch.float32, out=z), f)
t("mm bf16-out padded W (c x Vpad)", lambda: torch.mm(xc, wp.t()), f)
dc = d[:, :v]
dx = torch.empty(c, h, device="cuda", dtype=torch.bfloat16)
t("dx addmm (D[:, :V] @ W) beta0 alpha", lambda: torch.addmm(dx, dc, w, beta=0, alpha=1.0, out=dx), f)
t("dx mm (D[:, :Vpad] @ Wpad)", lambda: torch.mm(d, wp), f)
dw32 = torch.zeros(v, h, device="cuda")
t("dW32 addmm out_dtype fp32 (D^T x)", lambda: torch.addmm(dw32, dc.t(), xc, out_dtype=torch.float32, out=dw32), f)
dwp32 = torch.zeros(vp, h, device="cuda")
t("dW32 addmm out_dtype fp32 padded", lambda: torch.addmm(dwp32, d.t(), xc, out_dtype=torch.float32, out=dwp32), f)
t("dW bf16 mm (D^T x) padded", lambda: torch.mm(d.t(), xc), f)
tgt = torch.randint(0, v, (n,), device="cuda"); idx = torch.arange(n, device="cuda")
cf = [torch.full((n,), 1.0 / n, device="cuda") for _ in range(4)]
sc = torch.ones(1, device="cuda"); st = [torch.empty(n, device="cuda") for _ in range(4)]
am = torch.empty(n, device="cuda", dtype=torch.long)
for bv, nw in ((2048, 8), (1024, 4), (4096, 8), (8192, 16)):
    t(f"finish_rows_kernel BLOCK_V={bv} warps={nw}", lambda: row_chunks.finish_rows_kernel[(c,)](
        z, vp, d, vp, b, b, tgt, idx, 0, *cf, sc, *st, am, v, 1.0, HAS_BIAS=True,
        HAS_SOFTCAP=False, HAS_CW=False, WITH_WS=False, NEED_D=True, BLOCK_V=bv, num_warps=nw))
print("bytes finish (r Z twice, w D):", c * vp * 10 / 1e9, "GB")
