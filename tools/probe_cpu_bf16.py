"""Probe (twenty-second session): bf16 inputs on a CPU with bf16 matrix units (AMX).

    python tools/probe_cpu_bf16.py

The PyTorch path runs every GEMM in fp32 (inputs up-cast), so its logits are exact to fp32
rounding. torch's CPU GEMMs on bf16 inputs accumulate in fp32 but round their output to bf16,
and torch 2.13 has no bf16 x bf16 -> fp32 product on the CPU (``mm(..., out_dtype=)`` is
CUDA-only). Part 1 times one logits-sized product each way, and a two-GEMM split that keeps
more digits in bf16: z_hi = bf16(x W^T), then r = bf16(x W^T - z_hi) by ``addmm(z_hi, x, W^T,
beta=-1)`` (one rounding of the fp32 accumulator, if oneDNN applies beta there), z ~ z_hi + r.
Part 2 times the whole loss (forward + backward) against eager bf16 at cpu_peers' shapes.
"""
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import fused_ce  # noqa: E402
from cpu_peers import make_inputs  # noqa: E402


def seconds(fn, reps=5):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


def gemm_part():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 1024, generator=g).bfloat16()
    w = (torch.randn(30522, 1024, generator=g) / 32).bfloat16()
    ref = x.double() @ w.double().t()
    xf, wf = x.float(), w.float()
    z_hi = x @ w.t()
    r = torch.addmm(z_hi, x, w.t(), beta=-1)
    print("logits product 1024 x 1024 x 30522: seconds, relative error (Frobenius) vs fp64")
    print(f"  bf16 out          {seconds(lambda: x @ w.t()):.3f} s  {rel(z_hi, ref):.2e}")

    def hi_lo():
        hi = x @ w.t()
        return hi, torch.addmm(hi, x, w.t(), beta=-1)

    print(f"  bf16 hi + lo      {seconds(hi_lo):.3f} s  {rel(z_hi.float() + r.float(), ref):.2e}")
    print(f"  fp32 (up-cast)    {seconds(lambda: xf @ wf.t()):.3f} s  {rel(xf @ wf.t(), ref):.2e}")


def loss_part():
    print("forward + backward, bf16 inputs: seconds (median of 5)")
    for shape in ("bert1k", "mlm2k"):
        x, w, b, t = make_inputs(shape)
        x, w = (p.detach().bfloat16().requires_grad_() for p in (x, w))
        b = None if b is None else b.detach().bfloat16().requires_grad_()

        def step(fn):
            def run():
                for p in (x, w, b):
                    if p is not None:
                        p.grad = None
                fn().backward()
            return run

        fused = step(lambda: fused_ce.linear_cross_entropy(x, w, t, linear_bias=b))
        eager = step(lambda: F.cross_entropy(F.linear(x, w, b).float(), t))
        print(f"  {shape}: fused_ce {seconds(fused):.3f} s, eager bf16 {seconds(eager):.3f} s")


if __name__ == "__main__":
    print(torch.__version__, torch.get_num_threads(), "threads,",
          "AMX" if "amx_bf16" in open("/proc/cpuinfo").read() else "no AMX")
    gemm_part()
    loss_part()
