"""CPU forward+backward of fused_ce against eager PyTorch and torch's own chunked
``F.linear_cross_entropy`` (torch >= 2.13, which the H200 image does not have).

    python benchmarks/cpu_peers.py --out benchmarks/results/cpu_peers.json
    python benchmarks/cpu_peers.py --shapes bert1k --methods fused_ce,torch_lce --reps 3

Every (shape, method) runs in its own process, so that its peak memory is its own: inputs are
built, one warm-up call runs, the process's peak resident set is reset (Linux
/proc/self/clear_refs), then one forward+backward with the gradient buffers cleared gives the
peak extra memory (peak RSS minus the RSS before the call, gradient buffers included), and
``--reps`` more give the median wall time. Errors are relative to float64 PyTorch on the same
float32 inputs: loss |a-b|/|b|, gradients ||a-b|| / ||b||. Prints a table and writes JSON
with date, CPU, thread count and versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = {
    # name: (N, H, V, bias, fraction of rows with a label): the GPU shapes' heads at fewer rows
    "bert1k": (1024, 1024, 30522, True, 1.0),
    "mlm2k": (2048, 1024, 30522, True, 0.15),
    "llama512": (512, 4096, 128256, False, 1.0),
}
METHODS = ["fused_ce", "fused_ce_lowmem", "eager", "torch_lce"]
MiB = 2**20


def make_inputs(shape: str, seed: int = 0):
    n, h, v, bias, frac = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) / math.sqrt(h)
    b = torch.randn(v, generator=g) * 0.5 if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    if frac < 1.0:
        t[torch.rand(n, generator=g) >= frac] = -100
    return [p if p is None else p.requires_grad_() for p in (x, w, b)] + [t]


def method_fn(name: str, x, w, b, t):
    if name in ("fused_ce", "fused_ce_lowmem"):
        import fused_ce
        low = name == "fused_ce_lowmem"
        return lambda: fused_ce.linear_cross_entropy(x, w, t, linear_bias=b, low_memory=low)
    if name == "eager":
        return lambda: F.cross_entropy(F.linear(x, w, b), t)
    if name == "torch_lce":
        if not hasattr(F, "linear_cross_entropy"):
            raise NotImplementedError(f"torch {torch.__version__} has no F.linear_cross_entropy")
        opts = torch.nn.LinearCrossEntropyOptions()  # the chunked path ("auto" policy)
        return lambda: F.linear_cross_entropy(x, w, t, linear_bias=b, options=opts)
    raise ValueError(f"--methods: unknown method {name!r}")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_one(shape: str, name: str, reps: int) -> dict:
    """Time, peak extra memory and errors of one method on one shape (in this process)."""
    x, w, b, t = make_inputs(shape)
    params = [p for p in (x, w, b) if p is not None]
    fn = method_fn(name, x, w, b, t)

    def step():
        for p in params:
            p.grad = None
        loss = fn()
        loss.backward()
        return loss

    step()  # warm-up (lazy imports, allocator)
    for p in params:
        p.grad = None
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    before = _status_kib("VmRSS")
    loss = step()
    peak = (_status_kib("VmHWM") - before) * 1024 / MiB
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    got = [loss.detach().double()] + [p.grad.double() for p in params]
    ref_params = [p.detach().double().requires_grad_() for p in params]
    xd, wd = ref_params[0], ref_params[1]
    bd = ref_params[2] if b is not None else None
    ref_loss = F.cross_entropy(F.linear(xd, wd, bd), t)
    ref_loss.backward()
    errors = {"loss": abs((got[0] - ref_loss.detach()) / ref_loss.detach()).item()}
    for key, g, r in zip(("dx", "dw", "db"), got[1:], ref_params):
        errors[key] = ((g - r.grad).norm() / r.grad.norm()).item()
    return {"shape": shape, "method": name, "ms": 1e3 * statistics.median(times),
            "ms_all": [1e3 * s for s in times], "peak_mib": peak, "errors": errors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", help="JSON file for the results")
    ap.add_argument("--one", nargs=2, metavar=("SHAPE", "METHOD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # the child process: one measurement, as JSON on the last line
        print(json.dumps(measure_one(*args.one, args.reps)))
        return
    for s in args.shapes.split(","):
        if s not in SHAPES:
            ap.error(f"--shapes: unknown shape {s!r}; expected some of {sorted(SHAPES)}")
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "cpu": _cpu_model(), "threads": torch.get_num_threads(),
            "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "command": " ".join(["benchmarks/cpu_peers.py"] + sys.argv[1:])}
    print(meta)
    print(f"{'shape':10s}  {'method':16s} {'ms':>9s} {'peak MiB':>9s}  errors")
    rows = []
    for shape in args.shapes.split(","):
        for name in args.methods.split(","):
            proc = subprocess.run([sys.executable, __file__, "--one", shape, name,
                                   "--reps", str(args.reps)], capture_output=True, text=True)
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or ["?"])[-1]
                print(f"{shape:10s}  {name:16s} failed: {last}")
                rows.append({"shape": shape, "method": name, "error": last})
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            errs = " ".join(f"{k}={v:.2e}" for k, v in r["errors"].items())
            print(f"{shape:10s}  {name:16s} {r['ms']:9.1f} {r['peak_mib']:9.0f}  {errs}")
            rows.append(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "shapes": {s: SHAPES[s] for s in args.shapes.split(",")},
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
