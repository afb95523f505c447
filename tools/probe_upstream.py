"""How a non-unit upstream gradient changes the gradients' error (H200 probe, eighth session).

The default CUDA path computes dX, dW and db in the forward for an upstream gradient of 1 and
rounds them to bf16 there; the backward multiplies by the actual upstream g and rounds again.
Prints, per shape and g, the relative (norm) errors against fp64 of: fused_ce, eager bf16
(bf16 logits), and eager with fp32 logits. fused_ce at g = 1 is what a single final rounding
gives (D's rounding does not depend on g), so fused(g) - fused(1) is the extra rounding's cost.

    python tools/probe_upstream.py [--ignored 0.85,0.0] [--ups 1,0.5,0.37,0.3333,0.00163]
                                   [--seeds 0,1]
"""

import argparse
import math

import torch
import torch.nn.functional as F

import fused_ce


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def inputs(n, h, v, ignored, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, h, device="cuda", generator=g) / math.sqrt(h)).bfloat16()
    b = torch.randn(v, device="cuda", generator=g).bfloat16()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[torch.rand(n, device="cuda", generator=g) < ignored] = -100
    return x, w, b, t


def grads(fn, x, w, b, t, up, dtype=None):
    ps = [p.detach().to(dtype or p.dtype).requires_grad_() for p in (x, w, b)]
    (fn(*ps, t) * up).backward()
    return [p.grad for p in ps]


def _numbers(text, kind):
    return [kind(v) for v in text.split(",")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ignored", default="0.85,0.0")
    ap.add_argument("--ups", default=f"1,0.5,0.37,{1 / 3},{1 / 613}")
    ap.add_argument("--seeds", default="0,1")
    args = ap.parse_args()
    methods = {
        "fused_ce": lambda x, w, b, t: fused_ce.linear_cross_entropy(x, w, t, linear_bias=b),
        "eager_bf16": lambda x, w, b, t: F.cross_entropy(F.linear(x, w, b), t),
        "eager_fp32_logits": lambda x, w, b, t: F.cross_entropy(F.linear(x, w, b).float(), t),
    }
    print("shape ignored g seed | " + " | ".join(f"{m} dx/dw/db" for m in methods))
    n, h, v = 4096, 1024, 30522
    for ignored in _numbers(args.ignored, float):
        for up in _numbers(args.ups, float):
            for seed in _numbers(args.seeds, int):
                x, w, b, t = inputs(n, h, v, ignored, seed)
                ref = grads(methods["eager_bf16"], x, w, b, t, up, torch.float64)
                row = []
                for name, fn in methods.items():
                    got = grads(fn, x, w, b, t, up)
                    row.append("/".join(f"{rel(a, r):.2e}" for a, r in zip(got, ref)))
                print(f"{n}x{h}x{v} {ignored} {up:.4g} {seed} | " + " | ".join(row))


if __name__ == "__main__":
    main()
