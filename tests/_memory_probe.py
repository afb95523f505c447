"""Peak resident memory of one forward+backward, run in a fresh process by test_memory.py and by
examples/cpu_demo.py. Prints one JSON line: {"extra_peak_mib", "grads_mib", "seconds", "loss"}."""

import json
import resource
import sys
import time

import torch
import torch.nn.functional as F

import fused_ce


def main(mode: str, n: int, h: int, v: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(n, h, requires_grad=True)
    W = (torch.randn(v, h) / h ** 0.5).requires_grad_()
    t = torch.randint(0, v, (n,))
    # warm up libraries at a tiny size so their one-time allocations stay out of the peak
    fused_ce.linear_cross_entropy(x[:2], W[:5], t[:2] % 5).backward()
    F.cross_entropy(F.linear(x[:2], W[:5]), t[:2] % 5).backward()
    x.grad = W.grad = None
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    start = time.perf_counter()
    if mode == "fused":
        loss = fused_ce.linear_cross_entropy(x, W, t)
    else:
        loss = F.cross_entropy(F.linear(x, W), t)
    loss.backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    grads = (x.grad.numel() + W.grad.numel()) * 4 / 2**20
    print(json.dumps({"mode": mode, "extra_peak_mib": (peak - base) / 1024, "grads_mib": grads,
                      "seconds": seconds, "loss": loss.item()}))


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:5]))
