"""One device call: the row-chunk path's pieces and whole, on the issue's shapes (H200).

    python tools/probe_rowchunks.py [--overhead] [--parts] [--budgets 0,256,512]
        [--finish 2048:8,2048:4] [--cprofile] [--shapes ...]

Prints, per shape, Z budget and finish-kernel variant: forward+gradients time of
fused_ce.kernels.forward (median ms, do_bench), its peak extra memory, the errors against an
fp32 reference, and the API-level forward+backward time and memory. --parts times the pieces
at the BERT shape (GEMMs with and without a padded weight copy, db's column sums, the finish
kernel's block shapes at three vocabulary sizes). --overhead profiles the host side of one API
step (MLM and BERT 8k shapes) with torch.profiler, --cprofile with cProfile.
"""
import argparse
import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench  # noqa: E402
import fused_ce  # noqa: E402
from fused_ce.kernels import config, row_chunks  # noqa: E402

MiB = 2**20


def bench_ms(fn, rep=120):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=30, rep=rep, return_mode="median")


def parts():
    n, h, v, c = 8192, 1024, 30258, 2048
    ldz = triton.cdiv(v, 64) * 64
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, h, device="cuda", generator=g) / 32).bfloat16()
    b = torch.randn(v, device="cuda", generator=g).bfloat16()
    xc = x[:c]
    z = torch.empty(c, ldz, device="cuda")
    f = 2 * c * h * v
    wp = row_chunks.padded_weight(w)
    d = z.view(torch.bfloat16)
    dc, dcp = d[:, :v], d[:, :ldz]
    dx32 = torch.empty(c, h, device="cuda")
    dw32 = torch.zeros(v, h, device="cuda")
    dwp32 = torch.zeros(ldz, h, device="cuda")
    ones = torch.ones(1, c, device="cuda", dtype=torch.bfloat16)
    db2 = torch.zeros(1, ldz, device="cuda")
    rows = [
        ("logits fp32-out, ld aligned, W as is", lambda: row_chunks.gemm_f32(xc, w.t(), z[:, :v])),
        ("logits fp32-out, padded W copy", lambda: row_chunks.gemm_f32(xc, wp.t(), z)),
        ("logits bf16-out, padded W", lambda: torch.mm(xc, wp.t())),
        ("dX fp32-out, D[:, :V] @ W", lambda: row_chunks.gemm_f32(dc, w, dx32)),
        ("dX fp32-out, D[:, :Vpad] @ Wpad", lambda: row_chunks.gemm_f32(dcp, wp, dx32)),
        ("dW32 += D[:, :V].T x", lambda: row_chunks.gemm_f32(dc.t(), xc, dw32, accumulate=True)),
        ("dW32 += D[:, :Vpad].T x (padded)", lambda: row_chunks.gemm_f32(dcp.t(), xc, dwp32,
                                                                          accumulate=True)),
        ("dW bf16 direct D.T x", lambda: torch.mm(dc.t(), xc)),
        ("db32 colsum D", lambda: dcp.sum(0, dtype=torch.float32)),
        ("db32 ones @ D fp32-out", lambda: row_chunks.gemm_f32(ones, dcp, db2, accumulate=True)),
        ("pad weight copy", lambda: row_chunks.padded_weight(w)),
    ]
    for name, fn in rows:
        ms = bench_ms(fn)
        tf = f"{f / ms / 1e9:6.0f} TF/s" if "colsum" not in name and "copy" not in name else ""
        print(f"  {name:<42} {ms:7.3f} ms {tf}", flush=True)
    dwa32 = torch.zeros(ldz, h + 64, device="cuda")
    xa = torch.zeros(c, h + 64, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: row_chunks.gemm_f32(dcp.t(), xa, dwa32, accumulate=True))
    print(f"  {'dW32 += D.T [x | 1 | 0] (db in the GEMM)':<42} {ms:7.3f} ms", flush=True)
    finish_variants(c, v)


