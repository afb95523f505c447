"""One device call: GPU time per kernel of one fused_ce forward+backward, per method and shape.

    python tools/profile_kernels.py [--shapes bert8k,mlm] [--methods fused_ce,fused_ce_lowmem]

Methods and shapes are benchmarks/bench.py's. Prints, per (shape, method), the wall time per
call, the GPU busy time and the kernels by total GPU time per call (torch.profiler).
"""
import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench  # noqa: E402
from profile_hf_step import busy_ms  # noqa: E402


def warm_steps(shapes: str, methods: str, warmup: int = 3):
    """(shape, method, step) for bench.py's comma-separated shapes and methods; ``step`` is one
    forward+backward, already run ``warmup`` times."""
    for shape in shapes.split(","):
        x, w, b, t = bench.make_inputs(shape)
        kind = bench.SHAPES[shape][5]
        params = [p for p in (x, w, b) if p is not None]
        for name in methods.split(","):
            step = bench.forward_backward(name, kind, bench.method_fn(name, kind, x, w, b, t),
                                          params)
            for _ in range(warmup):
                step()
            yield shape, name, step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="bert8k")
    ap.add_argument("--methods", default="fused_ce,fused_ce_sweep,fused_ce_lowmem")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--rows", type=int, default=12)
    args = ap.parse_args()
    for shape, name, step in warm_steps(args.shapes, args.methods):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(args.iters):
                step()
            torch.cuda.synchronize()
            wall = 1e3 * (time.perf_counter() - t0) / args.iters
        ks = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        print(f"\n=== {shape} {name}: {wall:.2f} ms/call profiled, GPU busy "
              f"{busy_ms(ks) / args.iters:.2f} ms, {len(ks) / args.iters:.0f} kernels/call")
        tot = {}
        for e in ks:
            k = e.name[:70]
            c, d = tot.get(k, (0, 0))
            tot[k] = (c + 1, d + (e.time_range.end - e.time_range.start))
        for k, (c, d) in sorted(tot.items(), key=lambda kv: -kv[1][1])[:args.rows]:
            print(f"  {d / 1e3 / args.iters:8.3f} ms  {c / args.iters:6.1f}x  {k}")


if __name__ == "__main__":
    main()
