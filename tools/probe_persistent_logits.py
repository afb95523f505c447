"""Probe (twelfth session): the row-chunk path's epilogue logits GEMM
(``fused_ce.kernels.logits_tiles.logits_tiles_kernel``) alone, per tile configuration, against
cuBLAS's logits GEMM with fp32 and bf16 output, on one chunk of rows.

The row-chunk path with cuBLAS moves 14 bytes per logit outside the GEMMs' inputs: fp32 Z
written (4), read twice by the finish kernel (8), bf16 D written (2). The epilogue GEMM writes
E = exp(z - m_tile) in bf16 and the tiles' statistics instead, and the finish then moves 6.
That pays only if the Triton GEMM runs at about cuBLAS's speed.

    python tools/probe_persistent_logits.py [--shapes bert2k,llama2k]

Prints median ms and TFLOP/s, and the errors of E (relative, where E > 1e-20) and of the lse
derived from the tile statistics against an fp32 reference. (H100, twelfth session, this
probe's first version, with its own kernel whose epilogue wrote only E, the max and the sum-exp:
at 2048 BERT rows 0.222 ms with BN 256, 3 stages and the flattened tile loop, cuBLAS fp32-out
0.222; a Triton GEMM writing fp32 Z without an epilogue took 0.256; results/h100_session12_*.)
"""
import argparse

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fused_ce.kernels.logits_tiles import logits_tiles_kernel

SHAPES = {  # rows of one chunk, H, V padded to 64
    "bert2k": (2048, 1024, 30272),
    "bert4k": (4096, 1024, 30272),
    "bert8k": (8192, 1024, 30272),
    "llama2k": (2048, 4096, 128256),
}
CONFIGS = [  # BM, BN, BK, warps, stages, flatten, split (the epilogue's column parts),
    # programs per SM (seventeenth session: 2 programs of one warp group each, so that one's
    # epilogue overlaps the other's main loop; 83 KB of shared memory and 255 registers each)
    (128, 256, 64, 8, 3, True, 2, 1), (128, 128, 64, 4, 2, True, 2, 2),
    (128, 128, 64, 4, 2, True, 2, 1), (128, 128, 64, 4, 3, True, 2, 1),
]


def bench_ms(fn, rep=150):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=30, rep=rep, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="bert2k,llama2k")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name in args.shapes.split(","):
        c, h, v = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.5 * 4).bfloat16()
        x = torch.randn(c, h, device="cuda", generator=g).bfloat16()
        flops = 2 * c * h * v
        z = torch.empty(c, v, device="cuda")
        e = torch.empty(c, v, device="cuda", dtype=torch.bfloat16)
        ms32 = bench_ms(lambda: torch.mm(x, w.t(), out_dtype=torch.float32, out=z))
        ms16 = bench_ms(lambda: torch.mm(x, w.t(), out=e))
        print(f"{name} rows {c} H {h} V {v}: cuBLAS fp32-out {ms32:.3f} ms "
              f"{flops / ms32 / 1e9:.0f} TF/s, bf16-out {ms16:.3f} ms {flops / ms16 / 1e9:.0f}",
              flush=True)
        ref = x.float() @ w.float().t()
        for bm, bn, bk, nw, ns, flat, split, per_sm in CONFIGS:
            bs = bn // split  # columns per statistics tile
            n_t = triton.cdiv(v, bs)
            m, s = (torch.empty(c, n_t, device="cuda") for _ in range(2))
            a = torch.empty(c, n_t, device="cuda", dtype=torch.int32)
            count = torch.full((1,), c, device="cuda", dtype=torch.int32)  # every row valid
            x_d = TensorDescriptor.from_tensor(x, [bm, bk])
            w_d = TensorDescriptor.from_tensor(w, [bn, bk])
            e_d = TensorDescriptor.from_tensor(e, [bm, bs])
            progs = min(per_sm * sms, triton.cdiv(c, bm) * triton.cdiv(v, bn))

            def run():
                return logits_tiles_kernel[(progs,)](
                    x_d, w_d, e_d, z, z, count, 0, c, v, h, m, s, a, m, n_t, progs,
                    E_DTYPE=tl.bfloat16, HAS_BIAS=False, HAS_CW=False, WITH_WS=False,
                    UPCAST=False, BM=bm, BN=bn, BK=bk, SPLIT=split, FLATTEN=flat, num_warps=nw,
                    num_stages=ns)
            tag = f"  BM{bm} BN{bn} w{nw} s{ns} flat{int(flat)} split{split} x{per_sm}/SM"
            try:
                k = run()
                tag += f" regs {k.n_regs} spills {k.n_spills}"
                ms = bench_ms(run)
            except Exception as err:  # noqa: BLE001 (shared memory, compile limits)
                print(f"{tag}: failed {type(err).__name__}: {str(err)[:160]}", flush=True)
                continue
            e_ref = torch.exp(ref - m.repeat_interleave(bs, 1)[:, :v])
            big = e_ref > 1e-20  # bf16 subnormals aside
            e_err = ((e.float() - e_ref).abs()[big] / e_ref[big]).max().item()
            lse_err = ((m + torch.log(s)).logsumexp(1) - ref.logsumexp(1)).abs().max().item()
            print(f"{tag}: {ms:.3f} ms {flops / ms / 1e9:.0f} TF/s E_rel_err={e_err:.1e} "
                  f"lse_err={lse_err:.1e}", flush=True)


if __name__ == "__main__":
    main()
