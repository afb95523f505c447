"""The two gradient products over a workspace ``D`` of logits gradients (grad_logits.py).

* ``dx_kernel``:  dX[row(p)] (+)= sum_j D[p - p0, j] W[v0 + j]   (K = the vocabulary chunk)
  An fp32 accumulator ``acc`` (indexed by p - p0) carries dX across vocabulary chunks; the last
  chunk adds it and writes dX in the input dtype, so dX is rounded once.
* ``dw_kernel``:  dW[v0 + j] = sum_p D[p, j] x[row(p)]             (K = all valid rows)
  Each program reduces over every valid row in fp32 registers and writes its dW tile once: no
  accumulation across chunks, hence no bf16 drift and no fp32 dW buffer.

Rows are gathered through the compacted row index and the number of valid rows is read from device
memory: loops stop at it, tiles past it exit, and nothing waits on the host. D is scaled by a
power of two (grad_logits.py); the products divide it out before rounding.
"""

import triton
import triton.language as tl

from fused_ce.kernels.logits import mma


@triton.jit
def dx_kernel(d_ptr, ldd, scale_ptr, w_ptr, row_idx_ptr, n_valid_ptr, acc_ptr, dx_ptr,
              p0, rows_in_block, v0, vc, V, H,
              ACC_IN: tl.constexpr, WRITE_FINAL: tl.constexpr, UPCAST: tl.constexpr,
              IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    n_valid = tl.load(n_valid_ptr)
    p_start = p0 + pid_m * BLOCK_M
    if p_start >= n_valid:
        return
    offs_p = p_start + tl.arange(0, BLOCK_M)
    row_mask = (offs_p < p0 + rows_in_block) & (offs_p < n_valid)
    offs_h = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    h_mask = offs_h < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = d_ptr + (offs_p - p0).to(tl.int64)[:, None] * ldd + offs_k[None, :]
    b_ptrs = w_ptr + (v0 + offs_k).to(tl.int64)[:, None] * H + offs_h[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(vc, BLOCK_K)):
        kk = k * BLOCK_K + offs_k
        k_mask = (kk < vc) & (v0 + kk < V)
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & h_mask[None, :], other=0.0)
        acc = mma(a, b, acc, UPCAST, IEEE)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * H
    acc = acc / tl.load(scale_ptr)
    mask = row_mask[:, None] & h_mask[None, :]
    acc_ptrs = acc_ptr + (offs_p - p0).to(tl.int64)[:, None] * H + offs_h[None, :]
    if ACC_IN:
        acc += tl.load(acc_ptrs, mask=mask, other=0.0)
    if WRITE_FINAL:
        rows = tl.load(row_idx_ptr + offs_p, mask=row_mask, other=0)
        out = dx_ptr + rows.to(tl.int64)[:, None] * H + offs_h[None, :]
        tl.store(out, acc.to(dx_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(acc_ptrs, acc, mask=mask)


@triton.jit
def dw_kernel(d_ptr, ldd, scale_ptr, x_ptr, row_idx_ptr, n_valid_ptr, dw_ptr, v0, vc, V, H,
              UPCAST: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    n_valid = tl.load(n_valid_ptr)
    offs_j = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    j_mask = (offs_j < vc) & (v0 + offs_j < V)
    offs_h = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    h_mask = offs_h < H
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, n_valid, BLOCK_K):
        p = k0 + offs_k
        p_mask = p < n_valid
        rows = tl.load(row_idx_ptr + p, mask=p_mask, other=0)
        a = tl.load(d_ptr + p.to(tl.int64)[None, :] * ldd + offs_j[:, None],
                    mask=p_mask[None, :] & j_mask[:, None], other=0.0)
        b = tl.load(x_ptr + rows.to(tl.int64)[:, None] * H + offs_h[None, :],
                    mask=p_mask[:, None] & h_mask[None, :], other=0.0)
        acc = mma(a, b, acc, UPCAST, IEEE)
    acc = acc / tl.load(scale_ptr)
    out = dw_ptr + (v0 + offs_j).to(tl.int64)[:, None] * H + offs_h[None, :]
    tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=j_mask[:, None] & h_mask[None, :])
