"""The logits gradient of one (row block x vocabulary chunk), written to a workspace.

With the lse known (from the statistics pass or given), each logit's gradient is local::

    dz_ij = (prob_i + 2 * lse_sq_i * lse_i) * exp(z_ij - lse_i)
            - target_i * [j == t_i] - smooth_i * w_j          (times 1 - (z_ij/c)^2 with softcap c)

The tile's logits are recomputed (logits.py, bit-identical to the forward's) and dz is stored in
the input dtype as ``D[p - p0, j - v0]`` (compacted row position p, vocabulary column j), the A
operand of the dX and dW products (matmul.py); with ``D_BY_ROW`` as ``D[row(p), j - v0]`` (the
token's own row, for the cuBLAS products of gradients.py, which take x as it is). Column sums
of dz over the tile (fp32) go to ``db_part[row tile, j - v0]`` (row stride ldd, like D) for the
bias gradient; summing them in a fixed order keeps db deterministic. D holds dz times a power
of two (``scale_ptr``, 1 except for fp16, where it keeps the 1/N-sized gradients of a mean loss
out of fp16's subnormal range); the products divide it out.
"""

import triton
import triton.language as tl

from fused_ce.kernels.logits import cap_derivative, logits_tile
from fused_ce.kernels.row_loss import grad_coefs, smoothing


@triton.jit
def grad_logits_kernel(x_ptr, w_src, bias_ptr, cw_ptr, target_ptr, row_idx_ptr, n_valid_ptr,
                       lse_ptr, c_tgt_ptr, c_smooth_ptr, c_prob_ptr, c_lse_sq_ptr, scale_ptr,
                       d_ptr, ldd, db_ptr, p0, rows_in_block, v0, vc, V, H, softcap,
                       HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_CW: tl.constexpr,
                       STORE_D: tl.constexpr, D_BY_ROW: tl.constexpr, NEED_DB: tl.constexpr,
                       UPCAST: tl.constexpr,
                       IEEE: tl.constexpr, EVEN_K: tl.constexpr, W_DESC: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    n_valid = tl.load(n_valid_ptr)
    p_start = p0 + pid_m * BLOCK_M
    if p_start >= n_valid:
        return
    offs_p = p_start + tl.arange(0, BLOCK_M)
    in_block = offs_p < p0 + rows_in_block
    row_mask = in_block & (offs_p < n_valid)
    rows = tl.load(row_idx_ptr + offs_p, mask=row_mask, other=0)
    offs_j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = v0 + offs_j
    in_chunk = offs_j < vc
    col_mask = in_chunk & (cols < V)

    z = logits_tile(x_ptr, w_src, bias_ptr, rows, row_mask, v0 + pid_n * BLOCK_N, cols,
                    col_mask, H, softcap, HAS_BIAS, HAS_SOFTCAP, UPCAST, IEEE, EVEN_K, W_DESC,
                    BLOCK_M, BLOCK_N, BLOCK_K)

    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    # (masked rows read row 0's coefficients: their dz is zeroed below)
    alpha, c_tgt, c_smooth = grad_coefs(rows, lse, c_tgt_ptr, c_smooth_ptr, c_prob_ptr,
                                        c_lse_sq_ptr)
    tgt = tl.load(target_ptr + rows, mask=row_mask, other=-1)

    dz = alpha[:, None] * tl.exp(z - lse[:, None])
    dz -= tl.where(cols[None, :] == tgt[:, None], c_tgt[:, None], 0.0)
    dz -= smoothing(cols[None, :], col_mask[None, :], c_smooth[:, None], cw_ptr, HAS_CW)
    if HAS_SOFTCAP:
        dz *= cap_derivative(z, softcap)
    dz = tl.where(row_mask[:, None] & col_mask[None, :], dz, 0.0)

    if STORE_D:
        if D_BY_ROW:
            # D's row is the token's own row (the rows never written stay as allocated: zero)
            d_ptrs = d_ptr + rows.to(tl.int64)[:, None] * ldd + offs_j[None, :]
            d_mask = row_mask[:, None] & in_chunk[None, :]
        else:
            d_ptrs = d_ptr + (offs_p - p0).to(tl.int64)[:, None] * ldd + offs_j[None, :]
            d_mask = in_block[:, None] & in_chunk[None, :]
        tl.store(d_ptrs, (dz * tl.load(scale_ptr)).to(d_ptr.dtype.element_ty), mask=d_mask)
    if NEED_DB:
        tl.store(db_ptr + pid_m.to(tl.int64) * ldd + offs_j, tl.sum(dz, 0), mask=in_chunk)
