"""One device call: GPU time of the target scan (kernels/targets.py) per configuration.

    python tools/probe_scan.py

For N in 4096, 16384, 65536 (15 % valid, like MLM) and each scan configuration (one program in
ONE_BLOCK-row steps with one_warps warps, or the two-launch scan), the median GPU microseconds
of the scan's kernels per call (torch.profiler, 50 calls after a warm-up), and a check of the
result against torch's stable argsort.
"""
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fused_ce.kernels import config  # noqa: E402
from fused_ce.kernels.targets import scan_targets  # noqa: E402

VARIANTS = {"two launches": dict(ONE_PROGRAM_ROWS=0)}
for block, warps in ((2048, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)):
    VARIANTS[f"one program, {block} x {warps} warps"] = dict(ONE_BLOCK=block, one_warps=warps)


def gpu_us(fn, calls: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    ks = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
          and "kernel" in e.name]
    per_call = [0.0] * calls
    for i, e in enumerate(ks):
        per_call[i * calls // len(ks)] += e.time_range.end - e.time_range.start
    return statistics.median(per_call)


def main():
    base = dict(config.GPU["scan"])
    for n in (4096, 16384, 65536):
        t = torch.randint(0, 30522, (n,), device="cuda")
        t[torch.rand(n, device="cuda") > 0.15] = -100
        valid = t != -100
        want = torch.argsort((~valid).to(torch.int8), stable=True)
        for name, over in VARIANTS.items():
            cfg = {**base, **over}
            row_idx, counts = scan_targets(t, -100, 30522, cfg)
            ok = torch.equal(row_idx, want) and int(counts[0]) == int(valid.sum())
            us = gpu_us(lambda: scan_targets(t, -100, 30522, cfg))
            print(f"N={n:6d}  {name:32s} {us:7.1f} us GPU  {'ok' if ok else 'WRONG'}")


if __name__ == "__main__":
    main()
