"""Feasibility probe (H200, twelfth session): a persistent Triton logits GEMM whose epilogue
does the finish kernel's first pass, against cuBLAS.

The row-chunk path moves 14 bytes per logit outside the GEMMs' inputs: cuBLAS writes fp32 Z
(4), the finish kernel reads it twice (8) and writes bf16 D (2). If the logits GEMM's epilogue
computes each (row, vocabulary tile)'s max m and sum-exp s from its fp32 accumulator and
writes E = exp(z - m) in bf16, the finish needs only E (2) and writes D over it (2): D =
alpha * E * exp(m_tile - lse) - alpha [j = t], 6 bytes per logit. That pays only if such a
GEMM runs at about cuBLAS's speed (session 4: a non-persistent Triton GEMM was ~20 % slower).

    python tools/probe_persistent_logits.py [--shapes bert2k,bert4k,llama2k]

Prints median ms and TFLOP/s of cuBLAS (fp32 out, bf16 out) and of the persistent kernel per
tile configuration and epilogue: 'z32' (fp32 Z, no statistics), 'e16' (bf16 E plus m, s per
tile), and the errors of E, m and the lse derived from (m, s) against an fp32 reference.
"""
import argparse

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

SHAPES = {  # rows of one chunk, H, V padded to 64
    "bert2k": (2048, 1024, 30272),
    "bert4k": (4096, 1024, 30272),
    "llama2k": (2048, 4096, 128256),
}


@triton.jit
def logits_persistent_kernel(a_desc, b_desc, o_desc, m_ptr, s_ptr, M, N, K,
                             NUM_PROGS: tl.constexpr, STATS: tl.constexpr, BM: tl.constexpr,
                             BN: tl.constexpr, BK: tl.constexpr, FLATTEN: tl.constexpr):
    """o = a @ b.T (fp32 Z) or, with STATS, o = exp(z - m) (bf16) and per (tile, row) the
    max m and sum-exp s of z over the tile's valid columns (< N)."""
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile in tl.range(tl.program_id(0), n_m * n_n, NUM_PROGS, flatten=FLATTEN):
        # all row tiles of one W tile next to each other: W comes from HBM once
        pid_m = tile % n_m
        pid_n = tile // n_m
        off_m = pid_m * BM
        off_n = pid_n * BN
        acc = tl.zeros((BM, BN), tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([off_m, ki * BK])
            b = b_desc.load([off_n, ki * BK])
            acc = tl.dot(a, b.T, acc)
        if STATS:
            cols = off_n + tl.arange(0, BN)
            zm = tl.where(cols[None, :] < N, acc, float("-inf"))
            mt = tl.max(zm, 1)
            e = tl.exp(zm - mt[:, None])
            st = tl.sum(e, 1)
            rows = off_m + tl.arange(0, BM)
            tl.store(m_ptr + pid_n * M + rows, mt, mask=rows < M)
            tl.store(s_ptr + pid_n * M + rows, st, mask=rows < M)
            o_desc.store([off_m, off_n], e.to(tl.bfloat16))
        else:
            o_desc.store([off_m, off_n], acc)


def bench_ms(fn, rep=150):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=30, rep=rep, return_mode="median")


CONFIGS = [  # BM, BN, BK, warps, stages, flatten
    (128, 128, 64, 8, 4, True), (128, 256, 64, 8, 3, False), (128, 256, 64, 8, 3, True),
    (128, 256, 64, 8, 4, True),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="bert2k,bert4k,llama2k")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device="cuda"))
    for name in args.shapes.split(","):
        c, h, v = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.5 * 4).bfloat16()
        x = torch.randn(c, h, device="cuda", generator=g).bfloat16()
        flops = 2 * c * h * v
        z = torch.empty(c, v, device="cuda")
        z16 = torch.empty(c, v, device="cuda", dtype=torch.bfloat16)
        ms32 = bench_ms(lambda: torch.mm(x, w.t(), out_dtype=torch.float32, out=z))
        ms16 = bench_ms(lambda: torch.mm(x, w.t(), out=z16))
        print(f"{name} rows {c} H {h} V {v}: cuBLAS fp32-out {ms32:.3f} ms "
              f"{flops / ms32 / 1e9:.0f} TF/s, bf16-out {ms16:.3f} ms {flops / ms16 / 1e9:.0f}",
              flush=True)
        ref = x.float() @ w.float().t()
        for bm, bn, bk, nw, ns, flat in CONFIGS:
            for stats in (False, True):
                n_t = triton.cdiv(v, bn)
                m = torch.empty(n_t, c, device="cuda")
                s = torch.empty(n_t, c, device="cuda")
                o = z16 if stats else z
                a_d = TensorDescriptor.from_tensor(x, [bm, bk])
                b_d = TensorDescriptor.from_tensor(w, [bn, bk])
                o_d = TensorDescriptor.from_tensor(o, [bm, bn])
                progs = min(sms, triton.cdiv(c, bm) * n_t)

                def run():
                    logits_persistent_kernel[(progs,)](
                        a_d, b_d, o_d, m, s, c, v, h, NUM_PROGS=progs, STATS=stats, BM=bm,
                        BN=bn, BK=bk, FLATTEN=flat, num_warps=nw, num_stages=ns)
                tag = f"  BM{bm} BN{bn} w{nw} s{ns} flat{int(flat)} {'e16' if stats else 'z32'}"
                try:
                    ms = bench_ms(run)
                except Exception as e:  # noqa: BLE001 (shared memory, compile limits)
                    print(f"{tag}: failed {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                line = f"{tag}: {ms:.3f} ms {flops / ms / 1e9:.0f} TF/s"
                if stats:
                    mm = m.t().repeat_interleave(bn, 1)[:, :v]
                    e_ref = torch.exp(ref - mm)
                    big = e_ref > 1e-20  # bf16 subnormals aside
                    e_err = ((o.float() - e_ref).abs()[big] / e_ref[big]).max().item()
                    lse = (m + torch.log(s)).logsumexp(0)
                    lse_err = (lse - ref.logsumexp(1)).abs().max().item()
                    line += f" E_rel_err={e_err:.1e} lse_err={lse_err:.1e}"
                else:
                    line += f" z_err={(z - ref).abs().max().item():.1e}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
