"""Time the kernels' phases and a few tile configurations on the GPU (one device call).

    python tools/sweep.py [--shapes bert8k,llama3] [--variants A,B]

Per shape and variant: forward statistics only (inference), forward with gradients (default and
low_memory), and the gradient sweep alone (backward). Median ms via triton.testing.do_bench.
"""

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.bench import SHAPES, make_inputs  # noqa: E402
from fused_ce import kernels  # noqa: E402
from fused_ce.kernels import config  # noqa: E402
from fused_ce.reference import GradCoefs  # noqa: E402

VARIANTS = {
    "A": {},
    "B": {"logits": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
          "gemm": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)},
    "C": {"logits": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
          "gemm": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4)},
    "D": {"logits": dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=4, num_stages=4),
          "gemm": dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)},
}


def main():
    import triton.testing
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="bert8k,mlm,llama3")
    ap.add_argument("--variants", default="A,B,C,D")
    ap.add_argument("--rep-ms", type=float, default=200)
    args = ap.parse_args()
    base = copy.deepcopy(config.GPU)
    config.WIDE_H = 1 << 30  # the sweep sets the tiles itself
    for shape in args.shapes.split(","):
        n, h, v, bias, frac, kind = SHAPES[shape]
        x, w, b, t = make_inputs(shape)
        for p in (x, w, b):
            if p is not None:
                p.requires_grad_(False)
        valid = (t != -100).float()
        a = valid / valid.sum()
        z = torch.zeros_like(a)
        co = GradCoefs(a, z, a, z)
        flops = 2 * n * h * v * frac
        for var in args.variants.split(","):
            config.CONFIG["gpu"] = {**copy.deepcopy(base), **VARIANTS[var]}
            res = {}
            try:
                res["stats"] = lambda: kernels.forward(x, w, b, t, -100, None, None)
                res["fwd+grads"] = lambda: kernels.forward(
                    x, w, b, t, -100, None, None, coefs=co, need_dx=True, need_dw=True,
                    need_db=b is not None)
                res["fwd+grads lowmem"] = lambda: kernels.forward(
                    x, w, b, t, -100, None, None, coefs=co, need_dx=True, need_dw=True,
                    need_db=b is not None, low_memory=True)
                line = []
                for name, fn in res.items():
                    fn()
                    torch.cuda.synchronize()
                    ms = triton.testing.do_bench(fn, warmup=50, rep=args.rep_ms,
                                                 return_mode="median")
                    line.append(f"{name} {ms:7.3f} ms ({flops / ms / 1e9:5.0f} TF/GEMM-eq)")
                print(f"{shape:<8} {var}: " + " | ".join(line), flush=True)
            except Exception as exc:
                print(f"{shape:<8} {var}: FAILED {type(exc).__name__}: {str(exc)[:300]}",
                      flush=True)
        config.CONFIG["gpu"] = copy.deepcopy(base)


if __name__ == "__main__":
    main()
