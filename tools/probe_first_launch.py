"""Probe (seventeenth session): host time from the row-chunk path's one host sync to its first
launch, the GPU's idle gap at each step (tools/profile_gaps.py: ~0.3-0.4 ms at BERT shapes).

    python tools/probe_first_launch.py [--shapes bert8k,bert16k]

Wraps kernels.CountRead.wait and the path's steps with perf_counter stamps and prints, per
step, the median host microseconds: sync returned -> first logits launch called -> returned,
and the launch's own host time. Then the logits launch's parts, median us over 200 calls
without syncs: two TensorDescriptor.from_tensor, the JIT launch (binder, cache key, launcher),
the argument binder alone, and the compiled kernel launched directly with the bound arguments
(its launcher still encodes the TMA descriptors).
"""
import argparse
import os
import statistics
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench  # noqa: E402
import fused_ce.kernels as kernels  # noqa: E402
from fused_ce.kernels import logits_tiles, row_chunks  # noqa: E402

STAMPS = []


def stamped(label, fn):
    def wrapper(*args, **kw):
        STAMPS.append((label + " call", time.perf_counter()))
        out = fn(*args, **kw)
        STAMPS.append((label + " done", time.perf_counter()))
        return out
    return wrapper


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="bert8k,bert16k")
    args = ap.parse_args()
    kernels.CountRead.wait = stamped("wait", kernels.CountRead.wait)
    logits_tiles.launch = stamped("launch", logits_tiles.launch)
    logits_tiles.TileStats.__init__ = stamped("tilestats", logits_tiles.TileStats.__init__)
    row_chunks._sweep_chunks = stamped("sweep", row_chunks._sweep_chunks)
    logits_tiles.finish_tiles_kernel.run = stamped("finish", logits_tiles.finish_tiles_kernel.run)
    for shape in args.shapes.split(","):
        x, w, b, t = bench.make_inputs(shape)
        fn = bench.method_fn("fused_ce", "ce", x, w, b, t)
        step = bench.forward_backward("fused_ce", "ce", fn, [x, w, b])
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        rows = []
        for _ in range(30):
            STAMPS.clear()
            step()
            torch.cuda.synchronize()
            d = dict()
            for label, t_ in STAMPS:
                d.setdefault(label, t_)  # first occurrence
            t0 = d["wait done"]
            rows.append({k: (v - t0) * 1e6 for k, v in d.items()})
        keys = sorted(rows[0], key=lambda k: statistics.median(r[k] for r in rows))
        print(f"{shape}: median us after the sync returned:", flush=True)
        for k in keys:
            print(f"  {k:16s} {statistics.median(r[k] for r in rows):9.1f}")
    launch_parts()


def launch_parts():
    from triton.tools.tensor_descriptor import TensorDescriptor
    from fused_ce.kernels import config
    cfg = config.GPU["logits_tiles"]
    c, h, v = 8192, 1024, 30272
    x = torch.randn(c, h, device="cuda").bfloat16()
    w = torch.randn(v, h, device="cuda").bfloat16()
    e = torch.empty(c, v, device="cuda", dtype=torch.bfloat16)
    n_t = triton.cdiv(v, cfg["BN"] // cfg["split"])
    m, s_, ws = (torch.empty(c, n_t, device="cuda") for _ in range(3))
    a = torch.empty(c, n_t, device="cuda", dtype=torch.int32)
    b = torch.zeros(v, device="cuda")
    count = torch.full((1,), c, device="cuda", dtype=torch.int32)
    w_desc = TensorDescriptor.from_tensor(w, [cfg["BN"], cfg["BK"]])

    def timed(fn, n=200):
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        return statistics.median(out)

    def descs():
        TensorDescriptor.from_tensor(x, [cfg["BM"], cfg["BK"]])
        TensorDescriptor.from_tensor(e, [cfg["BM"], cfg["BN"] // cfg["split"]])
    kw = dict(HAS_BIAS=True, HAS_CW=False, WITH_WS=False)

    def full():
        logits_tiles.launch(cfg, x, w_desc, e, b, b, count, 0, v, m, s_, a, ws, n_t, **kw)
    full()
    torch.cuda.synchronize()
    fn = logits_tiles.logits_tiles_kernel
    x_d = TensorDescriptor.from_tensor(x, [cfg["BM"], cfg["BK"]])
    e_d = TensorDescriptor.from_tensor(e, [cfg["BM"], cfg["BN"] // cfg["split"]])
    progs = 132
    args = (x_d, w_desc, e_d, b, b, count, 0, c, v, h, m, s_, a, ws, n_t, progs)
    kwargs = dict(E_DTYPE=triton.language.bfloat16, UPCAST=False, BM=cfg["BM"], BN=cfg["BN"],
                  BK=cfg["BK"], SPLIT=cfg["split"], FLATTEN=cfg["flatten"],
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **kw)
    compiled = fn[(progs,)](*args, **kwargs)
    binder = fn.device_caches[torch.cuda.current_device()][4]
    bound = list(binder(*args, **kwargs)[0].values())
    runner = compiled[(progs, 1, 1)]
    def jit_fresh():
        xd = TensorDescriptor.from_tensor(x, [cfg["BM"], cfg["BK"]])
        ed = TensorDescriptor.from_tensor(e, [cfg["BM"], cfg["BN"] // cfg["split"]])
        fn[(progs,)](xd, w_desc, ed, *args[3:], **kwargs)
    print(f"JIT call with fresh descriptors {timed(jit_fresh):.1f} us; the JIT call with "
          f"launch()'s own arguments {timed(lambda: fn[(progs,)](*args, **kwargs)):.1f}",
          flush=True)
    print(f"logits launch parts, median us: descriptors {timed(descs):.1f}, "
          f"launch() {timed(full):.1f}, JIT call {timed(lambda: fn[(progs,)](*args, **kwargs)):.1f}, "
          f"binder {timed(lambda: binder(*args, **kwargs)):.1f}, "
          f"compiled kernel direct {timed(lambda: runner(*bound)):.1f}", flush=True)


if __name__ == "__main__":
    main()
