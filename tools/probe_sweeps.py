"""Probe (fourteenth session): the vocabulary sweeps' fused logits kernels (logits.py: W read
through its TMA descriptor or through pointers) per tile configuration, against cuBLAS.

The sweeps run inference (no gradients: the statistics pass alone), CUDA-graph capture and
``low_memory``. Compiled for sm_90 (tools/sm90_registers.py) the pointer version spills
(row_stats_kernel 712 bytes per thread at 128 x 128, 1848 at 128 x 256) and its nested K loop
is not pipelined (32 KiB of shared memory: one stage); with W's descriptor it spills 0-32 bytes
at 128 x 128 x 64, 8 warps, and runs with its stages.

    python tools/probe_sweeps.py [--shapes bert8k,mlm,llama4k,gemma4k]

Per shape and variant: the statistics pass (``kernels.forward`` without gradients, what
``torch.no_grad`` evaluation runs) and the sweep with gradients (``ROW_CHUNKS = False``; and
``low_memory``), median ms; the logits GEMM alone by cuBLAS (bf16 out) for scale; the largest
lse difference to the first variant (the variants' logits differ only in summation order).
"""
import argparse

import torch
import triton

from fused_ce import kernels
from fused_ce.kernels import config
from fused_ce.reference import GradCoefs

SHAPES = {  # N, H, V, bias, fraction of rows with a target
    "bert8k": (8192, 1024, 30258, True, 1.0),
    "mlm": (16384, 1024, 30522, True, 0.15),
    "llama4k": (4096, 4096, 128256, False, 1.0),
    "gemma4k": (4096, 2304, 256000, False, 1.0),
}
# name: (W_DESCRIPTOR, logits tile of the configuration of the shape's H)
VARIANTS = {
    "ptr 128x128x64 w8 s3": (False, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8,
                                         num_stages=3)),
    "ptr 128x256x64 w8 s3": (False, dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8,
                                         num_stages=3)),
    "desc 128x128x64 w8 s3": (True, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8,
                                         num_stages=3)),
    "desc 128x128x64 w8 s4": (True, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8,
                                         num_stages=4)),
    "desc 128x256x64 w8 s3": (True, dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8,
                                         num_stages=3)),
}


def bench_ms(fn, rep=200):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=30, rep=rep, return_mode="median")


def inputs(name):
    n, h, v, bias, frac = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.5).bfloat16()
    b = (torch.randn(v, device="cuda", generator=g) * 0.5).bfloat16() if bias else None
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[torch.rand(n, device="cuda", generator=g) >= frac] = -100
    a = (t != -100).float()
    a /= a.sum()
    zero = torch.zeros_like(a)
    return x, w, b, t, GradCoefs(a, zero, a, zero)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="bert8k,mlm,llama4k,gemma4k")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}")
    keep = {name: dict(cfg["logits"]) for name, cfg in config.CONFIG.items()}
    for shape in args.shapes.split(","):
        x, w, b, t, co = inputs(shape)
        out = torch.empty(x.shape[0], w.shape[0], device="cuda", dtype=torch.bfloat16)
        print(f"{shape}: cuBLAS logits GEMM (all rows, bf16 out) "
              f"{bench_ms(lambda: torch.mm(x, w.t(), out=out)):.3f} ms", flush=True)
        del out
        first = None
        for variant in args.variants.split(","):
            desc, tile = VARIANTS[variant]
            config.W_DESCRIPTOR = desc
            for cfg in config.CONFIG.values():
                cfg["logits"] = tile
            try:
                def stats():
                    return kernels.forward(x, w, b, t, -100, None, None)

                def sweep(low_memory):
                    return lambda: kernels.forward(
                        x, w, b, t, -100, None, None, coefs=co, need_dx=True, need_dw=True,
                        need_db=b is not None, low_memory=low_memory)
                config.ROW_CHUNKS = False
                lse = stats().lse
                first = lse if first is None else first
                diff = (lse - first).abs().max().item()
                ms = [bench_ms(stats), bench_ms(sweep(False)), bench_ms(sweep(True), rep=100)]
                print(f"  {variant:24s} stats {ms[0]:8.3f}  sweep {ms[1]:8.3f}  low_memory "
                      f"{ms[2]:8.3f} ms   lse diff {diff:.1e}", flush=True)
            except Exception as err:  # noqa: BLE001 (a configuration that fails)
                print(f"  {variant:24s} failed: {type(err).__name__}: {str(err)[:150]}")
            finally:
                config.ROW_CHUNKS = True
                config.W_DESCRIPTOR = True
                for name, cfg in config.CONFIG.items():
                    cfg["logits"] = dict(keep[name])
        del x, w, b, t, co
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
