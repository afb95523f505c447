"""One device call: where the GPU waits for the host in one fused_ce forward+backward.

    python tools/profile_gaps.py [--shapes bert8k,mlm] [--methods fused_ce,kernels] [--rows 20]

Methods and shapes are benchmarks/bench.py's. Per (shape, method) it profiles a few steps
(torch.profiler, chrome trace), walks the GPU activity (kernels, copies, fills) in time order
and, for every idle gap between two GPU activities, finds the host call that launched the next
one. Gaps are summed per launching site: the innermost fused_ce / benchmarks Python frame
around the launch (with ``--stack``, which slows the host a little) or else the innermost torch
op. A gap whose launch came after the GPU went idle is the host's latency.
"""
import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from profile_kernels import warm_steps  # noqa: E402

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
OURS = ("fused_ce", "benchmarks", "tools")


def _trace(step, steps: int, stack: bool) -> list:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 with_stack=stack) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(path)
    return [e for e in events if e.get("ph") == "X"]


def _site(launch, cpu_events) -> str:
    """The innermost enclosing frame of ours (python_function) or else the innermost op."""
    ts, tid = launch["ts"], launch.get("tid")
    best_ours, best_op = None, None
    for e in cpu_events:
        if e.get("tid") != tid or not (e["ts"] <= ts <= e["ts"] + e["dur"]):
            continue
        if e["cat"] == "python_function" and any(o in e["name"] for o in OURS):
            if best_ours is None or e["ts"] >= best_ours["ts"]:
                best_ours = e
        elif e["cat"] == "cpu_op" and (best_op is None or e["ts"] >= best_op["ts"]):
            best_op = e
    parts = []
    if best_ours is not None:
        name = best_ours["name"]
        parts.append(name[name.find("fused_ce"):] if "fused_ce/" in name else name[-60:])
    if best_op is not None:
        parts.append(best_op["name"][:40])
    return " | ".join(parts) or launch["name"][:40]


def gaps(events, steps: int, min_us: float):
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    cpu = [e for e in events if e.get("cat") in ("cpu_op", "python_function")]
    busy = sum(e["dur"] for e in gpu)
    per_site = defaultdict(lambda: [0.0, 0, 0.0])  # gap us, count, host-late us
    total_gap = 0.0
    end = gpu[0]["ts"] + gpu[0]["dur"] if gpu else 0
    for g in gpu[1:]:
        gap = g["ts"] - end
        if gap > min_us:
            total_gap += gap
            launch = launches.get(g["args"].get("correlation"))
            site = _site(launch, cpu) if launch else g["name"][:40]
            late = max(0.0, launch["ts"] - end) if launch else 0.0
            s = per_site[site]
            s[0] += gap
            s[1] += 1
            s[2] += late
        end = max(end, g["ts"] + g["dur"])
    span = (end - gpu[0]["ts"]) if gpu else 0.0
    return span / steps, busy / steps, total_gap / steps, len(gpu) / steps, per_site


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="bert8k,mlm")
    ap.add_argument("--methods", default="fused_ce,kernels")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--min-us", type=float, default=2.0)
    ap.add_argument("--stack", action="store_true")
    args = ap.parse_args()
    for shape, name, step in warm_steps(args.shapes, args.methods, warmup=5):
        for stack in ([False, True] if args.stack else [False]):
            ev = _trace(step, args.steps, stack)
            span, busy, gap, n, per_site = gaps(ev, args.steps, args.min_us)
            print(f"\n=== {shape} {name}{' (python stacks)' if stack else ''}: GPU span "
                  f"{span / 1e3:.3f} ms/step, busy {busy / 1e3:.3f}, idle gaps > "
                  f"{args.min_us:g} us {gap / 1e3:.3f}, {n:.0f} GPU activities/step")
            print("  gap us/step  count/step  host-late us/step  launched from")
            rows = sorted(per_site.items(), key=lambda kv: -kv[1][0])[:args.rows]
            for site, (g, c, late) in rows:
                print(f"  {g / args.steps:10.1f}  {c / args.steps:10.1f}  "
                      f"{late / args.steps:17.1f}  {site}")


if __name__ == "__main__":
    main()
