"""Probe (thirty-seventh session): the sweeps' logits-gradient kernel alone
(gradients._grad_logits, every row valid, x and D through descriptors) at the wide heads, with
D stored and without (STORE_D off, db's column sums written instead: what the GEMM and its
epilogue cost without D's store), against the same logits GEMM by cuBLAS (bf16 out). Median
ms (triton.testing.do_bench) and TFLOP/s of 2 N H width.

    python tools/probe_grad_logits.py [--shapes gemma2,llama3] [--width 16384]
"""
import argparse
import importlib

import torch
import triton

from fused_ce.kernels import config
from fused_ce.kernels.problem import Problem
from fused_ce.reference import GradCoefs

# (the package's attribute ``gradients`` is the function of that name)
gradients = importlib.import_module("fused_ce.kernels.gradients")
SHAPES = {"gemma2": (8192, 2304, 256000), "llama3": (16384, 4096, 128256)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="gemma2,llama3")
    ap.add_argument("--width", type=int, default=16384)
    args = ap.parse_args()
    for name in args.shapes.split(","):
        n, h, v = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        x = (torch.randn(n, h, device="cuda", generator=g) * 0.5).bfloat16()
        w = (torch.randn(v, h, device="cuda", generator=g) * 0.02).bfloat16()
        t = torch.randint(0, v, (n,), device="cuda", generator=g)
        p = Problem(x, w, None, t, -100, None, None)
        p.n_valid_host = n
        lse = torch.full((n,), 12.0, device="cuda")
        ones = torch.full((n,), 1.0 / n, device="cuda")
        zeros = torch.zeros(n, device="cuda")
        cf = gradients.row_coefs(p, GradCoefs(ones, zeros, ones, zeros))
        scale = gradients.grad_scale(p, cf)
        width = args.width
        d = torch.empty(n, width, dtype=x.dtype, device="cuda")
        flops = 2 * n * h * width

        m_tiles = triton.cdiv(n, config.current(h)["logits"]["BLOCK_M"])
        db_part = torch.empty(m_tiles, width, device="cuda")

        def run(store):  # (without D, the column sums db_part keep the GEMM from being dropped)
            gradients._grad_logits(p, lse, cf, scale, d, width, None if store else db_part, 0,
                                   n, 0, width, store_d=store, x_rows=x)

        out = torch.empty(n, width, dtype=x.dtype, device="cuda")
        timed = {"grad_logits, D stored": lambda: run(True),
                 "grad_logits, db sums only": lambda: run(False),
                 "cuBLAS x W^T, bf16 out": lambda: torch.mm(x, w[:width].t(), out=out)}
        print(f"== {name} {n}x{h}, {width} columns; config {config.current(h)['grad_logits']}",
              flush=True)
        for label, fn in timed.items():
            ms = triton.testing.do_bench(fn, warmup=50, rep=300)
            print(f"  {label:26s} {ms:8.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
