"""In-place scaling of up to three gradient tensors by one fp32 device scalar, in one launch:
the backward of a summed loss (``ops``: the gradients come from the forward pass for an upstream
gradient of 1). Each element is multiplied in fp32 and rounded once to its tensor's dtype.

One program scales BLOCK consecutive elements of one tensor: programs [0, t0) the first tensor,
[t0, t0 + t1) the second, the rest the third (t_k = cdiv(n_k, BLOCK)). torch's own in-place
multiply by a 0-dim fp32 tensor of another dtype takes its generic, non-vectorized kernel, one
launch per tensor (H200: ~0.11 ms for BERT's dX, dW, db; NOTES.md #30).
"""

import torch
import triton
import triton.language as tl

from fused_ce.kernels import config


@triton.jit
def _scale_block(ptr, n, blk, g, BLOCK: tl.constexpr):
    offs = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(ptr + offs, mask=mask)
    tl.store(ptr + offs, (v.to(tl.float32) * g).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def scale_kernel(a_ptr, na, b_ptr, nb, c_ptr, nc, g_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    ta = tl.cdiv(na, BLOCK)
    tb = tl.cdiv(nb, BLOCK)
    g = tl.load(g_ptr).to(tl.float32)
    if pid < ta:
        _scale_block(a_ptr, na, pid, g, BLOCK)
    elif pid < ta + tb:
        _scale_block(b_ptr, nb, pid - ta, g, BLOCK)
    else:
        _scale_block(c_ptr, nc, pid - ta - tb, g, BLOCK)


def scalable(tensors, g: torch.Tensor) -> bool:
    """Whether scale_ takes these: at most three contiguous 16-bit or fp32 tensors on g's
    device, g a one-element fp32 tensor."""
    return (len(tensors) <= 3 and g.dtype == torch.float32 and g.numel() == 1
            and all(t.is_contiguous() and t.device == g.device
                    and t.dtype in (torch.bfloat16, torch.float16, torch.float32)
                    for t in tensors))


def scale_(tensors, g: torch.Tensor) -> None:
    """t *= g for each t in ``tensors`` (``scalable``), in one launch."""
    cfg = config.current()["scale"]
    block = cfg["BLOCK"]
    args, programs = [], 0
    for i in range(3):
        t = tensors[i] if i < len(tensors) else g  # a stand-in with no elements to scale
        n = t.numel() if i < len(tensors) else 0
        args += [t, n]
        programs += triton.cdiv(n, block)
    if programs:
        scale_kernel[(programs,)](*args, g, BLOCK=block, num_warps=cfg["num_warps"])
