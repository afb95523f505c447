"""One device call: where the host (Python) time of one fused_ce forward+backward goes.

    python tools/profile_host.py [--shapes mlm,bert8k] [--methods fused_ce] [--rows 30]

Methods and shapes are benchmarks/bench.py's. Per (shape, method) it prints the wall time per
step run back to back (synchronized once at the end) and with a synchronize after every step,
the GPU busy time per step, the torch ops and CUDA runtime calls with the most own CPU time
(torch.profiler), and the Python functions with the most own time (cProfile). A step whose wall time exceeds its GPU busy time is host-bound:
the GPU waits for launches (and, after a host sync, for everything the host does next).
"""
import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from profile_hf_step import busy_ms  # noqa: E402
from profile_kernels import warm_steps  # noqa: E402


def wall_ms(step, iters: int, sync_each: bool) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
        if sync_each:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="mlm,bert8k")
    ap.add_argument("--methods", default="fused_ce")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rows", type=int, default=30)
    args = ap.parse_args()
    for shape, name, step in warm_steps(args.shapes, args.methods, warmup=5):
        back_to_back = wall_ms(step, args.iters, False)
        synced = wall_ms(step, args.iters, True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                step()
            torch.cuda.synchronize()
        ks = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        cpu_table = prof.key_averages().table(sort_by="self_cpu_time_total",
                                              row_limit=args.rows)
        prof_c = cProfile.Profile()
        prof_c.enable()
        for _ in range(args.iters):
            step()
        torch.cuda.synchronize()
        prof_c.disable()
        print(f"\n=== {shape} {name}: back-to-back {back_to_back:.3f} ms/step, synchronized "
              f"{synced:.3f} ms/step, GPU busy {busy_ms(ks) / 10:.3f} ms/step, "
              f"{len(ks) / 10:.0f} kernels/step")
        print("host: torch ops and CUDA runtime calls by own CPU time (10 steps)")
        print(cpu_table)
        s = io.StringIO()
        pstats.Stats(prof_c, stream=s).sort_stats("tottime").print_stats(args.rows)
        lines = s.getvalue().splitlines()
        start = next(i for i, ln in enumerate(lines) if "ncalls" in ln)
        print("\n".join(lines[start:start + args.rows + 1]))


if __name__ == "__main__":
    main()
