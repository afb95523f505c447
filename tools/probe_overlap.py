"""Probe (nineteenth session): can a chunk's memory-bound D pass run beside the next chunk's
logits GEMM on a second stream, so that its time hides behind the GEMM's?

At bert16k (4 chunks of 4096 rows) the GPU is busy 5.76 of 5.96 ms per step; of it the epilogue
GEMM takes 0.48 ms per chunk and the statistics + D kernels 0.24 (H100, NOTES.md #56's profile).
The GEMM is persistent (one program per SM: 176 registers x 256 threads, 181 KB of shared
memory, Triton 3.6 for sm_90), which leaves ~20 K registers and ~50 KB per SM: room for one
d_tiles_kernel program of 4 warps (84 registers), not of 8, and for finish_tiles_kernel (50).

    python tools/probe_overlap.py [--shapes bert16k] [--warps 4,8]

Runs one real step of the bench method fused_ce to capture the row-chunk path's arguments
(TileStats.logits / TileStats.finish), then replays, per d_tiles warp count, median ms of:
the GEMM of chunk 1 alone (into its own E buffer and tile statistics), chunk 0's statistics
and D alone (rewriting D over D: the values change, the work does not), both on one stream,
and both on two streams started together (the D pass launched first, then the GEMM, and the
other order). Concurrency pays where "two streams" is well under "one stream".
"""
import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench  # noqa: E402
from fused_ce.kernels import logits_tiles  # noqa: E402


def capture(shape):
    """The (logits, finish) calls of one fused_ce step at ``shape``: lists of (args, kwargs)."""
    calls = {"logits": [], "finish": []}
    originals = {name: getattr(logits_tiles.TileStats, name) for name in calls}

    def recorder(name):
        def wrapped(*args, **kw):
            calls[name].append((args, kw))
            return originals[name](*args, **kw)
        return wrapped

    for name in calls:
        setattr(logits_tiles.TileStats, name, recorder(name))
    try:
        x, w, b, t = bench.make_inputs(shape)
        fn = bench.method_fn("fused_ce", "ce", x, w, b, t)
        step = bench.forward_backward("fused_ce", "ce", fn, [x, w, b])
        step()
        torch.cuda.synchronize()
    finally:
        for name, fn in originals.items():
            setattr(logits_tiles.TileStats, name, fn)
    return calls, (x, w, b, t)


def ms(fn):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="bert16k")
    ap.add_argument("--warps", default="4,8")
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        calls, keep = capture(shape)  # (keep: the inputs the captured tensors come from)
        if len(calls["logits"]) < 2:
            print(f"{shape}: {len(calls['logits'])} chunk(s) on the epilogue path; need 2",
                  flush=True)
            continue
        (ts0, p, xc0, e0, c0_0, bias, cf, out, with_ws, need_d, *rest), kw0 = calls["finish"][0]
        (_, _, xc1, _, c0_1, _, _), _ = calls["logits"][1]
        ts1 = logits_tiles.TileStats(p, xc1.shape[0], with_ws)
        e1 = torch.empty_like(e0)
        finish = logits_tiles.TileStats.finish
        gemm = logits_tiles.TileStats.logits
        cfg = p.cfg["logits_tiles"]
        saved = dict(cfg)
        side = torch.cuda.Stream()
        main_stream = torch.cuda.current_stream()
        for warps in (int(v) for v in args.warps.split(",")):
            cfg["db_warps"] = warps

            def d_pass():
                finish(ts0, p, xc0, e0, c0_0, bias, cf, out, with_ws, need_d, *rest, **kw0)

            def g_pass():
                gemm(ts1, p, xc1, e1, c0_1, bias, with_ws)

            def one_stream():
                d_pass()
                g_pass()

            def two_streams(first, second):
                def run():
                    side.wait_stream(main_stream)
                    first()
                    with torch.cuda.stream(side):
                        second()
                    main_stream.wait_stream(side)
                return run

            t_g, t_d, t_1 = ms(g_pass), ms(d_pass), ms(one_stream)
            t_dg, t_gd = ms(two_streams(d_pass, g_pass)), ms(two_streams(g_pass, d_pass))
            print(f"{shape} rows {xc0.shape[0]} + {xc1.shape[0]}, d_tiles {warps} warps: GEMM "
                  f"{t_g:.3f} ms, statistics + D {t_d:.3f}, one stream {t_1:.3f}, two streams "
                  f"(D launched first) {t_dg:.3f}, (GEMM first) {t_gd:.3f}", flush=True)
        cfg.clear()
        cfg.update(saved)
        del keep


if __name__ == "__main__":
    main()
