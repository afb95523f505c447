"""The summed loss of the sum op (``ops``) in one launch: the row losses' sum and, for 'mean',
``reference.mean_from_sum`` of it, where torch takes a reduction and four small ops (~0.1 ms of
host time per call; NOTES.md #78)."""

import torch
import triton
import triton.language as tl

from fused_ce import reference
from fused_ce.kernels import config


@triton.jit
def total_loss_kernel(rows_ptr, n, d_ptr, divisor_ptr, out_ptr, MEAN: tl.constexpr,
                      BLOCK: tl.constexpr):
    """One program: out = sum(rows[:n]) (lane-wise partial sums over BLOCK-row steps, then one
    tree reduction: a fixed order, deterministic), with MEAN that sum / divisor (correctly
    rounded, as torch divides) plus nan where the denominator d is 0."""
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    for i0 in range(0, n, BLOCK):
        acc += tl.load(rows_ptr + i0 + lanes, mask=i0 + lanes < n, other=0.0)
    total = tl.sum(acc, 0)
    if MEAN:
        d = tl.load(d_ptr)
        total = tl.math.div_rn(total, tl.load(divisor_ptr)) + tl.where(d == 0, float("nan"), 0.0)
    tl.store(out_ptr, total)


def total_loss(rows: torch.Tensor, mean_d=None, mean_divisor=None) -> torch.Tensor:
    """``reference.total_loss`` for contiguous fp32 row losses (and fp32 one-element mean
    denominator and divisor) on a device the kernels run on; torch otherwise."""
    mean = mean_divisor is not None
    scalars = (mean_d, mean_divisor) if mean else ()
    if rows.dtype != torch.float32 or not rows.is_contiguous() or rows.dim() != 1 or any(
            s.dtype != torch.float32 or s.numel() != 1 or s.device != rows.device
            for s in scalars):
        return reference.total_loss(rows, mean_d, mean_divisor)
    cfg = config.current()["total_loss"]
    out = torch.empty((), dtype=torch.float32, device=rows.device)
    total_loss_kernel[(1,)](rows, rows.shape[0], *(scalars or (rows, rows)), out, MEAN=mean,
                            BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"])
    return out
