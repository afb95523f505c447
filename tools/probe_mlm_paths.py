"""Probe (fourteenth session): why the MLM shape (16384 rows, 15 % valid) is slower on the
epilogue logits path than with cuBLAS fp32 logits while bert8k/bert16k are faster: GPU time or
host time. Per path: wall ms per forward+backward (back to back, synchronized at the end), the
sum of the GPU kernels' time per step (torch.profiler), and the largest kernels.

    python tools/probe_mlm_paths.py [--shapes mlm,bert8k] [--steps 20]
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


def device_us(evt) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(evt, name):
            return getattr(evt, name)
    return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="mlm,bert8k")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for shape in args.shapes.split(","):
        x, w, b, t = bench.make_inputs(shape)
        params = [p for p in (x, w, b) if p is not None]
        for rnd in range(2):
            for method in ("fused_ce_epilogue", "fused_ce_fp32z"):
                step = bench.forward_backward(method, "ce", bench.method_fn(method, "ce", x, w, b,
                                                                             t), params)
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step()
                host = (time.perf_counter() - t0) / args.steps * 1e3
                torch.cuda.synchronize()
                wall = (time.perf_counter() - t0) / args.steps * 1e3
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.steps):
                        step()
                    torch.cuda.synchronize()
                evts = [e for e in prof.key_averages() if device_us(e) > 0]
                gpu = sum(device_us(e) for e in evts) / args.steps / 1e3
                launches = sum(e.count for e in evts) / args.steps
                print(f"{shape} round {rnd} {method:18s} wall {wall:6.3f} ms  host issue "
                      f"{host:6.3f} ms  GPU kernels {gpu:6.3f} ms  ({launches:.0f} per step)",
                      flush=True)
                if rnd == 1:
                    for e in sorted(evts, key=device_us, reverse=True)[:6]:
                        print(f"      {device_us(e) / args.steps / 1e3:7.3f} ms  "
                              f"{e.count / args.steps:4.1f}x  {e.key[:90]}")
        del x, w, b, t, params
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
