"""The backward of a summed loss (``ops``): up to three gradients, computed by the forward pass
for an upstream gradient of 1 and kept unrounded (fp32), times the actual upstream gradient g
(an fp32 device scalar), each rounded once into its parameter's dtype, in one launch. A
destination may be its own source (in place: fp32 parameters).

One program scales BLOCK consecutive elements of one tensor: programs [0, t0) the first tensor,
[t0, t0 + t1) the second, the rest the third (t_k = cdiv(n_k, BLOCK)). torch's multiply by a
0-dim fp32 tensor followed by a cast is two launches per tensor, and its in-place multiply of
a 16-bit tensor takes a generic, non-vectorized kernel (H200: ~0.11 ms for BERT's dX, dW, db;
NOTES.md #30).
"""

import torch
import triton
import triton.language as tl

from fused_ce.kernels import config

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _scale_block(src, dst, n, blk, g, BLOCK: tl.constexpr):
    offs = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(src + offs, mask=mask)
    tl.store(dst + offs, (v.to(tl.float32) * g).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def scale_kernel(a_src, a_dst, na, b_src, b_dst, nb, c_src, c_dst, nc, g_ptr,
                 BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    ta = tl.cdiv(na, BLOCK)
    tb = tl.cdiv(nb, BLOCK)
    g = tl.load(g_ptr).to(tl.float32)
    if pid < ta:
        _scale_block(a_src, a_dst, na, pid, g, BLOCK)
    elif pid < ta + tb:
        _scale_block(b_src, b_dst, nb, pid - ta, g, BLOCK)
    else:
        _scale_block(c_src, c_dst, nc, pid - ta - tb, g, BLOCK)


def scalable(sources, dtypes, g: torch.Tensor) -> bool:
    """Whether scale_into takes these: at most three contiguous 16-bit or fp32 tensors on g's
    device, 16-bit or fp32 destination dtypes, g a one-element fp32 tensor."""
    return (len(sources) <= 3 and g.dtype == torch.float32 and g.numel() == 1
            and all(t.is_contiguous() and t.device == g.device and t.dtype in _DTYPES
                    and dt in _DTYPES for t, dt in zip(sources, dtypes)))


def scale_into(sources, dtypes, g: torch.Tensor) -> list:
    """[(s * g) in dtype for s, dtype] (``scalable``): fp32 products rounded once, in one
    launch; a source of its destination's dtype is scaled in place and returned."""
    cfg = config.current()["scale"]
    block = cfg["BLOCK"]
    outs = [s if s.dtype == dt else torch.empty(s.shape, dtype=dt, device=s.device)
            for s, dt in zip(sources, dtypes)]
    args, programs = [], 0
    for i in range(3):
        src, dst = (sources[i], outs[i]) if i < len(sources) else (g, g)  # no elements
        n = src.numel() if i < len(sources) else 0
        args += [src, dst, n]
        programs += triton.cdiv(n, block)
    if programs:
        scale_kernel[(programs,)](*args, g, BLOCK=block, num_warps=cfg["num_warps"])
    return outs
