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
    built()


def built():
    """The scheme as built (thirty-third session, fused_ce/kernels/row_ref.py): L_r the target
    logit, E's target entry 0 and the target term D_t (fp32) added to the products' results:
    dX = s (E W) + D_t W_t, dW = E^T bf16(s x) + onehot^T (D_t x). Against today's D, the
    scheme above (E's target entry kept, -1 added after the products: "after") and E's target
    entry set to D_t / s_r ("D_t / s in E": the target term then goes through bf16(s x) and a
    second rounding), on random rows and on a trained model's rows (a third with p_t ~ 0.999,
    a third ~ 0.2: x's row pulled toward W_t), where D_t = p_t - 1 is small."""
    torch.manual_seed(1)
    n, h, v = 1024, 1024, 30522
    print("rows: dX / dW error against fp64: today's D | target term after the products | "
          "D_t / s in E | as built (target terms apart)")
    for kind in ("random", "confident"):
        w = (torch.randn(v, h) / math.sqrt(h)).bfloat16().double()
        t = torch.randint(0, v, (n,))
        x = torch.randn(n, h).double()
        if kind == "confident":
            pull = torch.where(torch.arange(n)[:, None] % 3 == 0, 16.0,
                               torch.where(torch.arange(n)[:, None] % 3 == 1, 8.0, 0.0))
            x = 0.5 * x + pull * w[t]
        x = x.bfloat16().double()
        z = x @ w.t()
        lse = torch.logsumexp(z, 1, keepdim=True)
        p = torch.exp(z - lse)
        rows = torch.arange(n)
        onehot = torch.zeros_like(p)
        onehot[rows, t] = 1
        ref_dx, ref_dw = (p - onehot) @ w, (p - onehot).t() @ x
        d = bf16(p - onehot)
        today = rel(bf16(d @ w), ref_dx), rel(bf16(d.t() @ x), ref_dw)
        zt = z.gather(1, t[:, None])
        s = torch.exp(zt - lse)
        e = bf16(torch.exp(z - zt))
        sx = bf16(s * x)
        after = (rel(bf16(s * (e @ w) - w[t]), ref_dx),
                 rel(bf16(e.t() @ sx - onehot.t() @ x), ref_dw))
        dt = (p[rows, t] - 1)[:, None]
        e_t = e.clone()
        e_t[rows, t] = bf16(dt[:, 0] / s[:, 0])
        in_e = rel(bf16(s * (e_t @ w)), ref_dx), rel(bf16(e_t.t() @ sx), ref_dw)
        e[rows, t] = 0
        built = (rel(bf16(s * (e @ w) + dt * w[t]), ref_dx),
                 rel(bf16(e.t() @ sx + onehot.t() @ (dt * x)), ref_dw))
        pt = p[rows, t]
        print(f"{kind:9s} (median p_t {pt.median().item():.3g}): today {today[0]:.3e} / "
              f"{today[1]:.3e} | after {after[0]:.3e} / {after[1]:.3e} | D_t / s in E "
              f"{in_e[0]:.3e} / {in_e[1]:.3e} | as built {built[0]:.3e} / {built[1]:.3e}",
              flush=True)


if __name__ == "__main__":
    main()
