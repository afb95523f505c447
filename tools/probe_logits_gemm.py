"""Feasibility probe (H200): can a Triton GEMM write the fp32 logits chunk Z = x_c W^T at cuBLAS
speed while its epilogue also writes each (row, vocabulary tile)'s max and sum-exp? If so, the
row-chunk path's finish kernel needs one pass over Z instead of two.

    python tools/probe_logits_gemm.py [--rows 2048,4096] [--hidden 1024] [--vocab 30592]

Prints median ms and TFLOP/s (do_bench) of cuBLAS (fp32 out) and of the Triton kernel for each
tile configuration, with and without the statistics epilogue, and checks the results.
"""
import argparse
import itertools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from probe_rowchunks import bench_ms  # (tools/ is the script's folder)


@triton.jit
def logits_stats_kernel(a_desc, b_desc, z_desc, m_ptr, s_ptr, M, N, K, n_tiles_n,
                        STATS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles_m = tl.cdiv(M, BM)
    # the x rows are few (a chunk): all M tiles of one W tile run next to each other, W is
    # read from HBM once
    pid_m = pid % n_tiles_m
    pid_n = pid // n_tiles_m
    off_m = pid_m * BM
    off_n = pid_n * BN
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        a = a_desc.load([off_m, k])
        b = b_desc.load([off_n, k])
        acc = tl.dot(a, b.T, acc)
    if STATS:
        cols = off_n + tl.arange(0, BN)
        zm = tl.where(cols[None, :] < N, acc, float("-inf"))
        mt = tl.max(zm, 1)
        st = tl.sum(tl.exp(zm - mt[:, None]), 1)
        rows = off_m + tl.arange(0, BM)
        tl.store(m_ptr + rows * n_tiles_n + pid_n, mt, mask=rows < M)
        tl.store(s_ptr + rows * n_tiles_n + pid_n, st, mask=rows < M)
    z_desc.store([off_m, off_n], acc)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="2048,4096")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=30592)
    args = ap.parse_args()
    h, v = args.hidden, args.vocab
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(v, h, device="cuda", generator=g) / 32).bfloat16()
    configs = [dict(BM=bm, BN=bn, BK=64, num_warps=nw, num_stages=ns)
               for bm, bn, nw, ns in [(128, 128, 4, 4), (128, 128, 8, 4), (128, 256, 8, 3),
                                      (128, 256, 8, 4), (256, 128, 8, 3), (64, 256, 4, 4),
                                      (128, 128, 8, 5)]]
    for c in (int(r) for r in args.rows.split(",")):
        x = torch.randn(c, h, device="cuda", generator=g).bfloat16()
        flops = 2 * c * h * v
        z = torch.empty(c, v, device="cuda")
        ms = bench_ms(lambda: torch.mm(x, w.t(), out_dtype=torch.float32, out=z), rep=150)
        print(f"rows {c} H {h} V {v}: cuBLAS fp32-out {ms:.3f} ms {flops / ms / 1e9:.0f} TF/s",
              flush=True)
        ref = x.float() @ w.float().t()
        for cfg, stats in itertools.product(configs, (False, True)):
            bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
            n_tiles_n = triton.cdiv(v, bn)
            m = torch.empty(c, n_tiles_n, device="cuda")
            s = torch.empty(c, n_tiles_n, device="cuda")
            z.fill_(float("nan"))
            a_d = TensorDescriptor.from_tensor(x, [bm, bk])
            b_d = TensorDescriptor.from_tensor(w, [bn, bk])
            z_d = TensorDescriptor.from_tensor(z, [bm, bn])
            grid = (triton.cdiv(c, bm) * n_tiles_n,)

            def run():
                logits_stats_kernel[grid](a_d, b_d, z_d, m, s, c, v, h, n_tiles_n, STATS=stats,
                                          BM=bm, BN=bn, BK=bk, num_warps=cfg["num_warps"],
                                          num_stages=cfg["num_stages"])
            try:
                ms = bench_ms(run, rep=150)
            except Exception as e:  # noqa: BLE001 (out of shared memory etc.)
                print(f"  {cfg} stats={stats}: failed {type(e).__name__}: {str(e)[:120]}")
                continue
            err = ((z - ref).abs().max() / ref.abs().max()).item()
            line = f"  {cfg} stats={int(stats)}: {ms:.3f} ms {flops / ms / 1e9:.0f} TF/s zerr={err:.1e}"
            if stats:
                lse = (m + torch.log(s)).logsumexp(1)
                line += f" lse_err={(lse - ref.logsumexp(1)).abs().max().item():.1e}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
