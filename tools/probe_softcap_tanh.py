"""The softcap's tanh on the Triton path against fp64 and eager fp32 (README, "Known
differences"): fp32 inputs, relative errors of the loss and dX, for caps far above the logits
and for Gemma-2's cap of 30. On a CPU, under the interpreter:
``TRITON_INTERPRET=1 FUSED_CE_BACKEND=triton python tools/probe_softcap_tanh.py``; on a GPU:
``python tools/probe_softcap_tanh.py --device cuda``."""

import argparse

import torch
import torch.nn.functional as F

import fused_ce


def rel(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


def one(cap, x_scale, w_scale, smoothing, device, n=64, h=32, v=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (x_scale * torch.randn(n, h, generator=g)).to(device)
    w = (w_scale * torch.randn(v, h, generator=g)).to(device)
    t = torch.randint(0, v, (n,), generator=g).to(device)

    def loss_and_dx(fn, xx):
        xx = xx.detach().clone().requires_grad_()
        loss = fn(xx)
        return loss, torch.autograd.grad(loss, xx)[0]

    def capped(xx, dtype):
        z = F.linear(xx, w.to(dtype))
        return F.cross_entropy(cap * torch.tanh(z / cap), t, label_smoothing=smoothing)

    ours = loss_and_dx(lambda xx: fused_ce.linear_cross_entropy(
        xx, w, t, softcap=cap, label_smoothing=smoothing), x)
    want = loss_and_dx(lambda xx: capped(xx, torch.float64), x.double())
    eager = loss_and_dx(lambda xx: capped(xx, torch.float32), x)
    mean_z = F.linear(x.double(), w.double()).abs().mean().item()
    print(f"cap {cap:6g}  mean |logit| {mean_z:6.2f}  smoothing {smoothing}:  "
          f"loss {rel(ours[0], want[0]):.1e} (eager {rel(eager[0], want[0]):.1e})  "
          f"dX {rel(ours[1], want[1]):.1e} (eager {rel(eager[1], want[1]):.1e})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    for cap, x_scale, w_scale in [(1000, 0.1, 0.1), (1000, 1, 1), (30, 0.3, 0.3), (30, 1, 1),
                                  (30, 1, 3)]:
        for smoothing in (0.0, 1.0):
            one(cap, x_scale, w_scale, smoothing, args.device)


if __name__ == "__main__":
    main()