def finish_variants(c, v, vocabs=(30258, 128256, 256000)):
    """finish_rows_kernel's block shapes at BERT's, Llama-3's and Gemma-2's V (one program per
    row). Dropped variants: a persistent grid of 1-8 programs per SM, meant to keep Z in L2
    between the two passes (1.0-2.2x slower, session 3); a whole-row kernel with Z read once
    (commit 8b1ad76: 0.218 vs 0.173 ms per 2048 rows at V = 30k, session 7)."""
    n = c
    tgt = torch.randint(0, v, (n,), device="cuda")
    idx = torch.arange(n, device="cuda")
    cf = [torch.full((n,), 1.0 / n, device="cuda") for _ in range(4)]
    sc = torch.ones(1, device="cuda")
    st = [torch.empty(n, device="cuda") for _ in range(4)] + [
        torch.empty(n, device="cuda", dtype=torch.long)] + [
        torch.empty(n, device="cuda") for _ in range(2)]  # lse, zt, ws, max, am, nll, loss
    for vv in vocabs:
        vp = row_chunks.padded_vocab(vv)
        rows = min(c, (256 * MiB) // (vp * 4))
        zz = torch.randn(rows, vp, device="cuda")
        dd = zz.view(torch.bfloat16)
        bp = torch.randn(vp, device="cuda")
        gbytes = rows * vp * 10 / 1e9  # Z read twice (fp32), D written (bf16)
        for bv, nw in ((1024, 4), (2048, 8), (4096, 16)):
            for lse_in in (False, True):
                fn = lambda: row_chunks.finish_rows_kernel[(rows,)](  # noqa: E731
                    zz, vp, dd, 2 * vp, bp, bp, tgt, idx, 0, rows, *cf, sc, *st, vv, vp, 1.0,
                    rows, idx, rows, -100,  # (no fill programs: FILL is 0)
                    HAS_BIAS=True, HAS_SOFTCAP=False, HAS_CW=False, WITH_WS=False, NEED_D=True,
                    LSE_IN=lse_in, HAS_SCALE=False, D_OVER_Z=True, BLOCK_V=bv, num_warps=nw)
                ms = bench_ms(fn)
                gb = gbytes * (0.6 if lse_in else 1.0)
                print(f"  finish V={vv:<6} rows={rows:<5} BLOCK_V={bv:<5} warps={nw:<2} "
                      f"lse_in={lse_in!s:<5} {ms:7.3f} ms {gb / ms:6.2f} TB/s", flush=True)
        del zz, dd


def api_step(inputs):
    """(one API forward+backward step, the API call, the parameters) on bench inputs."""
    x, w, b, t = inputs
    params = [p for p in (x, w, b) if p is not None]
    api = lambda: fused_ce.linear_cross_entropy(x, w, t, linear_bias=b)  # noqa: E731
    return bench.forward_backward("fused_ce", "ce", api, params), api, params


def overhead(shape, steps=20):
    """Host-side cost of one API forward+backward: the host wall time per step, then
    torch.profiler's CPU and CUDA time per op."""
    import time
    from torch.profiler import ProfilerActivity, profile
    step = api_step(bench.make_inputs(shape))[0]
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    print(f"{shape}: wall per step {1e3 * (time.perf_counter() - t0) / steps:.3f} ms", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    busy = sum(e.self_device_time_total for e in ka
               if e.device_type == torch.autograd.DeviceType.CUDA) / steps / 1e3
    print(f"{shape}: GPU busy per step {busy:.3f} ms (sum of kernel times)", flush=True)
    print(ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60),
          flush=True)
    print(ka.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60),
          flush=True)


def python_profile(shape, steps=30):
    """cProfile of API forward+backward steps: where the host's time goes, by function."""
    import cProfile
    import pstats
    step = api_step(bench.make_inputs(shape))[0]
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    prof.disable()
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(40)
    st.sort_stats("cumulative").print_stats(45)


def whole(shapes, budgets, finishes):
    """Per shape, Z budget (0: the library's own) and finish-kernel variant
    (BLOCK_V:num_warps): kernels and API time, memory, errors."""
    default = dict(config.GPU["row_finish"]), dict(config.GPU_WIDE["row_finish"])
    lo, hi = config.ROW_CHUNK_BYTES, config.ROW_CHUNK_BYTES_MAX
    for shape in shapes:
        x, w, b, t = bench.make_inputs(shape)
        ref = bench.reference_fp32("ce", x, w, b, t)
        for budget in budgets:
            # a fixed Z budget (the library's own is half the fp32 dW within these bounds)
            config.ROW_CHUNK_BYTES, config.ROW_CHUNK_BYTES_MAX = ((lo, hi) if budget == 0
                                                                  else (budget * MiB,) * 2)
            for fin in finishes:
                bv, nw = fin.split(":")
                for cfg in (config.GPU, config.GPU_WIDE):
                    cfg["row_finish"] = dict(BLOCK_V=int(bv), num_warps=int(nw))
                fn = bench.method_fn("kernels", "ce", x, w, b, t)
                ms = bench_ms(fn)
                pk = bench.peak_mib(fn)
                step, api, params = api_step((x, w, b, t))
                api_ms = bench_ms(step)
                for p in params:
                    p.grad = None
                api_pk = bench.peak_mib(step)
                err = bench.errors("fused_ce", "ce", api, params, ref)
                e = " ".join(f"{k}={v:.1e}" for k, v in err.items())
                print(f"{shape:<8} Z<={budget or 'lib':>4} MiB finish {fin:<12} kernels "
                      f"{ms:8.3f} ms {pk:7.0f} MiB | api {api_ms:8.3f} ms {api_pk:7.0f} MiB | "
                      f"{e}", flush=True)
        config.GPU["row_finish"], config.GPU_WIDE["row_finish"] = (dict(d) for d in default)
        del ref
        torch.cuda.empty_cache()
    config.ROW_CHUNK_BYTES, config.ROW_CHUNK_BYTES_MAX = lo, hi


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--overhead", action="store_true")
    ap.add_argument("--parts", action="store_true")
    ap.add_argument("--budgets", default="0", help="MiB of Z; 0: the library's own")
    ap.add_argument("--finish", default="2048:8",
                    help="finish-kernel variants BLOCK_V:num_warps, comma-separated")
    ap.add_argument("--finish-only", action="store_true",
                    help="only the finish kernels at three vocabulary sizes")
    ap.add_argument("--cprofile", action="store_true",
                    help="the host side of an MLM-shape API step under cProfile")
    ap.add_argument("--shapes", default="bert8k,mlm,bert16k,llama3,gemma2")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    if args.overhead:
        overhead("mlm")
        overhead("bert8k")
    if args.cprofile:
        python_profile("mlm")
    if args.parts:
        parts()
    if args.finish_only:
        finish_variants(2048, 30258)
    if args.shapes == "none":
        return
    whole(args.shapes.split(","), [int(b) for b in args.budgets.split(",")],
          args.finish.split(","))


if __name__ == "__main__":
    main()
