"""CPU model (twenty-second session, NOTES.md #64): dX of a mean loss with D rounded to bf16, when
the mean's 1/n is folded into D (before, "now") or divided out after the products (after,
"scaled"), against fp64. The GPU's arithmetic: D rounded to nearest, exact products, one final
rounding of g * dX.

    python tools/model_mean_rounding.py
"""
import math

import torch

G = 0.37  # the upstream gradient


def rel(a, ref):
    return ((a - ref).norm() / ref.norm()).item()


def bf16(a):
    """``a`` rounded to bf16 (to nearest), back in fp64."""
    return a.to(torch.bfloat16).double()


def main():
    torch.manual_seed(0)
    n, h, v = 4096, 1024, 30522
    x = torch.randn(n, h).bfloat16().double()
    w = (torch.randn(v, h) / math.sqrt(h)).bfloat16().double()
    b = torch.randn(v).bfloat16().double()
    t = torch.randint(0, v, (n,))
    valid = torch.rand(n) >= 0.85
    xs, ts = x[valid][:700], t[valid][:700]
    p = torch.softmax(xs @ w.t() + b, 1)
    onehot = torch.zeros_like(p)
    onehot[torch.arange(len(ts)), ts] = 1
    for nv in (600, 610, 614, 620, 640, 683, 700):
        d = (p[:nv] - onehot[:nv]) / nv  # dz of the mean over nv rows
        ref = G * d @ w
        folded = bf16(G * (bf16(d.float().double()) @ w))
        divided = bf16(G / nv * (bf16(d * nv) @ w))
        inv_err = abs(bf16(torch.tensor(1.0 / nv)).item() * nv - 1)
        print(nv, '1/nv mantissa err %.2e' % inv_err, 'now %.2e' % rel(folded, ref),
              'scaled %.2e' % rel(divided, ref))


if __name__ == "__main__":
    main()
