"""Peak resident memory of one forward+backward, run in a fresh process by test_memory.py and by
examples/cpu_demo.py. Prints one JSON line: {"extra_peak_mib", "grads_mib", "seconds", "loss"}."""

import json
import resource
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import fused_ce


def _status_kib(field: str) -> int:
    """A ``VmRSS``/``VmHWM`` line of /proc/self/status, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def start_peak_kib() -> int:
    """Start measuring the resident-set peak; returns the baseline (KiB). On Linux the peak
    (VmHWM) is reset to the current RSS first (``/proc/self/clear_refs`` 5), so an earlier,
    higher peak (imports) cannot hide the one measured; elsewhere the baseline is the peak so
    far (``ru_maxrss``: bytes on macOS, KiB on Linux), which can only understate the growth."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status_kib("VmRSS")
    except OSError:
        return _maxrss_kib()


def peak_kib() -> int:
    """The resident-set peak since ``start_peak_kib`` (KiB)."""
    try:
        return _status_kib("VmHWM")
    except OSError:
        return _maxrss_kib()


def _maxrss_kib() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r // 1024 if sys.platform == "darwin" else r


def main(mode: str, n: int, h: int, v: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(n, h, requires_grad=True)
    W = (torch.randn(v, h) / h ** 0.5).requires_grad_()
    t = torch.randint(0, v, (n,))
    # warm up libraries at a tiny size so their one-time allocations stay out of the peak
    fused_ce.linear_cross_entropy(x[:2], W[:5], t[:2] % 5).backward()
    F.cross_entropy(F.linear(x[:2], W[:5]), t[:2] % 5).backward()
    x.grad = W.grad = None
    base = start_peak_kib()
    start = time.perf_counter()
    if mode == "fused":
        loss = fused_ce.linear_cross_entropy(x, W, t)
    else:
        loss = F.cross_entropy(F.linear(x, W), t)
    loss.backward()
    seconds = time.perf_counter() - start
    peak = peak_kib()
    grads = (x.grad.numel() + W.grad.numel()) * 4 / 2**20
    print(json.dumps({"mode": mode, "extra_peak_mib": (peak - base) / 1024, "grads_mib": grads,
                      "seconds": seconds, "loss": loss.item()}))


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:5]))
