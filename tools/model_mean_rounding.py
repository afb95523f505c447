"""CPU model (twenty-second session, NOTES.md #64): dX of a mean loss with D rounded to bf16, when
the mean's 1/n is folded into D (before) or divided out after the products (after), against fp64.

    python tools/model_mean_rounding.py
"""
import torch, math
torch.manual_seed(0)
n, h, v = 4096, 1024, 30522
x = torch.randn(n, h).bfloat16().double(); w = (torch.randn(v, h)/math.sqrt(h)).bfloat16().double()
b = torch.randn(v).bfloat16().double()
t = torch.randint(0, v, (n,))
valid = torch.rand(n) >= 0.85
xs, ts = x[valid][:700], t[valid][:700]
z = xs @ w.t() + b
p = torch.softmax(z, 1)
oh = torch.zeros_like(p); oh[torch.arange(len(ts)), ts] = 1
def rel(a, r): return ((a - r).norm() / r.norm()).item()
bf = lambda a: a.to(torch.bfloat16).double()
for nv in (600, 610, 614, 620, 640, 683, 700):
    D = (p[:nv] - oh[:nv]) / nv
    ref = 0.37 * D @ w
    ours = bf(0.37 * (bf(D.float().double()) @ w))
    scaled = bf(0.37 / nv * (bf(D * nv) @ w))
    print(nv, '1/nv mantissa err %.2e' % abs(bf(torch.tensor(1.0/nv)).item()*nv - 1), 'now %.2e' % rel(ours, ref), 'scaled %.2e' % rel(scaled, ref))
