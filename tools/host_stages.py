"""One device call: the host time of one fused_ce forward+backward, stage by stage.

    python tools/host_stages.py [--shapes mlm,bert8k] [--steps 200]

Methods and shapes are benchmarks/bench.py's (method fused_ce). Wraps the stages of the call
(the API's checks and coefficients, kernels.forward and its parts, the backward's scaling)
with perf_counter stamps, runs the steps back to back (no synchronize but the path's own host
read) and prints per stage the median host microseconds per step (inclusive of the stages it
calls) and how often it ran; the host read's wait is listed apart, so that the host's busy
time is the step minus the wait. Then the host cost of single torch ops and launches on this
machine (median us per call, no synchronize), to rank what a removed op saves.
"""
import argparse
import collections
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench  # noqa: E402
import fused_ce  # noqa: E402
from fused_ce import _validation, api, kernels, ops  # noqa: E402
from fused_ce.kernels import config, logits_tiles, problem, row_chunks, scale  # noqa: E402

SPENT = collections.defaultdict(float)
CALLS = collections.Counter()


def timed(label, fn):
    def wrapper(*args, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            SPENT[label] += time.perf_counter() - t0
            CALLS[label] += 1
    return wrapper


def wrap(obj, name, label=None):
    setattr(obj, name, timed(label or name, getattr(obj, name)))


# the stages timed: (module or class, its attributes); fused_ce.linear_cross_entropy is the API
STAGES = (
    (fused_ce, "linear_cross_entropy"),
    (_validation, "check_linear check_loss_options check_dtypes"),
    (api, "_coefficients _cast_for_autocast"),
    (ops, "_sum_backward _row_loss loss_sum _plain_eager backend_for"),
    (ops._LinearCeSum, "apply"),
    (kernels, "forward _row_chunks row_coefs _count_read scale_into total_loss"),
    (kernels.CountRead, "wait __init__"),  # (the host read's wait: listed apart)
    (problem.Problem, "__init__"),
    (problem, "scan_targets"),
    (row_chunks, "forward_with_grads _sweep_chunks _padded_bias gemm_f32 _tile_workspace"),
    (logits_tiles.TileStats, "__init__ logits finish"),
    (logits_tiles, "launch"),
    (row_chunks._Outputs, "__init__ zero_ignored"),
    (row_chunks._FirstTileChunk, "__init__"),  # the speculative first-chunk GEMM
)


def triton_kernels():
    """(module name, kernel name, JITFunction) of every Triton kernel of fused_ce.kernels."""
    import triton
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("fused_ce.kernels.") or mod is None:
            continue
        for name, obj in vars(mod).items():
            if isinstance(obj, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                yield mod_name.rsplit(".", 1)[1], name, obj


def instrument():
    for obj, names in STAGES:
        where = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__
        for name in names.split():
            label = f"{where.replace('fused_ce.', '')}.{name}"
            wrap(obj, name, ("WAIT " if label == "CountRead.wait" else "") + label)
    seen = set()
    for mod_name, name, fn in triton_kernels():  # each launch's host time
        if id(fn) not in seen:
            seen.add(id(fn))
            wrap(fn, "run", f"launch {mod_name}.{name}")


def step_seconds(params, loss_fn) -> tuple[float, float]:
    """Host seconds of one ``loss_fn()`` (the gradients cleared first) and of its backward."""
    for p in params:
        p.grad = None
    t0 = time.perf_counter()
    loss = loss_fn()
    t1 = time.perf_counter()
    loss.backward()
    return t1 - t0, time.perf_counter() - t1


def stages(shape: str, steps: int):
    x, w, b, t = bench.make_inputs(shape)
    fn = bench.method_fn("fused_ce", "ce", x, w, b, t)
    params = [p for p in (x, w, b) if p is not None]
    per_step = collections.defaultdict(list)
    walls, fwd, bwd = [], [], []
    for i in range(steps + 10):
        SPENT.clear()
        CALLS.clear()
        f_s, b_s = step_seconds(params, fn)
        if i >= 10:
            walls.append(f_s + b_s)
            fwd.append(f_s)
            bwd.append(b_s)
            for k, v in SPENT.items():
                per_step[k].append((v, CALLS[k]))
    torch.cuda.synchronize()
    med = lambda xs: 1e6 * statistics.median(xs)  # noqa: E731
    wait = [v for v, _ in per_step.get("WAIT CountRead.wait", [(0.0, 0)] * len(walls))]
    print(f"\n=== {shape}: host us per step (median of {steps}, back to back): step "
          f"{med(walls):.0f} (forward {med(fwd):.0f}, backward {med(bwd):.0f}), "
          f"of which waiting for the host read {med(wait):.0f}; busy "
          f"{med([a - c for a, c in zip(walls, wait)]):.0f}")
    for k in sorted(per_step, key=lambda k: -statistics.median(v for v, _ in per_step[k])):
        vals = per_step[k]
        print(f"  {med([v for v, _ in vals]):8.1f}  x{vals[0][1]:<3d} {k}")


def op_costs(reps: int = 300):
    dev = "cuda"
    n, h, v = 16384, 1024, 30592
    d = torch.tensor(5.0, device=dev)
    loss = torch.tensor(3.0, device=dev)
    t = torch.randint(0, v, (n,), device=dev)
    valid = t != -100
    vf = valid.float()
    x = torch.randn(2048, h, device=dev, dtype=torch.bfloat16)
    wt = torch.randn(h, 512, device=dev, dtype=torch.bfloat16)
    z = torch.empty(2048, 512, device=dev)
    idx = torch.randperm(2048, device=dev)
    src = torch.randn(4096, device=dev)
    g = torch.ones(1, device=dev)
    counts = torch.zeros(2, dtype=torch.int32, device=dev)
    cases = {
        "torch.empty(n)": lambda: torch.empty(n, device=dev),
        "torch.zeros(n)": lambda: torch.zeros(n, device=dev),
        "torch.ones(())": lambda: torch.ones((), device=dev),
        "t != -100": lambda: t != -100,
        "valid.to(float32)": lambda: valid.to(torch.float32),
        "vf.sum()": lambda: vf.sum(),
        "d.clamp_min(1)": lambda: d.clamp_min(1),
        "loss / d": lambda: loss / d,
        "torch.where(d == 0, nan, 0.0)": lambda: torch.where(d == 0, math.nan, 0.0),
        "zeros_like(vf)": lambda: torch.zeros_like(vf),
        "x.index_select(0, idx)": lambda: x.index_select(0, idx),
        "addmm out_dtype=fp32 (2048x512x1024)": lambda: torch.addmm(
            z, x, wt, beta=0.0, out_dtype=torch.float32, out=z),
        "scale_into (one 4096 fp32 tensor)": lambda: scale.scale_into([src], [torch.bfloat16], g),
        "torch.cuda.Event().record()": lambda: torch.cuda.Event().record(),
        "pinned torch.empty(2)": lambda: torch.empty(2, dtype=torch.int32, pin_memory=True),
        "kernels.total_loss (n rows, mean)": lambda: kernels.total_loss(vf, d, d),
        "kernels.scan_targets (n rows)": lambda: kernels.scan_targets(t, -100, v),
        "kernels.CountRead(counts)": lambda: kernels.CountRead(counts),
        "ops.backend_for(x)": lambda: ops.backend_for(x),
        "config.capability(x.device)": lambda: config.capability(x.device),
    }
    print_host_us("host us per call", cases, reps)


def gemm_costs(reps: int = 200):
    """Host us of the row-chunk path's GEMM calls at MLM's one chunk (2458 rows): as
    gemm_f32 makes them (addmm with out_dtype, out a strided view of Z) and variants."""
    dev = "cuda"
    n, h, v, vp = 2458, 1024, 30522, 30528
    v64 = v // 64 * 64
    x = torch.randn(n, h, device=dev, dtype=torch.bfloat16)
    w = torch.randn(v, h, device=dev, dtype=torch.bfloat16)
    z = torch.empty(n, vp, device=dev)
    zc = torch.empty(n, v64, device=dev)
    d = z.view(torch.bfloat16)[:, :v]
    dx = torch.empty(n, h, device=dev)
    dw = torch.empty(v, h, device=dev)
    cases = {
        "gemm_f32 logits (out strided)": lambda: row_chunks.gemm_f32(x, w[:v64].t(), z[:, :v64]),
        "addmm beta=0 logits, out contiguous": lambda: torch.addmm(
            zc, x, w[:v64].t(), beta=0.0, out_dtype=torch.float32, out=zc),
        "mm out_dtype logits, out strided": lambda: torch.mm(
            x, w[:v64].t(), out_dtype=torch.float32, out=z[:, :v64]),
        "mm out_dtype logits, out contiguous": lambda: torch.mm(
            x, w[:v64].t(), out_dtype=torch.float32, out=zc),
        "mm bf16 logits (no out_dtype)": lambda: torch.mm(x, w[:v64].t()),
        "gemm_f32 dX (D strided)": lambda: row_chunks.gemm_f32(d[:, :v64], w[:v64], dx),
        "gemm_f32 dX tail accumulate": lambda: row_chunks.gemm_f32(d[:, v64:], w[v64:], dx,
                                                                   accumulate=True),
        "gemm_f32 dW": lambda: row_chunks.gemm_f32(d[:, :v64].t(), x, dw[:v64]),
    }
    print_host_us("host us per GEMM call", cases, reps)


def print_host_us(title: str, cases: dict, reps: int):
    """Median host microseconds of each call (after a warm-up; the GPU is synchronized every
    20 calls only, so that its launch queue stays short)."""
    print(f"\n=== {title} (median of {reps}, no synchronize)")
    for name, f in cases.items():
        for _ in range(5):
            f()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
            if len(times) % 20 == 0:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        print(f"  {1e6 * statistics.median(times):8.1f}  {name}")


class _Three(torch.autograd.Function):
    """A loss of three parameters whose backward returns stored gradients (the engine's own
    cost)."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w, b)
        return x.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, g):
        return ctx.saved_tensors


def engine_costs(reps: int = 200):
    """Host us of loss.backward() for a Function of three parameters, with and without the
    API's 'mean' arithmetic (div, where, add) on top."""
    dev = "cuda"
    x = torch.randn(16, 8, device=dev, requires_grad=True)
    w = torch.randn(8, 8, device=dev, requires_grad=True)
    b = torch.randn(8, device=dev, requires_grad=True)
    d = torch.tensor(5.0, device=dev)

    def plain():
        return _Three.apply(x, w, b)

    def mean():
        return _Three.apply(x, w, b) / d + torch.where(d == 0, math.nan, 0.0)
    print("\n=== host us of the backward engine (median of %d)" % reps)
    for name, make in (("Function alone", plain), ("Function / d + where term", mean)):
        fwd, bwd = [], []
        for i in range(reps + 10):
            f_s, b_s = step_seconds((x, w, b), make)
            if i >= 10:
                fwd.append(f_s)
                bwd.append(b_s)
            if i % 20 == 0:
                torch.cuda.synchronize()
        print(f"  forward {1e6 * statistics.median(fwd):7.1f}  backward "
              f"{1e6 * statistics.median(bwd):7.1f}  {name}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="mlm,bert8k")  # (training shapes: method fused_ce)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    op_costs()
    gemm_costs()
    engine_costs()
    instrument()
    for shape in args.shapes.split(","):
        stages(shape, args.steps)


if __name__ == "__main__":
    main()
