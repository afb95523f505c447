"""One device call: the row-chunk path's pieces and whole, on the issue's shapes (H200).

    python tools/probe_rowchunks.py [--parts] [--budgets 128,256,512] [--shapes ...]

Prints, per shape and Z budget: forward+gradients time of fused_ce.kernels.forward (median ms,
do_bench), its peak extra memory, the errors against an fp32 reference, and the API-level
forward+backward time and memory. --parts times the pieces at the BERT shape (GEMMs with and
without a padded weight copy, the finish kernel's block shapes).
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
        ("logits fp32-out, ld aligned, W as is", lambda: row_chunks._gemm_f32(xc, w.t(), z[:, :v])),
        ("logits fp32-out, padded W copy", lambda: row_chunks._gemm_f32(xc, wp.t(), z)),
        ("logits bf16-out, padded W", lambda: torch.mm(xc, wp.t())),
        ("dX fp32-out, D[:, :V] @ W", lambda: row_chunks._gemm_f32(dc, w, dx32)),
        ("dX fp32-out, D[:, :Vpad] @ Wpad", lambda: row_chunks._gemm_f32(dcp, wp, dx32)),
        ("dW32 += D[:, :V].T x", lambda: row_chunks._gemm_f32(dc.t(), xc, dw32, accumulate=True)),
        ("dW32 += D[:, :Vpad].T x (padded)", lambda: row_chunks._gemm_f32(dcp.t(), xc, dwp32,
                                                                          accumulate=True)),
        ("dW bf16 direct D.T x", lambda: torch.mm(dc.t(), xc)),
        ("db32 colsum D", lambda: dcp.sum(0, dtype=torch.float32)),
        ("db32 ones @ D fp32-out", lambda: row_chunks._gemm_f32(ones, dcp, db2, accumulate=True)),
        ("pad weight copy", lambda: row_chunks.padded_weight(w)),
    ]
    for name, fn in rows:
        ms = bench_ms(fn)
        tf = f"{f / ms / 1e9:6.0f} TF/s" if "colsum" not in name and "copy" not in name else ""
        print(f"  {name:<42} {ms:7.3f} ms {tf}", flush=True)
    tgt = torch.randint(0, v, (n,), device="cuda")
    idx = torch.arange(n, device="cuda")
    cf = [torch.full((n,), 1.0 / n, device="cuda") for _ in range(4)]
    sc = torch.ones(1, device="cuda")
    st = [torch.empty(n, device="cuda") for _ in range(4)]
    am = torch.empty(n, device="cuda", dtype=torch.long)
    gbytes = c * v * 10 / 1e9  # Z read twice (fp32), D written (bf16)
    bp = row_chunks._padded_bias(b, ldz, "cuda")
    torch.mm(xc, wp.t(), out_dtype=torch.float32, out=z)
    for bv, nw in ((512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8)):
        for lse_in in (False, True):
            fn = lambda: row_chunks.finish_rows_kernel[(c,)](  # noqa: E731
                z, ldz, d, 2 * ldz, bp, bp, tgt, idx, 0, *cf, sc, *st, am, v, ldz, 1.0,
                HAS_BIAS=True, HAS_SOFTCAP=False, HAS_CW=False, WITH_WS=False, NEED_D=True,
                LSE_IN=lse_in, D_OVER_Z=True, BLOCK_V=bv, num_warps=nw)
            ms = bench_ms(fn)
            gb = gbytes * (0.6 if lse_in else 1.0)
            print(f"  finish BLOCK_V={bv:<5} warps={nw} lse_in={lse_in!s:<5} {ms:7.3f} ms "
                  f"{gb / ms:6.2f} TB/s", flush=True)


def whole(shapes, budgets, rows_ref):
    for shape in shapes:
        x, w, b, t = bench.make_inputs(shape)
        params = [p for p in (x, w, b) if p is not None]
        ref = bench.reference_fp32("ce", x, w, b, t)
        for budget in budgets:
            # a fixed Z budget (the library's own is half the fp32 dW within these bounds)
            config.ROW_CHUNK_BYTES = config.ROW_CHUNK_BYTES_MAX = budget * MiB
            fn = bench.method_fn("kernels", "ce", x, w, b, t)
            ms = bench_ms(fn)
            pk = bench.peak_mib(fn)
            api = lambda: fused_ce.linear_cross_entropy(x, w, t, linear_bias=b)  # noqa: E731
            step = bench.forward_backward("fused_ce", "ce", api, params)
            api_ms = bench_ms(step)
            for p in params:
                p.grad = None
            api_pk = bench.peak_mib(step)
            err = bench.errors("fused_ce", "ce", api, params, ref)
            e = " ".join(f"{k}={v:.1e}" for k, v in err.items())
            print(f"{shape:<8} Z<={budget:>4} MiB  kernels {ms:8.3f} ms {pk:7.0f} MiB | "
                  f"api {api_ms:8.3f} ms {api_pk:7.0f} MiB | {e}", flush=True)
            rows_ref.append((shape, budget, ms, pk, api_ms, api_pk, err))
        config.ROW_CHUNKS = False
        fn = bench.method_fn("kernels", "ce", x, w, b, t)
        print(f"{shape:<8} vocab sweep kernels {bench_ms(fn, rep=60):8.3f} ms "
              f"{bench.peak_mib(fn):7.0f} MiB", flush=True)
        config.ROW_CHUNKS = True
        del ref
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", action="store_true")
    ap.add_argument("--budgets", default="256,512,1024")
    ap.add_argument("--shapes", default="bert8k,mlm,bert16k,llama3,gemma2")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    if args.parts:
        parts()
    whole(args.shapes.split(","), [int(b) for b in args.budgets.split(",")], [])


if __name__ == "__main__":
    main()
