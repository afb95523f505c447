"""CPU model (thirty-second session, NOTES.md #94): the gradients' error if the logits GEMM's
epilogue wrote E = exp(z - L_r) with one reference L_r per row (instead of the tile's own max),
so that D = coef_r exp(L_r - lse_r) E - onehot is E scaled per row and the D pass could go:

    dX = s (E W) - W[t]          s_r = exp(L_r - lse_r); the fp32 product's rows scaled, the
                                 target term subtracted in fp32 (not rounded into D)
    dW = E^T bf16(s x) - onehot^T x

against today's D = bf16(p - onehot), dX = D W, dW = D^T x; every product exact (fp64) and
rounded once to bf16, as cuBLAS's fp32 output and scale.py's one rounding do. The new error is
x's rows scaled by s and rounded to bf16 (dW); L_r may be the row's max (exact: the max entry
of E is 1), the target logit (a lower bound) or above the max (an upper bound such as
Cauchy-Schwarz's).

    python tools/model_row_scale.py
"""
import math

import torch

from model_mean_rounding import bf16, rel  # (this folder: the script's own)


def main():
    torch.manual_seed(0)
    n, h, v = 1024, 1024, 30522
    print("logit scale, L_r: dX / dW error against fp64 for D rounded (today), E rounded and "
          "s x rounded (row scale), the exact gradients rounded once")
    for scale, ref_kind in ((1.0, "max"), (4.0, "max"), (4.0, "target"), (4.0, "max + 20")):
        x = torch.randn(n, h).bfloat16().double()
        w = (torch.randn(v, h) * scale / math.sqrt(h)).bfloat16().double()
        t = torch.randint(0, v, (n,))
        z = x @ w.t()
        lse = torch.logsumexp(z, 1, keepdim=True)
        p = torch.exp(z - lse)
        onehot = torch.zeros_like(p)
        onehot[torch.arange(n), t] = 1
        ref_dx, ref_dw = (p - onehot) @ w, (p - onehot).t() @ x
        d = bf16(p - onehot)
        today = rel(bf16(d @ w), ref_dx), rel(bf16(d.t() @ x), ref_dw)
        zmax = z.max(1, keepdim=True).values
        ref_logit = {"max": zmax, "target": z.gather(1, t[:, None]), "max + 20": zmax + 20}
        e = bf16(torch.exp(z - ref_logit[ref_kind]))
        s = torch.exp(ref_logit[ref_kind] - lse)
        row_scale = (rel(bf16(s * (e @ w) - w[t]), ref_dx),
                     rel(bf16(e.t() @ bf16(s * x) - onehot.t() @ x), ref_dw))
        once = rel(bf16(ref_dx), ref_dx), rel(bf16(ref_dw), ref_dw)
        print(f"{scale:3.0f} {ref_kind:9s} today {today[0]:.3e} / {today[1]:.3e}   row scale "
              f"{row_scale[0]:.3e} / {row_scale[1]:.3e}   rounded once {once[0]:.3e} / "
              f"{once[1]:.3e}", flush=True)


if __name__ == "__main__":
    main()
